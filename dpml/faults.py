"""Fault injection for the reliability tests: ``DPML_FAULT=<point>[@<how>]`` breaks the run at that point.

The pipeline calls :func:`fault_point` at each stage boundary (``after:<stage>``, ``before:<stage>``),
inside registration (``register:before_version``, ``register:after_version``, ``register:after_alias``,
``register:before_released_event``) and inside the ledger's reservation (``ledger:units_written``) and at
the start of training (``train:started``: the spend counts, the previous run's model is still in place).
With the variable unset it does nothing. ``<how>`` says what happens there:

- nothing (``DPML_FAULT=register:after_version``): a real ``SIGKILL`` — no ``finally`` blocks, no atexit
  handlers, exactly what a power cut or an out-of-memory kill leaves behind;
- ``SIGINT`` / ``SIGTERM`` / any signal name: that real signal sent to this process (Ctrl-C, a
  scheduler stopping the run), handled by whatever handlers the process has;
- ``error``: a :class:`TransientStoreError`, once per process (the first time the point is reached), as
  a store that answers "database is locked" once and then recovers — what a retrying driver meets.
"""

from __future__ import annotations

import os
import signal

FAULT_VARIABLE = "DPML_FAULT"

_fired: set[str] = set()


class TransientStoreError(RuntimeError):
    """An injected, one-time store failure (``DPML_FAULT=<point>@error``)."""


def fault_point(name: str) -> None:
    """Break the run here when ``DPML_FAULT`` names this point (module docstring)."""
    point, _, how = os.environ.get(FAULT_VARIABLE, "").partition("@")
    if point != name:
        return
    if not how:
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "error":
        if name not in _fired:
            _fired.add(name)
            raise TransientStoreError(f"(injected at {name}) database is locked")
    else:
        os.kill(os.getpid(), getattr(signal, how.upper()))
