"""Progress of long loops (training steps, the audit's reference models), wherever the output goes.

* Inside a Prefect flow or task run: a few lines in the run's log (Prefect's API and its console),
  one at every fifth of the way, e.g. ``DP-SGD: 40% (300/750 steps, 12.1 s)``.
* Otherwise, when standard error is a terminal: a tqdm bar, removed when the loop ends.
* Otherwise (a file, a pipe, DVC's captured output): nothing.

Nothing here touches the loop's values: it counts iterations on the host, so a GPU loop wrapped in it
gains no synchronisation.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

LOG_LINES = 5
"""Lines a loop writes to a Prefect run's log: at 20%, 40%, …, 100%."""


def prefect_run_logger() -> logging.Logger | logging.LoggerAdapter | None:
    """The current Prefect flow or task run's logger, or None outside a run (Prefect is not imported
    for the question: a process that never imported it is in no run)."""
    if "prefect" not in sys.modules:
        return None
    from prefect import get_run_logger  # lazy: Prefect only inside a flow run
    from prefect.context import FlowRunContext, TaskRunContext  # lazy: Prefect only inside a flow run

    if TaskRunContext.get() is None and FlowRunContext.get() is None:
        return None
    return get_run_logger()


def progress_line(description: str, done: int, total: int, unit: str, seconds: float) -> str:
    """``DP-SGD: 40% (300/750 steps, 12.1 s)``."""
    percent = 100 * done // max(total, 1)
    return f"{description}: {percent}% ({done}/{total} {unit}s, {seconds:.1f} s)"


def _logged(
    items: Iterable[T], total: int, description: str, unit: str, log: logging.Logger | logging.LoggerAdapter
) -> Iterator[T]:
    """``items``, with a log line each time another fifth of ``total`` is done."""
    marks = {math.ceil(total * k / LOG_LINES) for k in range(1, LOG_LINES + 1)}
    start = time.perf_counter()
    for done, item in enumerate(items, start=1):
        yield item
        if done in marks:
            log.info("%s", progress_line(description, done, total, unit, time.perf_counter() - start))


def progress_over(items: Iterable[T], total: int, description: str, unit: str, show: bool = True) -> Iterable[T]:
    """``items`` (``total`` of them), reporting progress where it can be seen (see the module's docstring);
    ``show=False``: ``items`` untouched."""
    if not show or total <= 0:
        return items
    log = prefect_run_logger()
    if log is not None:
        return _logged(items, total, description, unit, log)
    if sys.stderr.isatty():
        from tqdm import tqdm  # lazy: tqdm only when a progress bar is shown

        return tqdm(items, total=total, desc=description, unit=unit, leave=False)
    return items


def progress_range(count: int, description: str, unit: str, show: bool) -> Iterable[int]:
    """``range(count)`` with progress (:func:`progress_over`); the training loops' counter."""
    return progress_over(range(count), count, description, unit, show)
