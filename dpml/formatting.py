"""How a certified ε is written wherever a person reads it: the run summary, the privacy report, the
certificate's statement, the gate's reasons, the MLflow run name, tags and model-version description.

One function, so the three windows (terminal, report, MLflow) show the same string. Six significant
digits: a calibrated ε just below its target (1.99994) is never shown as the target itself ("2").
"""

from __future__ import annotations

import math

EPSILON_DIGITS = 6


def format_epsilon(epsilon: float | None) -> str:
    """``1.99994`` for 1.999941…; ``inf`` for a model without a guarantee; ``none`` for no value."""
    if epsilon is None:
        return "none"
    if math.isinf(epsilon):
        return "inf"
    return f"{epsilon:.{EPSILON_DIGITS}g}"
