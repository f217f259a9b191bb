"""What the benchmarks share: the Fashion-MNIST location, scratch-folder overrides, the privacy cost of a
selection made on private records, the machine and commit a table was measured on, the set-up and timing
of the per-example ways' tables (``conv_per_example.py``, ``grouped_conv_ways.py``), and a step's peak resident set
size on a CPU (``families.py``, ``speed.py``)."""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FASHION_MNIST = ROOT.parent / "shared" / "datasets" / "fashion-mnist"


def fashion_mnist_overrides(work: Path) -> list[str]:
    """``--set`` overrides pointing a configuration at Fashion-MNIST and every output at ``work``.

    Exits with a clear message when the data set is absent.
    """
    if not FASHION_MNIST.is_dir():
        sys.exit(f"skipped: {FASHION_MNIST} is absent")
    return [
        f"data.source=idx:{FASHION_MNIST}",
        f"paths.data={work / 'data'}",
        f"paths.artifacts={work / 'artifacts'}",
        f"paths.cache={work / 'cache'}",
        f"ledger.path={work / 'ledger.db'}",
        f"tracking.uri=sqlite:///{work / 'mlflow.db'}",
        f"tracking.artifact_root={work / 'mlartifacts'}",
    ]


def selection_epsilon(
    events: Sequence[Any],
    neighbouring: str,
    delta: float,
    clip_norm: float,
    dataset_size: int,
    threat_model: str = "all-iterates",
) -> float:
    """ε at δ of releasing the best of several candidates trained on the same private records: the
    release is covered by the composition of every candidate's ``events``, priced by dpml's accountants."""
    from dpml.accounting.accountants import certify
    from dpml.accounting.mechanism import MechanismDescription

    mechanism = MechanismDescription(
        trainer="selection",
        events=tuple(events),
        neighbouring=neighbouring,  # type: ignore[arg-type]
        clip_norm=clip_norm,
        dataset_size=dataset_size,
        threat_model=threat_model,
    )  # type: ignore[arg-type]
    return float(certify(mechanism, delta)["epsilon"])


def current_commit() -> str:
    """The checked-out commit (``+dirty`` with uncommitted changes to tracked files), or ``unknown`` outside git."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


VECTOR_EXTENSIONS = (("avx512f", "AVX-512"), ("avx2", "AVX2, no AVX-512"), ("avx", "AVX, no AVX2"))
"""x86 CPU flags, widest first, and how :func:`cpu_name` names them."""


def cpu_name() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``) and its widest vector instructions (a virtual machine's model
    name, "AMD EPYC", says nothing of them, and they set the CPU's speed of one kernel against another), else what
    ``platform`` knows."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), platform.machine())
    flags = next((set(line.split(":", 1)[1].split()) for line in info if line.startswith("flags")), set())
    widest = next((words for flag, words in VECTOR_EXTENSIONS if flag in flags), None)
    return f"{name} ({widest})" if widest else name


def without_paths(argv: Sequence[str]) -> list[str]:
    """A benchmark's arguments less ``--out`` and ``--work`` and their values: where this machine kept the files
    changes no number, and would write a path of the measuring machine onto the results page."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--out", "--work"):
            skip = True
        elif not arg.startswith(("--out=", "--work=")):
            kept.append(arg)
    return kept


def row_in_subprocess(command: list[str], timeout: int, cwd: Path, failed: dict[str, Any]) -> dict[str, Any]:
    """The row a sweep's subprocess prints as its last JSON line (one thread, nothing fetched from a hub); ``failed``
    with why where it gave none in ``timeout`` seconds or crashed."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment, cwd=cwd)
    except subprocess.TimeoutExpired:
        return failed | {"why": f"no answer in {timeout} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if lines:
        return dict(json.loads(lines[-1]))
    return failed | {"why": f"crashed: {done.stderr[-300:]}"}


def said(error: BaseException) -> str:
    """A sweep row's ``why``: the error's type and its message on one line, cut at 300 characters."""
    return f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"


def results_line(rows: list[dict[str, Any]]) -> str:
    """``Results: 204 trained, 16 not run, …``: how many rows have each result, the most first."""
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["result"]] = counts.get(row["result"], 0) + 1
    return "Results: " + ", ".join(f"{n} {r}" for r, n in sorted(counts.items(), key=lambda item: -item[1])) + "."


def ways_arguments(description: str) -> argparse.Namespace:
    """``--device``, ``--threads``, ``--repeats`` and ``--out`` of a per-example ways' table, applied: the
    thread count set, and on the CPU freed memory kept for the next call as the trainer keeps it, so that no
    way pays page faults for its fresh outputs."""
    import torch

    from dpml.devices import keep_freed_cpu_memory

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cpu":
        keep_freed_cpu_memory()
    return args


def ways_command(script: str, args: argparse.Namespace) -> str:
    """The command line that reproduces a per-example ways' table."""
    threads = f" --threads {args.threads}" if args.threads else ""
    return f"python benchmarks/{script} --device {args.device} --repeats {args.repeats}{threads}"


def median_ms_in_turn(functions: dict[str, Callable[[], Any]], device: str, repeats: int) -> dict[str, float]:
    """Each function's median milliseconds over ``repeats`` rounds, the functions in turn within a round (so a
    passing load falls on all of them alike), the GPU synchronised around each."""
    import torch

    def synchronise() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    times: dict[str, list[float]] = {name: [] for name in functions}
    for _ in range(repeats):
        for name, function in functions.items():
            synchronise()
            start = time.perf_counter()
            function()
            synchronise()
            times[name].append(1000 * (time.perf_counter() - start))
    return {name: statistics.median(values) for name, values in times.items()}


def ways_table(
    args: argparse.Namespace,
    stem: str,
    shapes: Sequence[Any],
    measure: Callable[[Any, str, int], dict],
    page: Callable[[list[dict], argparse.Namespace], str],
) -> None:
    """Every shape measured in full float32 (TF32 off, as the clipping engine forms per-example gradients), each
    row printed as it comes, and the rows and their page written to ``args.out`` as ``stem[_cuda].{json,md}``."""
    import json

    from dpml.devices import full_float32

    rows = []
    with full_float32():
        for shape in shapes:
            rows.append(measure(shape, args.device, args.repeats))
            print(rows[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = stem + ("_cuda" if args.device == "cuda" else "")
    text = page(rows, args)  # (first: the page names the commit, and a written JSON would make the tree dirty)
    (out / f"{name}.json").write_text(json.dumps(rows, indent=2))
    (out / f"{name}.md").write_text(text)
    print(text)


class CpuPeak:
    """The process's peak resident set size during a step, above its resident set size before it (Linux)."""

    def __init__(self) -> None:
        self.error: str | None = None
        try:
            self.trim = ctypes.CDLL(None).malloc_trim
            self.trim.argtypes, self.trim.restype = [ctypes.c_size_t], ctypes.c_int
        except (OSError, AttributeError):
            self.trim = None
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self._status("VmHWM")
        except (OSError, KeyError) as error:
            self.error = f"the peak resident set size cannot be reset here ({type(error).__name__}: {error})"

    @staticmethod
    def _status(key: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    def start(self) -> int:
        gc.collect()
        if self.trim is not None:
            self.trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        return self._status("VmRSS")

    def peak(self) -> int:
        return self._status("VmHWM")

    def during(self, run: Callable[[], object]) -> int:
        """Bytes of resident memory ``run()`` takes above what was resident before it."""
        before = self.start()
        run()
        return self.peak() - before
