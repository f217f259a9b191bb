"""What reaches the terminal from the systems dpml drives: their noise stays out unless ``--verbose``.

Filtered (set before those libraries are imported, and inherited by the processes they start, such
as the Dask workers of a Prefect run):

* Dask's INFO logs (scheduler, nanny, worker start and stop, and the "Worker process still alive …
  killing" warning at shutdown), and Prefect's Dask task runner's own INFO lines;
* absl's warnings (``dp_accounting``'s RDP orders that fail to converge: they are excluded, safely);
* MLflow's INFO and WARNING logs and its artifact download progress bars;
* Prefect's own INFO lines on the console (a flow run began, its URL, each task run's "Finished in state
  Completed()"): Prefect's logging settings with :class:`PrefectOwnInfo` on its console handler
  (``PREFECT_LOGGING_SETTINGS_PATH``, inherited by its workers). dpml's lines through a run's logger (the
  progress of training and of the audit) still print, and every line still reaches the Prefect API and UI;
* Python warnings raised outside dpml's own code (``dpml: warning: …`` stays for dpml's own).

Errors of every library still reach the terminal; a variable the user already set is left alone.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import yaml

QUIET_ENVIRONMENT = {
    "DASK_LOGGING__DISTRIBUTED": "error",  # Dask's logging config: this process and its workers
    "MLFLOW_LOGGING_LEVEL": "ERROR",  # MLflow sets its loggers' level from this at import
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


class PrefectOwnInfo(logging.Filter):
    """Passes warnings and errors, and lines logged from dpml's own code; drops Prefect's own INFO lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or from_dpml(record.pathname)


FILTER_NAME = "dpml_prefect_own_info"


def prefect_console_settings() -> Path | None:
    """Prefect's own logging settings (its installed ``logging.yml``) with :class:`PrefectOwnInfo` on the console
    handler, in a new private file (``mkstemp``: no other user's file is ever read as settings) removed when this
    process exits; None where Prefect is not installed."""
    spec = importlib.util.find_spec("prefect")
    if spec is None or spec.origin is None:
        return None
    settings = yaml.safe_load((Path(spec.origin).parent / "logging" / "logging.yml").read_text(encoding="utf-8"))
    settings.setdefault("filters", {})[FILTER_NAME] = {"()": f"{__name__}.{PrefectOwnInfo.__name__}"}
    console = settings["handlers"]["console"]
    console["filters"] = [*console.get("filters", []), FILTER_NAME]
    handle, name = tempfile.mkstemp(prefix="dpml-prefect-logging-", suffix=".yml")
    with os.fdopen(handle, "w", encoding="utf-8") as file:
        yaml.safe_dump(settings, file, sort_keys=False)
    atexit.register(lambda: Path(name).unlink(missing_ok=True))
    return Path(name)


def _filter_prefect_consoles() -> None:
    """Prefect configured its logging already in this process: the filter on its console handlers as they are."""
    for logger in (
        logging.getLogger(),
        *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict) if n.startswith("prefect")),
    ):
        for handler in logger.handlers:
            if type(handler).__name__ == "PrefectConsoleHandler" and not any(
                isinstance(f, PrefectOwnInfo) for f in handler.filters
            ):
                handler.addFilter(PrefectOwnInfo())


def quiet_third_party_output() -> None:
    """Keep Dask's, absl's, MLflow's and Prefect's noise out of this process's output and its children's."""
    for name, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    if "PREFECT_LOGGING_SETTINGS_PATH" not in os.environ:  # an operator's own settings stand
        settings = prefect_console_settings()
        if settings is not None:
            os.environ["PREFECT_LOGGING_SETTINGS_PATH"] = str(settings)
            if "prefect" in sys.modules:
                _filter_prefect_consoles()
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


def warning_line(
    message: warnings.WarningMessage | Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
    *,
    verbose: bool = False,
) -> None:
    """A warning as one ``dpml: warning: …`` line; other libraries' warnings only with ``--verbose``."""
    if verbose or from_dpml(filename):
        print(f"dpml: warning: {message}", file=sys.stderr)
