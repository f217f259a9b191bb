"""dpml: privacy-audited model production. ``dpml.train_private`` is the Python API (:mod:`dpml.api`)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["DpConfig", "DpSgdSettings", "LedgerConfig", "PrivateTraining", "replace_batch_norm", "train_private"]
_HOME = {"replace_batch_norm": "dpml.models.batch_norm"}  # the rest are the API's (dpml.api)


def __getattr__(name: str) -> Any:
    """The API's names, imported on first use (``import dpml`` stays light for the CLI)."""
    if name in __all__:  # lazy: `import dpml` loads nothing until a name is used
        return getattr(importlib.import_module(_HOME.get(name, "dpml.api")), name)
    raise AttributeError(f"module 'dpml' has no attribute {name!r}")
