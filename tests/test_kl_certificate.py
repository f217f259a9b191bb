"""Seed 000's KL certificate: arithmetic, cross-check, honesty about what it is, and the ledger's KL account."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from dpml.config import ConfigError, load, validate
from dpml.accounting.accountants import certify, tight_epsilon
from dpml.accounting.kl import gradient_norm_constant, kl_bound, pinsker_delta
from dpml.accounting.kl_certificate import certify_kl
from dpml.ledger.ledger import BudgetExceeded, Ledger
from dpml.accounting.mechanism import MechanismDescription, NoisyGradientDescent, PoissonGaussianSteps


def kl_mechanism(
    widths: tuple[int, ...] = (20, 64, 64, 3),
    scheme: str = "lecun",
    linearised: bool = True,
    sigma: float = 0.5,
    steps: int = 50,
    n: int = 400,
) -> MechanismDescription:
    event = NoisyGradientDescent(scheme, widths, 2.0, steps, 0.05, sigma, linearised)
    return MechanismDescription("noisygd", (event,), "replace-one", 0.0, n)


@pytest.mark.parametrize("scheme", ["lecun", "he", "ntk", "xavier"])
def test_kl_certificate_is_cor_4_2_with_both_computations_of_b(scheme: str) -> None:
    mechanism = kl_mechanism(scheme=scheme)
    certificate = certify(mechanism, 1e-5)
    constant = gradient_norm_constant(scheme, [20, 64, 64, 3], 2.0)  # type: ignore[arg-type]
    expected = kl_bound(constant, 50, 0.05, 400, 0.5)
    assert certificate["kind"] == "kl"
    assert certificate["kl"] == pytest.approx(expected, rel=1e-12)
    assert certificate["kl"] == pytest.approx(2 * constant * 50 * 0.05 / (400**2 * 0.25), rel=1e-12)
    eq7, table1 = certificate["answers"]
    assert (eq7["name"], table1["name"]) == ("kl.eq7", "kl.table1")
    assert table1["kl"] == pytest.approx(eq7["kl"], rel=1e-9)  # Table 1's closed form, scaled from d to X0²
    assert certificate["pinsker_delta"] == pytest.approx(pinsker_delta(expected))
    assert certificate["epsilon"] == math.inf  # never relabelled as (ε, δ)-DP
    assert "not (ε, δ)-DP" in certificate["statement"] and "Pinsker" in certificate["statement"]


def test_unequal_widths_skip_table_1_and_uncertified_runs_are_void() -> None:
    certificate = certify(kl_mechanism(widths=(20, 64, 32, 3)), 1e-5)
    assert certificate["answers"][1]["kl"] is None and "equal hidden widths" in certificate["answers"][1]["error"]
    assert certificate["kl"] > 0 and not certificate.get("void")
    void = certify_kl(kl_mechanism(linearised=False), 1e-5)
    assert void["void"] and void["epsilon"] == math.inf and void["kl"] == math.inf
    assert "linearised" in void["statement"]


def test_kl_is_monotone_in_the_noise_and_steps_and_the_event_round_trips() -> None:
    assert certify(kl_mechanism(sigma=1.0), 1e-5)["kl"] == pytest.approx(
        certify(kl_mechanism(sigma=0.5), 1e-5)["kl"] / 4
    )
    assert certify(kl_mechanism(steps=100), 1e-5)["kl"] == pytest.approx(2 * certify(kl_mechanism(), 1e-5)["kl"])
    mechanism = kl_mechanism()
    assert MechanismDescription.from_dict(mechanism.to_dict()) == mechanism
    assert mechanism.guarantee == "kl" and tight_epsilon(mechanism, 1e-5) == math.inf
    with pytest.raises(ValueError, match="replace-one"):
        certify_kl(MechanismDescription("noisygd", mechanism.events, "add-remove", 0.0, 400), 1e-5)


def dp_mechanism() -> MechanismDescription:
    return MechanismDescription("dpsgd", (PoissonGaussianSteps(0.01, 1.0, 100),), "replace-one", 1.0, 1000)


def test_ledger_keeps_a_kl_account_and_never_mixes_it_with_epsilon(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.db", 1e-5)
    kl = certify(kl_mechanism(), 1e-5)["kl"]
    with pytest.raises(BudgetExceeded, match="kl_budget is not set"):
        ledger.reserve("data-a", kl_mechanism(), "kl run", 10.0)
    assert ledger.spends("data-a") == []
    ledger.reserve("data-a", kl_mechanism(), "kl run", 10.0, kl_budget=2.5 * kl)
    ledger.reserve("data-a", kl_mechanism(), "kl run 2", 10.0, kl_budget=2.5 * kl)
    assert ledger.kl_total("data-a") == pytest.approx(2 * kl)
    with pytest.raises(BudgetExceeded, match="summed KL"):
        ledger.reserve("data-a", kl_mechanism(), "kl run 3", 10.0, kl_budget=2.5 * kl)
    assert ledger.total("data-a") == math.inf  # a KL-only release leaves no finite (ε, δ) total
    with pytest.raises(BudgetExceeded, match="unbounded"):
        ledger.reserve("data-a", dp_mechanism(), "dp run", 10.0)
    ledger.reserve("data-b", dp_mechanism(), "dp run", 10.0)
    with pytest.raises(BudgetExceeded, match="bound no KL"):
        ledger.reserve("data-b", kl_mechanism(), "kl run", 10.0, kl_budget=100.0)
    assert ledger.kl_total("data-b") == math.inf
    summary = {s["lineage"]: s for s in ledger.summary()}  # a version is its own lineage by default
    assert summary["data-a"]["kl_total"] == pytest.approx(2 * kl) and summary["data-b"]["kl_total"] is None
    assert len(ledger.spends("data-a")) == 2 and len(ledger.spends("data-b")) == 1


def noisygd_params(**overrides: dict) -> dict:
    params = {
        "model": {"kind": "bias_free_relu", "hidden": [32, 32], "init": "lecun"},
        "train": {"algorithm": "noisygd", "sample_rate": 1.0, "epochs": 20, "optimizer": "sgd", "learning_rate": 0.1},
        "dp": {"neighbouring": "replace-one", "delta": 1e-5},
        "noisygd": {"kl_target": 0.5},
    }
    for section, values in overrides.items():
        params[section] = params.get(section, {}) | values
    return params


def test_noisygd_configuration_errors_name_the_keys() -> None:
    validate(noisygd_params())
    cases = [
        ({"model": {"kind": "mlp"}}, "model.kind = 'mlp'"),
        ({"dp": {"neighbouring": "add-remove"}}, "dp.neighbouring = 'add-remove'"),
        ({"train": {"sample_rate": 0.1}}, "train.sample_rate = 0.1"),
        ({"train": {"momentum": 0.9}}, "train.momentum = 0.9"),
        ({"train": {"epochs": 2.5}}, "train.epochs = 2.5"),
        ({"noisygd": {"sigma": 1.0}}, "exactly one of noisygd.sigma and noisygd.kl_target"),
        ({"dp": {"noise_multiplier": 1.0}}, "not used by noisy GD"),
        ({"model": {"init": "orthogonal"}}, "model.init"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
            validate(noisygd_params(**overrides))


def test_noisygd_pipeline_releases_a_kl_certified_model_that_is_never_called_dp(workdir: Path, monkeypatch) -> None:
    """train → certify (KL) → audit → gate (kl_budget) → register, and the ledger's KL account."""
    from dpml import io
    from dpml.stages import STAGES, Layout
    from tests.conftest import small_params, write_params

    monkeypatch.setenv("DPML_NOISE_SEED", "11")
    params = small_params(
        workdir,
        model={"kind": "bias_free_relu", "hidden": [32], "init": "lecun"},
        train={"algorithm": "noisygd", "sample_rate": 1.0, "epochs": 50, "learning_rate": 0.5},
        dp={"noise_multiplier": None, "delta": 1e-5, "neighbouring": "replace-one"},
        noisygd={"kl_target": 1.0, "kl_probes": 4},
        gate={"kl_budget": 2.0},
        ledger={"kl_budget": 1.5},
        audit={"white_box_canaries": 0, "black_box_canaries": 0},
    )
    config = load(write_params(workdir / "gd.yaml", params))
    for name in ("ingest", "split", "preprocess", "train"):
        STAGES[name](config)
    certificate = STAGES["certify"](config)["certificate"]
    assert certificate["kind"] == "kl" and certificate["epsilon"] == math.inf
    assert certificate["kl"] == pytest.approx(1.0, rel=1e-9)  # Cor. 6.4's σ meets the target exactly
    assert io.read_json(Layout(config).model_spec)["linearised"] is True
    layout = Layout(config)
    metrics = io.read_json(layout.train_metrics)
    assert metrics["test_accuracy"] > 0.4  # it learns (10 classes; ≈0.5 measured)
    # The estimate at a few probes (not a bound) is reported next to the certificate, and far below it.
    for relation in ("remove_one", "add_one", "replace_one"):  # add-one probes come from the audit population
        assert 0 < metrics[f"train_kl_estimate_{relation}_worst_probe"] < certificate["kl"]
    STAGES["audit"](config)
    decision = STAGES["gate"](config)
    assert decision["passed"] and any("not (ε, δ)-DP" in r for r in decision["reasons"])
    assert any("exceeds the Pinsker bound" in r for r in decision["reasons"])  # the audit was checked against it
    report = layout.report.read_text()
    assert "KL privacy" in report and "Pinsker" in report
    release = STAGES["register"](config)
    import mlflow

    client = mlflow.MlflowClient(config.tracking.uri)
    version = client.get_model_version(config.tracking.model_name, release["model_version"])
    assert release["champion"] is True
    assert version.tags["privacy.guarantee"] == "kl" and version.tags["dp.epsilon"] == "inf"
    assert float(version.tags["kl.certified"]) == pytest.approx(1.0, rel=1e-5)
    # A second KL release would take the dataset's summed KL to 2 > ledger.kl_budget: refused before training.
    with pytest.raises(BudgetExceeded, match="summed KL"):
        STAGES["train"](config)
    # Without a KL budget in the gate, the same model is not released as champion.
    strict = load(write_params(workdir / "strict.yaml", params | {"gate": {"kl_budget": None}}))
    assert not STAGES["gate"](strict)["passed"]


def test_the_audit_can_refute_a_kl_certificate_through_pinsker() -> None:
    """TPR − FPR ≤ sqrt(KL/2) for every test: separated scores refute a small KL, identical ones never do."""
    from dpml.stages import total_variation_violations

    rng = np.random.default_rng(0)
    separated = {
        "loss": {"member": rng.normal(1.0, 1.0, 2000).tolist(), "nonmember": rng.normal(0.0, 1.0, 2000).tolist()}
    }
    same = {"loss": {"member": rng.normal(0.0, 1.0, 2000).tolist(), "nonmember": rng.normal(0.0, 1.0, 2000).tolist()}}
    # Two unit Gaussians one apart: total variation 0.38, so KL = 0.01 (δ_P = 0.07) is refuted,
    # KL = 1 (δ_P = 0.71) is not.
    assert total_variation_violations(separated, pinsker_delta(0.01), 0.95)[0]["attack"] == "loss"
    assert total_variation_violations(separated, pinsker_delta(1.0), 0.95) == []
    assert total_variation_violations(same, pinsker_delta(0.01), 0.95) == []
