import numpy as np
import pytest
import torch

from dpml.audit.attacks import AttackInputs, loss_attack
from dpml.audit.metrics import roc, summarize, tpr_at_fpr
from dpml.audit.signals import cross_entropy_losses, logits_of
from dpml.models.mlp import MlpSpec, build_mlp


def test_perfect_separation() -> None:
    result = summarize(np.arange(100, 200.0), np.arange(0, 100.0))
    assert result["auc"] == 1.0 and result["tpr_at_0.1pct_fpr"] == 1.0 and result["advantage"] == 1.0


def test_reversed_scores_have_no_power() -> None:
    result = summarize(np.arange(0, 100.0), np.arange(100, 200.0))
    assert result["auc"] == 0.0 and result["tpr_at_1pct_fpr"] == 0.0


def test_hand_computed_example() -> None:
    # members 4, 3, 1; non-members 2, 0: thresholds ≥4 (TPR 1/3, FPR 0), ≥3 (2/3, 0), ≥2 (2/3, 1/2) …
    members, nonmembers = np.array([4.0, 3.0, 1.0]), np.array([2.0, 0.0])
    fpr, tpr = roc(members, nonmembers)
    assert tpr_at_fpr(fpr, tpr, 0.0) == pytest.approx(2 / 3)
    assert tpr_at_fpr(fpr, tpr, 0.5) == 1.0
    # AUC = P(member score > non-member score) = (2 + 2 + 1) / 6
    assert summarize(members, nonmembers)["auc"] == pytest.approx(5 / 6)


def test_chance_level_scores() -> None:
    rng = np.random.default_rng(0)
    result = summarize(rng.normal(size=20000), rng.normal(size=20000))
    assert abs(result["auc"] - 0.5) < 0.01 and result["tpr_at_1pct_fpr"] < 0.02


def test_losses_are_stable_at_extreme_logits() -> None:
    logits = np.array([[1000.0, -1000.0], [-1000.0, 1000.0]])
    losses = cross_entropy_losses(logits, np.array([0, 0]))
    assert losses[0] == pytest.approx(0.0) and losses[1] == pytest.approx(2000.0) and np.all(np.isfinite(losses))


def test_loss_attack_detects_an_overfit_model() -> None:
    """Positive control: a model that memorised random labels is separated by the LOSS attack."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(80, 20, generator=g)
    y = torch.randint(0, 4, (80,), generator=g)
    torch.manual_seed(0)
    model = build_mlp(MlpSpec(20, (128,), 4, "relu"))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    members = slice(0, 40)
    for _ in range(300):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[members]), y[members]).backward()
        optimizer.step()
    logits = logits_of(model, x.numpy())
    inputs = AttackInputs(logits, y.numpy(), logits[:0], y.numpy()[:0])
    scores = loss_attack(inputs)
    assert summarize(scores[:40], scores[40:])["auc"] > 0.9
