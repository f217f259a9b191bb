"""Fault injection for the reliability tests: ``DPML_FAULT=<point>`` kills the process at that point.

The pipeline calls :func:`fault_point` at each stage boundary (``after:<stage>``, ``before:<stage>``)
and inside registration (``register:after_version``, ``register:after_alias``,
``register:before_released_event``) and inside the ledger's reservation (``ledger:units_written``). With the variable unset it does nothing. The
kill is a real ``SIGKILL`` (no ``finally`` blocks, no atexit handlers), so the tests see exactly what
a power cut or an out-of-memory kill leaves behind.
"""

from __future__ import annotations

import os
import signal

FAULT_VARIABLE = "DPML_FAULT"


def fault_point(name: str) -> None:
    """SIGKILL this process when ``DPML_FAULT`` names this point."""
    if os.environ.get(FAULT_VARIABLE) == name:
        os.kill(os.getpid(), signal.SIGKILL)
