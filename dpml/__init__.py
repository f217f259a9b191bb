"""dpml: privacy-audited model production. ``dpml.train_private`` is the Python API (:mod:`dpml.api`)."""

from __future__ import annotations

from typing import Any

__all__ = ["DpConfig", "DpSgdSettings", "LedgerConfig", "PrivateTraining", "train_private"]


def __getattr__(name: str) -> Any:
    """The API's names, imported on first use (``import dpml`` stays light for the CLI)."""
    if name in __all__:
        from dpml import api  # lazy: `import dpml` loads nothing until the API is used

        return getattr(api, name)
    raise AttributeError(f"module 'dpml' has no attribute {name!r}")
