"""The audit can fail a release: gradient canaries, and a deliberately broken trainer being caught."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

import dpml.train.trainers.dpsgd as fit_module  # the DP-SGD trainer module: where the pipeline calls train_dpsgd
from dpml import stages
from dpml.config import load
from dpml.models.mlp import MlpSpec, build_mlp
from dpml.privacy.mechanism import PoissonGaussianSteps
from dpml.audit.conformance import ConformanceProbe, canary_scores
from dpml.train.dpsgd import per_example_cross_entropy, train_dpsgd
from tests.conftest import small_params, write_params


def test_gradient_canary_observations_follow_the_subsampled_gaussian() -> None:
    """Included canaries gain C per sampled step (≈ T·q·C in all), excluded ones none; each canary's
    summed observation has noise std √T·σC — as seen by the auditor's probe through the trainer."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(200, 5, generator=g), torch.randint(0, 3, (200,), generator=g)
    model = build_mlp(MlpSpec(5, (), 3))
    m = 18  # all 18 parameters
    rng = np.random.default_rng(0)
    q, sigma, clip, epochs = 0.2, 0.5, 1.0, 40.0
    probe = ConformanceProbe(x, y, per_example_cross_entropy, sigma, clip, q, 200, rng.permutation(m),
                             np.arange(m) % 2 == 0)
    result = train_dpsgd(model, x, y, sample_rate=q, epochs=epochs, clip_norm=clip, noise_multiplier=sigma,
                         neighbouring="add-remove", optimizer=torch.optim.SGD(model.parameters(), lr=0.01), seed=1,
                         canaries=probe.canaries())
    n_total, steps = 200 + 9, 200
    assert result.mechanism.dataset_size == n_total
    scores = canary_scores(probe, "sum")
    noise_sd = np.sqrt(steps) * sigma * clip
    included = probe.included
    gap = scores[included].mean() - scores[~included].mean()
    assert gap == pytest.approx(steps * q * clip, abs=4 * noise_sd / 3)
    assert scores[~included].std() == pytest.approx(noise_sd, rel=0.6)


def broken_train_dpsgd(*args, noise_multiplier: float, **kwargs):
    """A trainer bug: adds 1/100 of the noise it reports to the accountant."""
    result = fit_module.__dict__["_real_train_dpsgd"](*args, noise_multiplier=noise_multiplier / 100, **kwargs)
    claimed = tuple(PoissonGaussianSteps(e.sample_rate, noise_multiplier, e.steps) for e in result.mechanism.events)
    result.mechanism = dataclasses.replace(result.mechanism, events=claimed)
    return result


@pytest.mark.slow
def test_gate_catches_a_trainer_that_adds_too_little_noise(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(fit_module.__dict__, "_real_train_dpsgd", fit_module.train_dpsgd)
    monkeypatch.setattr(fit_module, "train_dpsgd", broken_train_dpsgd)
    params = small_params(workdir, dp={"noise_multiplier": 3.0}, gate={"epsilon_budget": 10.0},
                          audit={"references": 1, "attacks": ["loss", "rmia-online"], "bootstrap": 0})
    config = load(write_params(workdir / "p.yaml", params))
    results = stages.run_all(config, echo=lambda _: None)
    certified = results["certify"]["epsilon"]
    assert certified < 1.0  # what the accountant was told
    white_box = next(b for b in results["audit"]["one_run"] if b["method"] == "one_run_white_box")
    assert white_box["epsilon"] > 2.0 > certified
    gate = results["gate"]
    assert gate["passed"] is False
    assert any("exceeds the certified ε" in reason and "one_run_white_box" in reason for reason in gate["reasons"])
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
    [version] = client.search_model_versions("name='dpml-test-model'")
    assert version.tags["gate.passed"] == "false"
    assert float(version.tags["audit.epsilon_lower_bound"]) > certified
    assert not client.get_registered_model("dpml-test-model").aliases

    # Requiring a demonstrated positive control fails the gate when the control lacks power.
    strict = load(write_params(workdir / "strict.yaml", small_params(
        workdir, dp={"noise_multiplier": 3.0}, gate={"epsilon_budget": 10.0},
        audit={"references": 1, "attacks": ["loss", "rmia-online"], "bootstrap": 0,
               "require_control_power": True, "control_min_tpr_at_1pct_fpr": 1.0})))
    decision = stages.gate(strict)
    assert decision["passed"] is False and decision["audit_is_evidence"] is False
    assert any("positive control" in reason for reason in decision["reasons"])
