"""How a certified ε is written wherever a person reads it: the run summary, the privacy report, the
certificate's statement, the gate's reasons, the MLflow run name, tags and model-version description.

One function, so the three windows (terminal, report, MLflow) show the same string. Six significant
digits, and more (up to ten) while rounding would show a rounder number than the value: σ is calibrated
so that ε lands just below its target, and 1.9999968 is written 1.999997, never 2.
"""

from __future__ import annotations

import math

EPSILON_DIGITS = 6
MAX_EPSILON_DIGITS = 10


def _significant_digits(shown: str) -> int:
    """How many significant digits a ``g``-formatted number shows (``2`` → 1, ``1.99994`` → 6)."""
    return len(shown.split("e")[0].replace("-", "").replace(".", "").lstrip("0"))


def format_epsilon(epsilon: float | None) -> str:
    """``4.17822`` for 4.178223…, ``1.999997`` for 1.9999968…, ``2`` for 2.0; ``inf`` for a model without
    a guarantee; ``none`` for no value."""
    if epsilon is None:
        return "none"
    if math.isinf(epsilon):
        return "inf"
    for digits in range(EPSILON_DIGITS, MAX_EPSILON_DIGITS):
        shown = f"{epsilon:.{digits}g}"
        if _significant_digits(shown) == digits:
            return shown
    return f"{epsilon:.{MAX_EPSILON_DIGITS}g}"
