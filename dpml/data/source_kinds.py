"""Data sources of your own, by the scheme ``data.source`` names (``scheme:rest``), shaped like the trainer
registry: one file registers a :class:`SourceKind` (a plugin module listed under ``plugins:``, imported before
the configuration is validated).

The built-in schemes (``sklearn``, ``idx``, ``csv``, ``parquet``: :mod:`dpml.data.sources`) are read by dpml
itself; a registered kind brings ``check(rest)``, run when the configuration is validated (a problem refuses
the run before any work, naming ``data.source``), and ``load(rest)``, which returns the records with their
*public* class list. dpml checks what it returns as it checks its own sources (:func:`check_records`: no empty
data, no NaN or infinite feature, every label one of the classes, two classes at least) before anything is
stored; every row is then its own privacy unit, identified by its content.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dpml.data.records import DataError, RawData, check_records
from dpml.definitions import same_definition

BUILT_IN = ("sklearn", "idx", "csv", "parquet")


def source_name(source: str) -> str:
    """The name of a ``data.source``: the file or folder name without extension (``csv:data/adult.csv``
    → ``adult``, ``idx:…/fashion-mnist`` → ``fashion-mnist``), or the bundled set's name. It names the
    ledger's lineage and the registered model unless the configuration names them."""
    scheme, _, rest = source.partition(":")
    if scheme == "sklearn":
        return rest
    path = Path(rest.rstrip("/\\") or rest)
    return path.name if scheme == "idx" else path.stem


def default_model_name(source: str) -> str:
    """``dpml-<source name>``, with characters a registered model name cannot hold replaced by '-'."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", source_name(source)).strip("-._") or "data"
    return f"dpml-{name}"[:200]


def _no_problem(rest: str) -> str | None:
    return None


@dataclass(frozen=True)
class SourceKind:
    """One kind of source: its ``scheme``, its ``load(rest) -> RawData`` and its ``check(rest)``, the problem
    with the part after the colon (or None), before any work."""

    scheme: str
    load: Callable[[str], RawData]
    check: Callable[[str], str | None] = _no_problem


SOURCES: dict[str, SourceKind] = {}


def register_source(kind: SourceKind) -> SourceKind:
    """Add a source kind under its scheme; a built-in scheme or a second kind of the same scheme is refused."""
    if kind.scheme in BUILT_IN or not kind.scheme.isidentifier():
        raise ValueError(
            f"source scheme {kind.scheme!r}: built-in schemes ({', '.join(BUILT_IN)}) are taken, and a "
            "scheme is a name of letters, digits and underscores"
        )
    registered = SOURCES.get(kind.scheme)
    if registered is not None and registered != kind and not same_definition(registered.load, kind.load):
        raise ValueError(f"a source of scheme {kind.scheme!r} is already registered")
    SOURCES[kind.scheme] = kind
    return kind


def load_registered(scheme: str, rest: str) -> RawData:
    """The records of a registered source, checked as dpml checks its own."""
    raw = SOURCES[scheme].load(rest)
    if not isinstance(raw, RawData):
        raise DataError(f"{scheme}:{rest}: the {scheme} source returned {type(raw).__name__}, not RawData")
    check_records(raw.x, raw.y, len(raw.classes), raw.origin)
    if raw.x_test is not None and raw.y_test is not None:
        check_records(raw.x_test, raw.y_test, len(raw.classes), f"{raw.origin} (test)")
    return raw
