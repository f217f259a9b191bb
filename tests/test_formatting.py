"""One formatting of ε for the summary, the report and MLflow (dpml.formatting)."""

from __future__ import annotations

import numpy as np
import pytest

from dpml.formatting import format_epsilon, format_lower_bound, format_score


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (1.9994, "1.9994"),
        (1.99996, "1.99996"),
        (1.9999967848742883, "1.999997"),
        (2.999999999, "2.999999999"),
        (2.0, "2"),
        (3.00001, "3.00001"),
        (2.999871234, "2.99988"),
        (4.178223609042274, "4.17823"),
        (0.0123456789, "0.0123457"),
        (1.23456789e-7, "1.23457e-07"),
        (float("inf"), "inf"),
        (None, "none"),
    ],
)
def test_a_calibrated_epsilon_is_never_rounded_to_its_target(value: float | None, shown: str) -> None:
    assert format_epsilon(value) == shown


@pytest.mark.parametrize("value", [1.999943217, 1.9999967848742883, 0.99999999, 4.178223609042274])
def test_the_tag_parses_back_within_the_shown_digits(value: float) -> None:
    assert float(format_epsilon(value)) == pytest.approx(value, rel=1e-5) and float(format_epsilon(value)) != round(
        value
    )


def test_each_number_is_written_on_the_side_of_its_value_that_keeps_its_claim_true() -> None:
    """A certified ε is an upper bound: the ε written (and parsed back, as MLflow's metric does) is never below it,
    and at most one unit of its sixth significant digit above. An audit's lower bound is written never above
    itself, within one unit of its fourth digit; a score to the nearest fourth digit. Pins rounding to nearest
    (the old ``.6g``, which wrote 4.17822 for 4.1782236) and rounding on the binary value instead of its shortest
    decimal (which writes 3.00002 for the float 3.00001)."""
    rng = np.random.default_rng(7)
    values = np.concatenate(
        [
            10.0 ** rng.uniform(-8, 8, 20_000),
            rng.uniform(0.5, 20, 20_000),
            np.round(rng.uniform(0, 10, 2_000), 5),
            [1.0, 3.00001, 0.1, 1e-5, 2.675],
        ]
    )
    for value in map(float, values):
        shown = float(format_epsilon(value))
        assert value <= shown <= value * (1 + 1e-5) * (1 + 1e-12), value
        low = float(format_lower_bound(value))
        assert value * (1 - 1e-3) * (1 - 1e-12) <= low <= value, value
        assert float(format_score(value)) == pytest.approx(value, rel=5e-4), value
    assert format_epsilon(3.00001) == "3.00001" and format_lower_bound(2.675) == "2.675"
    assert format_lower_bound(0.51569) == "0.5156" and format_score(6 / 7) == "0.8571"
    assert format_lower_bound(0.0) == "0" and format_lower_bound(float("-inf")) == "-inf"
