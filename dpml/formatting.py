"""How a certified ε, an audit's lower bound and a measured score are written wherever a person reads them:
the run summary, the privacy report, the certificate's statement, the gate's reasons, the MLflow run name, tags,
model-version description and the parent run's metrics.

One function each, so the three windows (terminal, report, MLflow) show the same string, and each rounds in the
direction that keeps its claim true:

- a certified ε is an upper bound (the release is (ε', δ)-DP for every ε' ≥ ε), so it is written rounded **up**:
  six significant digits, and more (up to ten) while rounding would show a rounder number than the value. σ is
  calibrated so that ε lands just below its target, and 1.9999968 is written 1.999997, never 2; 4.1782236 is
  written 4.17823, never 4.17822, which would claim more privacy than was proven;
- an audit's ε lower bound is a lower bound, written rounded **down** (four significant digits): written higher,
  it would claim more evidence of leakage than the attacks found;
- a measured score (accuracy) has no direction: four significant digits, rounded to nearest.

Every written number parses back (``float``) to a value on its side of the one it stands for: the rounding is
done on the shortest decimal that reads back as the value (``repr``), and parsing is monotone.
"""

from __future__ import annotations

import math
from decimal import ROUND_CEILING, ROUND_FLOOR, ROUND_HALF_EVEN, Decimal

EPSILON_DIGITS = 6
MAX_EPSILON_DIGITS = 10
BOUND_DIGITS = 4
SCORE_DIGITS = 4


def _significant_digits(shown: str) -> int:
    """How many significant digits a ``g``-formatted number shows (``2`` → 1, ``1.99994`` → 6)."""
    return len(shown.split("e")[0].replace("-", "").replace(".", "").lstrip("0"))


def _rounded(value: float, digits: int, rounding: str) -> str:
    """``value`` (finite) at ``digits`` significant digits, rounded in the direction ``rounding`` (a
    :mod:`decimal` mode), in ``g`` notation."""
    if value == 0:
        return "0"
    exact = Decimal(repr(value))
    step = Decimal(1).scaleb(exact.adjusted() - digits + 1)
    return f"{float(exact.quantize(step, rounding=rounding)):.{digits}g}"


def format_epsilon(epsilon: float | None) -> str:
    """``4.17823`` for 4.1782236…, ``1.999997`` for 1.9999968…, ``2`` for 2.0, never below the value;
    ``inf`` for a model without a guarantee; ``none`` for no value."""
    if epsilon is None:
        return "none"
    if math.isinf(epsilon):
        return "inf"
    for digits in range(EPSILON_DIGITS, MAX_EPSILON_DIGITS):
        shown = _rounded(epsilon, digits, ROUND_CEILING)
        if _significant_digits(shown) == digits:
            return shown
    return _rounded(epsilon, MAX_EPSILON_DIGITS, ROUND_CEILING)


def format_lower_bound(bound: float) -> str:
    """An audit's ε lower bound, four significant digits, never above the value (``0.5156`` for 0.51569)."""
    return f"{bound:g}" if not math.isfinite(bound) else _rounded(bound, BOUND_DIGITS, ROUND_FLOOR)


def format_score(score: float) -> str:
    """A measured score such as an accuracy, four significant digits (``0.8571`` for 6/7)."""
    return f"{score:g}" if not math.isfinite(score) else _rounded(score, SCORE_DIGITS, ROUND_HALF_EVEN)
