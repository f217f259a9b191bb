"""The engine's switches that ``benchmarks/engine_switches.py`` turns off name what the engine has: each an attribute
of its module, and where it is a function its stand-in takes the same arguments — so that a renamed or reshaped
choice fails here, not in a benchmark run that would then time the same engine twice."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from engine_switches import SWITCHES  # noqa: E402


@pytest.mark.parametrize("switch", sorted(SWITCHES))
def test_each_switch_names_an_attribute_the_engine_has_and_stands_in_for_it_alike(switch: str) -> None:
    module, name, stand_in, _, _ = SWITCHES[switch]
    assert hasattr(module, name), f"{module.__name__} has no {name}"
    current = getattr(module, name)
    assert callable(current) == callable(stand_in)
    if inspect.isfunction(current):
        expected = [p.name for p in inspect.signature(current).parameters.values()]
        assert len(inspect.signature(stand_in).parameters) == len(expected), (switch, expected)
