"""The audit checks the trainer against its certificate: noise, clipping, sampling — and fails a broken one.

The unit tests check each part on its own (the noise of a step with zero gradients, clipped norms
≤ C, Poisson batch sizes and independence, the probe's statistics under each bug); the pipeline
tests break DP-SGD five ways (:mod:`dpml.audit.broken`) and run train → certify → audit → gate on
a small CPU configuration: each bug must fail the gate with a line naming the check, and the
intact trainer must pass.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy import stats

from dpml import stages
from dpml.audit import broken
from dpml.audit.bounds import hypothesis_test_bound, hypothesis_test_power, one_run_bound, one_run_power
from dpml.accounting.mechanism import MechanismDescription
from dpml.audit.one_run_fdp import one_run_gdp_bound, one_run_mechanism_bound, one_run_mechanism_power
from dpml.audit.checks import Check, chernoff_product_p_value
from dpml.audit.conformance import ConformanceProbe, canary_scores, conformance_checks
from dpml.audit.recompute import forward_is_random, reference_clipped_sum
from dpml.config import load
from dpml.models import build_model, spec_for
from dpml.models.mlp import MlpSpec, build_mlp
from dpml.sections import ModelConfig
from dpml.train import clipping
from dpml.train.clipping import clipped_gradient_sum
from dpml.train.diracs import DiracGradients
from dpml.train.dpsgd import clipped_sum_and_noise, per_example_cross_entropy, train_dpsgd
from dpml.train.steps import poisson_batch
from tests.conftest import small_params, write_params


def test_noise_of_a_step_with_zero_gradients_has_std_sigma_c() -> None:
    """An empty batch: the step's update is pure noise, N(0, σ²C²) per coordinate (exact χ² test)."""
    model = build_mlp(MlpSpec(30, (40,), 5))
    x, y = torch.zeros(0, 30), torch.zeros(0, dtype=torch.long)
    sigma, clip = 1.7, 0.6
    generator = torch.Generator().manual_seed(4)
    draws = []
    for _ in range(20):
        sums, noises, _ = clipped_sum_and_noise(model, x, y, clip, sigma, 64, generator)
        assert all(float(s.abs().max()) == 0.0 for s in sums.values())
        draws.append(torch.cat([n.reshape(-1) for n in noises.values()]))
    values = torch.stack(draws).double() / (sigma * clip)
    chi2 = float(values.pow(2).sum())
    dof = values.numel()
    assert 1e-6 < stats.chi2.cdf(chi2, dof) < 1 - 1e-6
    assert abs(float(values.mean())) < 5 / math.sqrt(dof)
    # successive steps draw fresh noise
    assert abs(float(torch.corrcoef(values[:2])[0, 1])) < 0.1


@pytest.mark.parametrize("kind", ["mlp", "gated", "bias_free_relu", "random_features", "lipschitz"])
def test_every_clipped_example_and_canary_has_norm_at_most_c(kind: str) -> None:
    """‖clip_C(∇ℓ_i)‖ ≤ C for one example at a time, on every model kind the clipping engine trains;
    a Dirac canary of norm 5C comes out with norm C (the same factor line)."""
    in_features = 12
    spec = spec_for(ModelConfig(kind=kind, hidden=[16, 8], features=40), 1.0, in_features, 4)
    torch.manual_seed(0)
    model = build_model(spec)
    clip = 0.3
    x = torch.randn(16, in_features) * 5
    y = torch.randint(0, 4, (16,))
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    for i in range(x.shape[0]):
        sums, norms = clipped_gradient_sum(model, per_example_cross_entropy, x[i : i + 1], y[i : i + 1], clip)
        total = math.sqrt(sum(float(s.pow(2).sum()) for s in sums.values()))
        assert total <= clip * (1 + 1e-5)
        if float(norms[0]) > clip:
            assert total == pytest.approx(clip, rel=1e-4)
    empty = x[:0], y[:0]
    canary = DiracGradients(torch.tensor([n_params - 1, 0]), 5 * clip)
    sums, _ = clipped_gradient_sum(model, per_example_cross_entropy, *empty, clip, canary)
    flat = torch.cat([s.reshape(-1) for s in sums.values()])
    assert float(flat[0]) == pytest.approx(clip, rel=1e-5) and float(flat[-1]) == pytest.approx(clip, rel=1e-5)
    assert int((flat != 0).sum()) == 2


def test_the_auditor_recomputes_the_engines_clipped_sum() -> None:
    """The auditor's own per-example computation agrees with the engine's (ghost norms and all)."""
    torch.manual_seed(1)
    model = build_mlp(MlpSpec(10, (20, 20), 3))
    x, y = torch.randn(50, 10) * 3, torch.randint(0, 3, (50,))
    sums, _ = clipped_gradient_sum(model, per_example_cross_entropy, x, y, 0.5)
    engine = torch.cat([sums[n].reshape(-1) for n, p in model.named_parameters() if p.requires_grad]).double()
    reference = reference_clipped_sum(model, per_example_cross_entropy, x, y, 0.5)
    assert torch.allclose(engine, reference, atol=1e-5)


def test_the_auditors_clipped_sum_equals_a_per_example_loop() -> None:
    """The reference (vmap norms + a reweighted backward pass) equals the definition, one example at a time in
    float64, on a convolutional model with a frozen layer and a parameter the forward pass never uses."""
    torch.manual_seed(2)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3),
        torch.nn.GroupNorm(2, 4),
        torch.nn.Tanh(),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 6 * 6, 3),
    )
    model[1].weight.requires_grad_(False)
    model.register_parameter("unused", torch.nn.Parameter(torch.ones(5)))
    x, y = torch.randn(40, 1, 8, 8) * 2, torch.randint(0, 3, (40,))
    clip = 0.3
    trainable = [p for p in model.parameters() if p.requires_grad]
    expected = torch.zeros(sum(p.numel() for p in trainable), dtype=torch.float64)
    clipped = 0
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(
            per_example_cross_entropy(model(x[i : i + 1]), y[i : i + 1]).sum(), trainable, allow_unused=True
        )
        flat = torch.cat(
            [
                (g if g is not None else torch.zeros_like(p)).reshape(-1).double()
                for g, p in zip(grads, trainable, strict=True)
            ]
        )
        clipped += int(flat.norm() > clip)
        expected += flat * min(1.0, clip / (float(flat.norm()) + 1e-6))
    reference = reference_clipped_sum(model, per_example_cross_entropy, x, y, clip, chunk=16)
    assert clipped > 10 and reference.dtype == torch.float64 and reference.shape == expected.shape
    assert torch.allclose(reference, expected, atol=1e-5, rtol=1e-5)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names[0] == "unused" and bool((reference[:5] == 0).all())  # the module's own parameter comes first


def test_poisson_batches_have_binomial_sizes_and_independent_membership() -> None:
    generator = torch.Generator().manual_seed(0)
    n, q, steps = 400, 0.05, 3000
    member = torch.zeros(steps, n, dtype=torch.bool)
    for t in range(steps):
        member[t, poisson_batch(generator, n, q)] = True
    sizes = member.sum(1).numpy()
    assert stats.binomtest(int(sizes.sum()), n * steps, q).pvalue > 1e-6
    dispersion = np.sum((sizes - n * q) ** 2) / (n * q * (1 - q))
    assert 1e-6 < stats.chi2.cdf(dispersion, steps) < 1 - 1e-6
    # two records are sampled together at rate q² (independence), and a record's steps are independent
    m = member.numpy().astype(float)
    together = (m[:, :200] * m[:, 200:]).sum()
    assert stats.binomtest(int(together), 200 * steps, q * q).pvalue > 1e-6
    consecutive = (m[1:] * m[:-1]).sum()
    assert stats.binomtest(int(consecutive), n * (steps - 1), q * q).pvalue > 1e-6


def probe_run(
    seed: int = 0, steps: int = 100, features: int = 8, hidden: int = 12, scale: float = 2.0
) -> ConformanceProbe:
    """A small DP-SGD run (q = 0.1, σ = 1, C = 1) with the conformance probe; returns the probe."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(600, features, generator=g) * scale, torch.randint(0, 3, (600,), generator=g)
    model = build_mlp(MlpSpec(features, (hidden,), 3))
    n_params = sum(p.numel() for p in model.parameters())
    rng = np.random.default_rng(seed)
    m = 100
    probe = ConformanceProbe(
        x,
        y,
        per_example_cross_entropy,
        1.0,
        1.0,
        0.1,
        steps,
        rng.choice(n_params, m, replace=False),
        rng.random(m) < 0.5,
        seed=seed,
    )
    train_dpsgd(
        model,
        x,
        y,
        sample_rate=0.1,
        epochs=steps * 0.1,
        clip_norm=1.0,
        noise_multiplier=1.0,
        neighbouring="add-remove",
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        seed=seed + 1,
        canaries=probe.canaries(),
    )
    return probe


def failed_checks(probe: ConformanceProbe) -> set[str]:
    return {c.name for c in conformance_checks(probe, 1e-6, 0.05) if not c.passed}


def test_the_intact_trainer_passes_every_check_across_seeds() -> None:
    for seed in range(4):
        checks = conformance_checks(probe_run(seed), 1e-6, 0.05)
        assert all(c.passed for c in checks), [c.line() for c in checks]
        noise = next(c for c in checks if c.name == "noise")
        assert noise.statistics["std_ratio"] == pytest.approx(1.0, abs=0.03)


@pytest.mark.parametrize(
    ("bug", "caught_by"),
    [
        ("noise × ½", "noise"),
        ("noise × 0", "noise"),
        ("clipping removed", "clipping"),
        ("shuffled fixed-size batches", "sampling"),
        ("noise reused across steps", "noise independence"),
        ("no noise on the last parameter", "noise per coordinate"),
        ("last sum counted twice", "noise"),
    ],
)
def test_each_broken_trainer_fails_the_check_that_names_its_bug(bug: str, caught_by: str) -> None:
    with broken.BUGS[bug]():
        probe = probe_run()
    assert caught_by in failed_checks(probe)


def test_noise_missing_on_three_of_147_coordinates_is_named_though_the_pooled_std_looks_right() -> None:
    """The output bias (3 of 147 coordinates) released without noise: the pooled std ratio stays within
    its tolerance; the per-coordinate test names the coordinates, and the noise check's per-tensor test
    the tensor."""
    with broken.BUGS["no noise on the last parameter"]():
        probe = probe_run()
    checks = {c.name: c for c in conformance_checks(probe, 1e-6, 0.05)}
    last = list(dict(build_mlp(MlpSpec(8, (12,), 3)).named_parameters()))[-1]
    assert checks["noise"].statistics["std_ratio"] > 0.95
    assert not checks["noise"].passed and checks["noise"].statistics["worst"] == last
    assert checks["noise"].statistics["tensors"][last]["std_ratio"] < 0.01
    coordinate = checks["noise per coordinate"]
    assert not coordinate.passed and coordinate.statistics["worst_coordinate"].startswith(last + "[")
    assert coordinate.statistics["coordinates_below"] == 3


def test_a_residual_in_one_small_tensor_is_named_though_the_pooled_std_is_right() -> None:
    """The output bias's clipped sum counted twice (3 of 12,483 coordinates carry a residual): the pooled std
    ratio stays at 1.00, no check but the clipped-sum check fails, and the noise check's per-tensor test
    names the tensor;
    the intact run passes the same per-tensor tests."""
    for seed in range(2):
        with broken.BUGS["last sum counted twice"]():
            probe = probe_run(seed, features=256, hidden=48, scale=0.3)
        checks = {c.name: c for c in conformance_checks(probe, 1e-6, 0.05)}
        noise = checks.pop("noise")
        checks.pop("clipped sum")  # which sees it too, first order (test below)
        assert all(c.passed for c in checks.values()), [c.line() for c in checks.values()]
        assert noise.statistics["std_ratio"] == pytest.approx(1.0, abs=0.02)
        last = list(dict(build_mlp(MlpSpec(256, (48,), 3)).named_parameters()))[-1]
        assert not noise.passed and noise.statistics["worst"] == last and f" on {last} (" in noise.line()
        assert noise.statistics["tensors"][last]["std_ratio"] > 1.3
        intact = next(
            c
            for c in conformance_checks(probe_run(seed, features=256, hidden=48, scale=0.3), 1e-6, 0.05)
            if c.name == "noise"
        )
        assert intact.passed and max(t["std_ratio"] for t in intact.statistics["tensors"].values()) < 1.2


@contextlib.contextmanager
def clipped_per_layer() -> Iterator[None]:
    """Each layer's gradient clipped to C on its own (a per-layer clipping bug: sensitivity √L·C, not C).
    Every canary is still clipped to C (a Dirac lies in one layer), and the pooled noise barely moves."""
    original = clipping.EnginePass.sums

    def sums(self: clipping.EnginePass, factors: torch.Tensor, spent: bool = False) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for _, piece in self.fast:
            for p, total in piece.sums(clipping.clip_factors(piece.squared.sqrt(), 1.0)):
                out[self.names[id(p)]] = total
        return out

    clipping.EnginePass.sums = sums  # type: ignore[method-assign]
    try:
        yield
    finally:
        clipping.EnginePass.sums = original  # type: ignore[method-assign]


def test_per_layer_clipping_is_caught_by_the_clipped_sum_check_alone() -> None:
    """Per-layer clipping passes the noise, clipping, independence and sampling checks (the canaries are
    Diracs, the pooled std moves by about 4%); the update's projection on the auditor's clipped sum shows
    it carries more than one clipped sum (first order in R_t)."""
    for seed in range(2):
        with clipped_per_layer():
            probe = probe_run(seed)
        checks = {c.name: c for c in conformance_checks(probe, 1e-6, 0.05)}
        clipped = checks.pop("clipped sum")
        assert all(c.passed for c in checks.values()), [c.line() for c in checks.values()]
        assert not clipped.passed and clipped.p_value < 1e-12 and clipped.statistics["multiple"] > 1.2
        assert "× the recomputed clipped sum" in clipped.line()


def test_the_clipped_sum_check_names_the_tensor_whose_sum_is_counted_twice() -> None:
    with broken.BUGS["last sum counted twice"]():
        probe = probe_run(0, features=256, hidden=48, scale=0.3)
    clipped = next(c for c in conformance_checks(probe, 1e-6, 0.05) if c.name == "clipped sum")
    last = list(dict(build_mlp(MlpSpec(256, (48,), 3)).named_parameters()))[-1]
    assert not clipped.passed and clipped.statistics["worst"] == last
    assert clipped.statistics["tensors"][last]["multiple"] == pytest.approx(2.0, abs=0.3)


def test_the_clipped_sum_statistic_is_standard_normal_for_a_conforming_trainer() -> None:
    """z_t = ⟨o_t, R_t⟩/(σC‖R_t‖) over the steps of intact runs: mean 0, variance 1 (the band test's null law)."""
    z = []
    for seed in range(3):
        probe = probe_run(seed)
        projections, norms = np.stack(probe.projections)[:, 0], np.stack(probe.reference_norms)[:, 0]
        z.append(projections[norms > 0] / norms[norms > 0])
    values = np.concatenate(z)
    assert abs(values.mean()) < 5 / math.sqrt(values.size)
    assert 1e-6 < stats.chi2.cdf(float((values**2).sum()), values.size) < 1 - 1e-6


def test_the_canaries_are_drawn_by_the_trainers_sampler_and_scored_per_step() -> None:
    """Included canaries appear in batches at rate q (they are records of the sampler); excluded never.
    The per-step likelihood-ratio score separates included from excluded canaries at least as well as the sum."""
    probe = probe_run(steps=200)
    sampled = np.concatenate(probe.sampled_canaries)
    assert set(np.unique(sampled)) <= set(np.flatnonzero(probe.included))
    counts = probe.counts[probe.n :]
    assert stats.binomtest(int(counts.sum()), counts.size * 200, 0.1).pvalue > 1e-6
    for scoring in ("sum", "likelihood_ratio"):
        scores = canary_scores(probe, scoring)  # type: ignore[arg-type]
        gap = scores[probe.included].mean() - scores[~probe.included].mean()
        assert gap > 3 * scores[~probe.included].std() / math.sqrt(probe.included.sum())


def test_each_canary_score_is_its_per_step_log_likelihood_ratio_or_its_sum() -> None:
    """The scores of a few known observations, element by element: Σ_t log[(1 − q) + q·exp((o·C − C²/2)/(σC)²)],
    or Σ_t o; at q = 1 the sum."""
    rng = np.random.default_rng(3)
    observations = [rng.normal(0.0, 2.0, 4).astype(np.float32) for _ in range(3)]
    clip, sigma, q = 0.7, 1.3, 0.2
    probe = SimpleNamespace(
        observations=observations, coordinates=np.arange(4), clip_norm=clip, sigma=sigma, sample_rate=q
    )
    s2 = (sigma * clip) ** 2
    expected = [
        sum(math.log((1 - q) + q * math.exp((float(o[j]) * clip - clip * clip / 2) / s2)) for o in observations)
        for j in range(4)
    ]
    assert canary_scores(probe, "likelihood_ratio") == pytest.approx(expected, rel=1e-9)  # type: ignore[arg-type]
    sums = [sum(float(o[j]) for o in observations) for j in range(4)]
    assert canary_scores(probe, "sum") == pytest.approx(sums, rel=1e-9)  # type: ignore[arg-type]
    probe.sample_rate = 1.0
    assert canary_scores(probe, "likelihood_ratio") == pytest.approx(sums, rel=1e-9)  # type: ignore[arg-type]
    probe.observations = []
    assert canary_scores(probe, "sum").tolist() == [0.0] * 4  # type: ignore[arg-type]


def test_chernoff_bound_on_inner_products_is_valid() -> None:
    """The noise-reuse p-value bounds the true tail of Σ ξη (simulated) from above."""
    rng = np.random.default_rng(0)
    k = 200
    inner = (rng.standard_normal((20000, k)) * rng.standard_normal((20000, k))).sum(1)
    for x in (20.0, 40.0, 60.0):
        assert np.mean(np.abs(inner) >= x) <= chernoff_product_p_value(x, k) + 1e-3
    assert chernoff_product_p_value(k, k) < 1e-12  # one step's noise against itself


def test_power_is_the_bound_when_every_guess_is_right() -> None:
    assert hypothesis_test_power(1000, 1000, 1e-5, 0.95) == pytest.approx(
        hypothesis_test_bound(np.ones(1000), np.zeros(1000), 1e-5, 0.95).epsilon
    )
    assert one_run_power(650, 130, 1e-5, 0.95) == pytest.approx(one_run_bound(650, 130, 130, 1e-5, 0.95).epsilon)
    # no outcome of the method can exceed its power
    rng = np.random.default_rng(0)
    for _ in range(20):
        members, nonmembers = rng.normal(3, 1, 1000), rng.normal(0, 1, 1000)
        assert hypothesis_test_bound(members, nonmembers, 1e-5, 0.95).epsilon <= hypothesis_test_power(
            1000, 1000, 1e-5, 0.95
        )


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Digits ingested, split and preprocessed once for the broken-trainer pipeline runs."""
    tmp = tmp_path_factory.mktemp("conformance")
    config = load(write_params(tmp / "params.yaml", pipeline_params(tmp)))
    for name in ("ingest", "split", "preprocess"):
        stages.run_stage(name, config)
    return tmp


def pipeline_params(tmp: Path) -> dict:
    return small_params(
        tmp,
        train={"epochs": 4},
        dp={"noise_multiplier": 1.0, "clip_norm": 1.0, "delta": 1e-5},
        gate={"epsilon_budget": 100.0},
        audit={"attacks": ["loss"], "references": 0, "control": False, "black_box_canaries": 0, "bootstrap": 0},
    )


# Through the pipeline: the intact trainer and one bug (the gate reads the checks' verdict; every bug is caught by
# its own check in test_each_broken_trainer_fails_the_check_that_names_its_bug, which runs the trainers directly).
@pytest.mark.parametrize("bug", [None, next(iter(broken.BUGS))])
def test_the_gate_fails_a_broken_trainer_and_passes_the_intact_one(
    prepared: Path, bug: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(prepared)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = load(prepared / "params.yaml")
    if bug is None:
        for name in ("train", "certify", "audit", "gate"):
            stages.run_stage(name, config)
    else:
        with broken.BUGS[bug]():
            for name in ("train", "certify", "audit", "gate"):
                stages.run_stage(name, config)
    from dpml import io
    from dpml.stages.layout import Layout

    layout = Layout(config)
    decision = io.read_json(layout.gate)
    audit = io.read_json(layout.audit)
    failed = [line for line in decision["reasons"] if line.startswith("conformance check")]
    if bug is None:
        assert decision["passed"] is True, decision["reasons"]
        assert audit["conformance"]["passed"] is True and not failed
        # beside the canaries' bound, its f-DP reading (Gaussian curve): recomputable from the recorded guesses,
        # within its power, never gating, and in the report on the line below the bound with what it assumes
        white = next(b for b in audit["one_run"] if b["method"] == "one_run_white_box")
        i, fdp = white["inputs"], white["fdp"]
        again = one_run_gdp_bound(i["canaries"], i["guesses"], i["correct"], i["delta"], white["confidence"])
        assert (fdp["mu"], fdp["epsilon"]) == (again.inputs["mu"], again.epsilon) and fdp["gating"] is False
        assert fdp["power"] >= fdp["epsilon"] and fdp["power"] > white["power"]
        report = layout.report.read_text()
        assert f"μ ≥ {fdp['mu']:.3g}, i.e. ε ≥ {fdp['epsilon']:.4g}" in report and "never gates" in report
        assert "not evidence that the certificate is loose" in report
    else:
        assert decision["passed"] is False, (bug, decision["reasons"])
        assert failed and audit["conformance"]["passed"] is False
        assert all("p " in line and "false-alarm rate" in line for line in failed)
    # the audit states each method's power; a method counted by the gate can show a violation of ε
    for entry in audit["power"].values():
        assert entry["power"] > 0
        assert entry["power"] >= audit["certified_epsilon"] if entry["gating"] else "note" in entry


DROPOUT_MODELS = """
from torch import nn


def with_dropout(input_shape, n_classes, p=0.3):
    return nn.Sequential(nn.Linear(input_shape[0], 16), nn.Tanh(), nn.Dropout(p), nn.Linear(16, n_classes))
"""


def test_forward_is_random_sees_dropout_and_keeps_the_random_state() -> None:
    x = torch.randn(16, 8)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh())
    dropped = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Dropout(0.3)).eval()
    state = torch.get_rng_state()
    assert not forward_is_random(plain, x) and forward_is_random(dropped, x)
    assert torch.equal(state, torch.get_rng_state()) and not dropped.training  # the mode is restored too


def test_a_model_with_dropout_is_reported_not_checked_instead_of_failing_the_noise_check(
    prepared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The auditor cannot replay the trainer's dropout masks: the checks say so (no false alarm), the canary
    bound is still computed, and the gate says why conformance was not checked."""
    (prepared / "dropoutmodels.py").write_text(DROPOUT_MODELS)
    monkeypatch.chdir(prepared)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = load(
        prepared / "params.yaml", ["model.kind=custom", "model.factory=dropoutmodels:with_dropout", "model.hidden=[]"]
    )
    for name in ("train", "certify", "audit", "gate"):
        stages.run_stage(name, config)
    from dpml import io
    from dpml.stages.layout import Layout

    audit, decision = io.read_json(Layout(config).audit), io.read_json(Layout(config).gate)
    assert audit["conformance"]["ran"] is False and "forward pass is random" in audit["conformance"]["reason"]
    assert any(b["method"] == "one_run_white_box" for b in audit["one_run"])
    assert not any(line.startswith("conformance check") for line in decision["reasons"])
    assert any(
        line.startswith("conformance not checked: the model's forward pass is random") for line in decision["reasons"]
    )


def test_the_broken_samplers_state_belongs_to_its_own_run() -> None:
    """Runs one after another under one bug context (as the audit's runs are): a run never gets another
    run's batches or noise, even when its generator reuses a freed generator's memory address."""
    import dpml.train.steps as steps

    with broken.BUGS["shuffled fixed-size batches"]():
        for n in (50, 30, 50, 20):
            for _ in range(3):
                generator = torch.Generator().manual_seed(n)
                batch = steps.poisson_batch(generator, n, 0.2)
                assert int(batch.max()) < n and batch.numel() == round(0.2 * n)
                del generator


def test_a_check_is_recorded_with_its_own_verdict_and_numbers() -> None:
    """The audit's record of a check (``audit.json``'s ``checks``, which the gate and the report read) carries the
    check's own verdict, p-value, false-alarm rate, figure, line and statistics under their names (pins
    Check.to_dict, which mutation testing found no conformance test reached)."""
    for passed in (True, False):
        check = Check("clipped_sum", passed, 3.2e-7, 1e-6, "ŝ/s = 0.91", {"count": 40, "ratio": 0.91})
        assert check.to_dict() == {
            "check": "clipped_sum",
            "passed": passed,
            "p_value": 3.2e-7,
            "false_alarm": 1e-6,
            "figure": "ŝ/s = 0.91",
            "statistics": {"count": 40, "ratio": 0.91},
            "line": "conformance check 'clipped_sum': ŝ/s = 0.91, p = 3.2e-07 (false-alarm rate 1.0e-06)",
        }


@pytest.mark.parametrize("bug", [None, "noise × 0"])
def test_the_tight_mode_reads_the_canaries_through_the_mechanisms_curve_and_gates_on_it(
    prepared: Path, bug: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``audit.mode: tight``, conformance checks off so that only the bound can catch a bug: the white-box
    canaries (``tight_white_box_canaries`` of them, ``tight_guesses`` guessed) are read through the certified
    mechanism's own curve. Intact: that mechanism is not rejected (noise
    scale above 1), the bound is at least Steinke's, its power is that reading's, the gate passes. Noise × 0:
    the bound exceeds the certified ε and the gate fails on it."""
    monkeypatch.chdir(prepared)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tight = ["audit.mode=tight", "audit.tight_white_box_canaries=300", "audit.tight_guesses=40"]
    config = load(prepared / "params.yaml", [*tight, "audit.conformance=false"])
    with broken.BUGS[bug]() if bug else contextlib.nullcontext():
        for name in ("train", "certify", "audit", "gate"):
            stages.run_stage(name, config)
    from dpml import io
    from dpml.stages.layout import Layout

    layout = Layout(config)
    audit, decision = io.read_json(layout.audit), io.read_json(layout.gate)
    white = next(b for b in audit["one_run"] if b["method"] == "one_run_white_box")
    i, certified = white["inputs"], audit["certified_epsilon"]
    assert audit["mode"] == "tight" and white["reading"] == "mechanism_curve"
    assert (i["canaries"], i["guesses"]) == (300, 40)  # the tight mode's own canaries and guesses
    mechanism = MechanismDescription.from_dict(io.read_json(layout.mechanism))
    again = one_run_mechanism_bound(
        mechanism, i["canaries"], i["guesses"], i["correct"], i["delta"], white["confidence"]
    )
    assert white["epsilon"] == again.epsilon and white["noise_scale"] == again.inputs["noise_scale"]
    assert white["power"] == pytest.approx(
        one_run_mechanism_power(mechanism, i["canaries"], i["guesses"], i["delta"], white["confidence"])
    )
    assert white["power"] > one_run_power(i["canaries"], i["guesses"], i["delta"], white["confidence"])
    assert white["gating"], audit["power"]
    if bug is None:
        assert white["noise_scale"] > 1 and white["steinke"]["epsilon"] <= white["epsilon"] <= certified
        assert decision["passed"] is True, decision["reasons"]
    else:
        assert white["noise_scale"] < 1 and white["epsilon"] > certified
        assert decision["passed"] is False
        assert any(
            "one_run_white_box" in reason and "exceeds the certified ε" in reason for reason in decision["reasons"]
        )
        assert "less private than certified" in layout.report.read_text()
