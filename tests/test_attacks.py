"""LiRA and RMIA on synthetic populations where per-example difficulty hides membership from LOSS."""

import numpy as np
import pytest

from dpml.audit.attacks import AttackInputs, lira_attack, loss_attack, rmia_attack
from dpml.audit.metrics import summarize
from dpml.audit.signals import logit_scaled_confidence


def two_class_logits(phi: np.ndarray) -> np.ndarray:
    """Logits [φ, 0] with label 0 have logit-scaled confidence exactly φ."""
    return np.stack([phi, np.zeros_like(phi)], axis=-1)


def world(
    n: int = 400, n_pop: int = 400, refs: int = 8, shift: float = 2.0, seed: int = 0
) -> tuple[AttackInputs, np.ndarray]:
    rng = np.random.default_rng(seed)
    total = n + n_pop
    difficulty = rng.normal(0, 4, size=total)  # per-example baseline confidence, wide spread
    member = np.r_[np.ones(n // 2, bool), np.zeros(n - n // 2, bool), np.zeros(n_pop, bool)]
    target_phi = difficulty + shift * member + rng.normal(0, 0.5, total)
    ref_in = rng.random((refs, total)) < 0.5
    ref_phi = difficulty + shift * ref_in + rng.normal(0, 0.5, (refs, total))
    labels = np.zeros(total, int)
    logits, ref_logits = two_class_logits(target_phi), two_class_logits(ref_phi)
    inputs = AttackInputs(
        logits[:n],
        labels[:n],
        logits[n:],
        labels[n:],
        ref_logits[:, :n],
        ref_in[:, :n],
        ref_logits[:, n:],
        ref_in[:, n:],
    )
    return inputs, member[:n]


def auc_of(scores: np.ndarray, member: np.ndarray) -> float:
    return summarize(scores[member], scores[~member])["auc"]


def test_logit_scaled_confidence_of_the_construction() -> None:
    phi = np.array([-3.0, 0.0, 40.0])
    assert np.allclose(logit_scaled_confidence(two_class_logits(phi), np.zeros(3, int)), phi)


@pytest.mark.parametrize(
    ("attack", "minimum"),
    [
        (lambda i: lira_attack(i, online=True), 0.95),
        (lambda i: lira_attack(i, online=False), 0.95),
        (lambda i: lira_attack(i, online=True, variance="per-example"), 0.9),
        (lambda i: rmia_attack(i, online=True), 0.9),
        # offline RMIA's linear approximation of Pr(x) (parameter a) is coarse in this world
        (lambda i: rmia_attack(i, online=False, a=0.3), 0.78),
    ],
)
def test_reference_attacks_see_through_per_example_difficulty(attack, minimum: float) -> None:
    inputs, member = world()
    loss_auc = auc_of(loss_attack(inputs), member)
    assert loss_auc < 0.7  # difficulty dominates the raw loss
    assert auc_of(attack(inputs), member) > minimum


def test_attacks_are_at_chance_without_leakage() -> None:
    inputs, member = world(shift=0.0, seed=1)
    for attack in (lira_attack, rmia_attack, loss_attack):
        assert abs(auc_of(attack(inputs), member) - 0.5) < 0.1


def test_lira_handles_examples_without_in_or_out_models() -> None:
    inputs, member = world(refs=2, seed=2)
    ref_in = inputs.reference_in.copy()
    ref_in[:, :5] = False  # no IN model for the first five
    ref_in[:, 5:10] = True  # no OUT model for the next five
    patched = AttackInputs(**{**inputs.__dict__, "reference_in": ref_in})
    for online in (True, False):
        assert np.all(np.isfinite(lira_attack(patched, online=online)))


def test_rmia_gamma_counts_population_records_beaten() -> None:
    inputs, _ = world(seed=3)
    low, high = rmia_attack(inputs, gamma=0.5), rmia_attack(inputs, gamma=4.0)
    assert np.all(low >= high) and np.all((0 <= high) & (low <= 1))


def test_reference_attacks_refuse_without_references() -> None:
    inputs, _ = world()
    bare = AttackInputs(inputs.logits, inputs.labels, inputs.population_logits, inputs.population_labels)
    with pytest.raises(ValueError, match="reference models"):
        lira_attack(bare)
    with pytest.raises(ValueError, match="reference models"):
        rmia_attack(bare)
