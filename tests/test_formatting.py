"""One formatting of ε for the summary, the report and MLflow (dpml.formatting)."""

from __future__ import annotations

import pytest

from dpml.formatting import format_epsilon


@pytest.mark.parametrize(("value", "shown"), [
    (1.9994, "1.9994"), (1.99996, "1.99996"), (1.9999967848742883, "1.999997"), (2.999999999, "2.999999999"),
    (2.0, "2"), (3.00001, "3.00001"), (2.999871234, "2.99987"), (0.0123456789, "0.0123457"), (1.23456789e-7, "1.23457e-07"),
    (float("inf"), "inf"), (None, "none"),
])
def test_a_calibrated_epsilon_is_never_rounded_to_its_target(value: float | None, shown: str) -> None:
    assert format_epsilon(value) == shown


@pytest.mark.parametrize("value", [1.999943217, 1.9999967848742883, 0.99999999, 4.178223609042274])
def test_the_tag_parses_back_within_the_shown_digits(value: float) -> None:
    assert float(format_epsilon(value)) == pytest.approx(value, rel=5e-6) and float(format_epsilon(value)) != round(value)
