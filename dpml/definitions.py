"""Where a class or function was defined, for the registries (trainers, attacks, data sources): a plugin module
imported a second time under another name (by its path, then by its dotted name) defines its classes and
functions again, and registering them again must replace the first registration, not be refused."""

from __future__ import annotations

from typing import Any


def defined_at(obj: Any) -> tuple[str, str | None]:
    """(qualified name, source file) of a function or class (a class by its methods' file; None where unknown)."""
    code = getattr(obj, "__code__", None)
    if code is None and isinstance(obj, type):
        code = next((value.__code__ for value in vars(obj).values() if hasattr(value, "__code__")), None)
    return getattr(obj, "__qualname__", ""), None if code is None else code.co_filename


def same_definition(a: Any, b: Any) -> bool:
    """``a`` is ``b``, or both come from the same definition in the same, known source file."""
    return a is b or (defined_at(a) == defined_at(b) and defined_at(a)[1] is not None)
