"""The audit can fail a release: gradient canaries, and a deliberately broken trainer being caught."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

import dpml.train.trainers.dpsgd as fit_module  # the DP-SGD trainer module: where the pipeline calls train_dpsgd
from dpml import stages
from dpml.config import load
from dpml.models.mlp import MlpSpec, build_mlp
from dpml.accounting.mechanism import PoissonGaussianSteps
from dpml.audit.conformance import ConformanceProbe, canary_scores
from dpml.train.dpsgd import per_example_cross_entropy, train_dpsgd
from tests.conftest import small_params, write_params
from tests.noise_laws import FALSE_ALARM, Z


def test_gradient_canary_observations_follow_the_subsampled_gaussian() -> None:
    """Included canaries gain c ≈ C per sampled step, excluded ones none; each observation o_{t,j} is
    c·[j sampled at t] + N(0, σ²C²), so each canary's summed observation has noise std √T·σC — as seen
    by the auditor's probe through the trainer.

    Every bound is derived from a false-alarm rate of 1e-6 (``tests.noise_laws.FALSE_ALARM``) by the
    exact law of its statistic, and the per-step one has the power the old check lacked: it compared
    the std of 9 excluded sums with ``rel=0.6``, which the planted bug "half the noise at the add"
    (std ×0.5) passed. Here the T·m = 3,600 standardised residuals' Σr² ~ χ²_3600 pins the noise std
    to about ±6 % (a std ×0.9 fails too)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(200, 5, generator=g), torch.randint(0, 3, (200,), generator=g)
    model = build_mlp(MlpSpec(5, (), 3))
    m = 18  # all 18 parameters
    rng = np.random.default_rng(0)
    q, sigma, clip, epochs = 0.2, 0.5, 1.0, 40.0
    probe = ConformanceProbe(
        x, y, per_example_cross_entropy, sigma, clip, q, 200, rng.permutation(m), np.arange(m) % 2 == 0
    )
    result = train_dpsgd(
        model,
        x,
        y,
        sample_rate=q,
        epochs=epochs,
        clip_norm=clip,
        noise_multiplier=sigma,
        neighbouring="add-remove",
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        seed=1,
        canaries=probe.canaries(),
    )
    n_total, steps = 200 + 9, 200
    assert result.mechanism.dataset_size == n_total and len(probe.observations) == steps
    included = probe.included
    c = probe.norm_multiple * clip * min(1.0, clip / (probe.norm_multiple * clip + 1e-6))  # a canary clipped to ≈ C
    sampled = np.zeros((steps, m))
    for t, canaries in enumerate(probe.sampled_canaries):
        sampled[t, canaries] = 1.0
    counts = sampled.sum(0)  # k_j: the steps that sampled canary j
    low, high = stats.binom(steps * included.sum(), q).ppf([FALSE_ALARM / 2, 1 - FALSE_ALARM / 2])
    assert low <= counts.sum() <= high  # Σ_j k_j ~ Bin(T·m_in, q)
    # the per-step law: r_{t,j} = (o_{t,j} − c·[sampled]) / σC are T·m i.i.d. N(0, 1)
    observations = np.stack(probe.observations).astype(np.float64)
    residuals = (observations - c * sampled) / (sigma * clip)
    within_chi2(float((residuals**2).sum()), residuals.size)
    # the summed observations (the canaries' one-run scores): (score_j − c·k_j)/(√T·σC) are m i.i.d. N(0, 1)
    scores = canary_scores(probe, "sum")
    noise_sd = np.sqrt(steps) * sigma * clip
    within_chi2(float((((scores - c * counts) / noise_sd) ** 2).sum()), m)
    # the gain per sampled step: ĉ = Σ_in score / Σ k ~ N(c, m_in·T·σ²C² / (Σ k)²)
    gain = scores[included].sum() / counts.sum()
    assert abs(gain - c) <= Z * np.sqrt(included.sum()) * noise_sd / counts.sum(), (gain, c)
    gap = scores[included].mean() - scores[~included].mean()  # ≈ T·q·C, as the audit's scores see it
    assert abs(gap - c * counts[included].mean()) <= Z * noise_sd * np.sqrt(1 / included.sum() + 1 / (~included).sum())


def within_chi2(statistic: float, df: int) -> None:
    """``statistic`` ~ χ²_df lies in its central (1 − FALSE_ALARM) range."""
    low, high = stats.chi2.ppf(FALSE_ALARM / 2, df), stats.chi2.isf(FALSE_ALARM / 2, df)
    assert low <= statistic <= high, (statistic, df, (low, high))


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
    params = small_params(
        workdir,
        dp={"noise_multiplier": 3.0},
        gate={"epsilon_budget": 10.0},
        audit={"references": 1, "attacks": ["loss", "rmia-online"], "bootstrap": 0},
    )
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
    strict = load(
        write_params(
            workdir / "strict.yaml",
            small_params(
                workdir,
                dp={"noise_multiplier": 3.0},
                gate={"epsilon_budget": 10.0},
                audit={
                    "references": 1,
                    "attacks": ["loss", "rmia-online"],
                    "bootstrap": 0,
                    "require_control_power": True,
                    "control_min_tpr_at_1pct_fpr": 1.0,
                },
            ),
        )
    )
    decision = stages.gate(strict)
    assert decision["passed"] is False and decision["audit_is_evidence"] is False
    assert any("positive control" in reason for reason in decision["reasons"])
