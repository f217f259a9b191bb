"""A real browser for the tests that read a page as a person sees it: headless Chromium driven through the Chrome
DevTools Protocol (``--remote-debugging-port``, spoken over ``websockets``, which Prefect already installs), at a
given window size, so a test can ask where an element lands on the screen, not only whether it is in the DOM."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import websockets


def chromium() -> str | None:
    """Chromium's executable (Debian's ``chromium``; ``scripts/test.sh`` installs it where it can)."""
    return next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)


def _debugging_port(profile: Path, process: subprocess.Popen[bytes], timeout: float = 30.0) -> str:
    found = profile / "DevToolsActivePort"
    end = time.monotonic() + timeout
    while time.monotonic() < end and process.poll() is None:
        if found.exists() and found.read_text().strip():
            return found.read_text().split()[0]
        time.sleep(0.1)
    raise RuntimeError(f"Chromium did not open its debugging port (exit status {process.poll()})")


async def _evaluate_until(
    websocket_url: str, url: str, width: int, height: int, script: str, ready: Callable[[Any], bool], timeout: float
) -> Any:
    async with websockets.connect(websocket_url, max_size=None) as socket:
        counter = 0

        async def call(method: str, **params: Any) -> dict[str, Any]:
            nonlocal counter
            counter += 1
            await socket.send(json.dumps({"id": counter, "method": method, "params": params}))
            while True:
                message = json.loads(await socket.recv())
                if message.get("id") == counter:
                    return dict(message.get("result", message))

        await call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        await call("Page.navigate", url=url)
        value, end = None, time.monotonic() + timeout
        while time.monotonic() < end:
            value = (
                (await call("Runtime.evaluate", expression=script, returnByValue=True)).get("result", {}).get("value")
            )
            if value is not None and ready(value):
                return value
            await asyncio.sleep(1.0)
        return value


def evaluate_in_page(
    url: str, script: str, ready: Callable[[Any], bool], *, width: int = 1600, height: int = 1000, timeout: float = 90.0
) -> Any:
    """Open ``url`` in a ``width`` × ``height`` window and evaluate ``script`` (a JavaScript expression returning
    JSON-able data) once a second until ``ready`` accepts its value or ``timeout`` passes; the last value."""
    executable = chromium()
    assert executable is not None, "no Chromium"
    profile = Path(tempfile.mkdtemp(prefix="dpml-chromium-"))
    process = subprocess.Popen(
        [
            executable,
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            f"--window-size={width},{height}",
            f"--user-data-dir={profile}",
            "--remote-debugging-port=0",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        port = _debugging_port(profile, process)
        targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=30).read())
        page = next(t for t in targets if t["type"] == "page")
        return asyncio.run(_evaluate_until(page["webSocketDebuggerUrl"], url, width, height, script, ready, timeout))
    finally:
        process.kill()
        process.wait(timeout=30)
        shutil.rmtree(profile, ignore_errors=True)


# Every cell of an ag-grid table (MLflow's runs list) that the browser drew: its column id, text and horizontal
# extent on the screen. The grid draws only the columns inside the window, so a column off to the right is absent.
GRID_CELLS = r"""(() => Array.from(document.querySelectorAll('[role=gridcell][col-id]')).map(el => {
  const box = el.getBoundingClientRect();
  return {column: el.getAttribute('col-id'), text: (el.innerText || '').trim(), left: box.left, right: box.right};
}))()"""
