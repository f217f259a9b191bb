"""What reaches the terminal from the systems dpml drives: their noise stays out unless ``--verbose``.

Filtered (set before those libraries are imported, and inherited by the processes they start, such
as the Dask workers of a Prefect run):

* Dask's INFO logs (scheduler, nanny, worker start and stop, and the "Worker process still alive …
  killing" warning at shutdown), and Prefect's Dask task runner's own INFO lines;
* absl's warnings (``dp_accounting``'s RDP orders that fail to converge: they are excluded, safely);
* MLflow's INFO and WARNING logs and its artifact download progress bars;
* Python warnings raised outside dpml's own code (``dpml: warning: …`` stays for dpml's own).

Errors of every library still reach the terminal; a variable the user already set is left alone.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

QUIET_ENVIRONMENT = {
    "DASK_LOGGING__DISTRIBUTED": "error",          # Dask's logging config: this process and its workers
    "MLFLOW_LOGGING_LEVEL": "ERROR",               # MLflow sets its loggers' level from this at import
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
}

QUIET_LEVELS = {"distributed": logging.ERROR, "absl": logging.ERROR, "mlflow": logging.ERROR}
"""Levels set directly too, for libraries this process imported before the CLI started."""

DASK_RUNNER_LOGGER = "prefect.task_runner.dask"
"""Prefect's Dask task runner: a child of the ``prefect`` logger, whose level Prefect resets when it
configures logging, so its INFO lines are dropped by a filter (which Prefect leaves in place)."""

DPML_SOURCES = tuple(str(Path(__file__).resolve().parent.parent / name) + os.sep for name in ("dpml", "flows", "tasks"))


class _WarningsAndAbove(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


def quiet_third_party_output() -> None:
    """Keep Dask's, absl's and MLflow's noise out of this process's output and its children's."""
    for name, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    try:
        import absl.logging  # noqa: F401 - lazy: absl's logger class must exist before its level is set
    except ImportError:  # absl comes with dp_accounting; without it there is nothing to quieten
        pass
    for name, level in QUIET_LEVELS.items():
        logging.getLogger(name).setLevel(level)
    logging.getLogger(DASK_RUNNER_LOGGER).addFilter(_WarningsAndAbove())


def from_dpml(filename: str) -> bool:
    """Whether a warning was raised in dpml's own code (the packages dpml, flows, tasks)."""
    return str(Path(filename).resolve()).startswith(DPML_SOURCES)


def warning_line(message: warnings.WarningMessage | Warning | str, category: type[Warning], filename: str,
                 lineno: int, file: Any = None, line: str | None = None, *, verbose: bool = False) -> None:
    """A warning as one ``dpml: warning: …`` line; other libraries' warnings only with ``--verbose``."""
    if verbose or from_dpml(filename):
        print(f"dpml: warning: {message}", file=sys.stderr)
