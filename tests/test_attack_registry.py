"""Attacks are an extension point shaped like the trainer (docs/explanations/design.md): one file registers an
attack, the configuration validates its name, the audit trains reference models when it says it needs them, and
the audit runs it beside the built-in ones.

- the example attack of the documentation's Design page (``examples/calibrated_loss_attack.py``) is shown there
  verbatim;
- its name validates only once its module is listed under ``plugins:``, and an attack that needs reference
  models is refused with ``audit.references: 0``;
- its scores are the difficulty-calibrated loss, and they separate members whose loss sits below their
  reference models' from non-members;
- (exhaustive) it runs through the whole pipeline in a fresh process, audited beside LOSS.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import run_pipeline_with_plugin

from dpml import io
from dpml.audit.attacks import ATTACKS, AttackInputs, AttackKind, register_attack
from dpml.audit.metrics import auc
from dpml.audit.run import attack_functions, needs_references
from dpml.audit.signals import cross_entropy_losses
from dpml.config import ConfigError, load, validate
from dpml.stages import Layout

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "calibrated_loss_attack.py"


def params() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


def test_the_design_page_shows_the_example_attack_verbatim() -> None:
    assert EXAMPLE.read_text().strip() in (ROOT / "docs" / "explanations" / "design.md").read_text()


def test_an_attack_validates_once_its_plugin_registered_it() -> None:
    base = params()
    wanted = {**base, "audit": {**base.get("audit", {}), "attacks": ["loss", "loss-calibrated"], "references": 2}}
    if "loss-calibrated" not in ATTACKS:  # (another test of this process may have imported the plugin already)
        with pytest.raises(
            ConfigError,
            match=r"'loss-calibrated' \(item 1\): unknown attack; registered: loss, "
            r"lira-online.*register it in a module listed under plugins",
        ):
            validate(wanted)
    config = validate({**wanted, "plugins": [str(EXAMPLE)]})
    assert config.audit.attacks == ["loss", "loss-calibrated"] and needs_references(config)
    assert set(attack_functions(config.audit)) == {"loss", "loss-calibrated"}
    with pytest.raises(
        ConfigError,
        match=r"audit.references = 0 but attacks \['loss-calibrated'\] need reference "
        r"models \(use ≥ 1, or only loss\)",
    ):
        validate({**wanted, "plugins": [str(EXAMPLE)], "audit": {**wanted["audit"], "references": 0}})
    only_loss = validate({**wanted, "audit": {**wanted["audit"], "attacks": ["loss"], "references": 0}})
    assert not needs_references(only_loss)


def test_a_second_attack_of_the_same_name_is_refused_and_a_reloaded_plugin_replaces_itself() -> None:
    with pytest.raises(ValueError, match="an attack named 'loss' is already registered"):
        register_attack(AttackKind("loss", False, lambda inputs, audit: -inputs.logits[:, 0]))
    for name in ("example_attack_once", "example_attack_twice"):  # the same file imported under two names
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    assert ATTACKS["loss-calibrated"].needs_references


def test_the_example_attack_is_the_difficulty_calibrated_loss_and_has_power() -> None:
    """Members' losses sit below their own typical loss (what reference models that did not train on them
    reach), which differs from record to record: the calibrated score separates members, the raw loss less."""
    validate({**params(), "plugins": [str(EXAMPLE)]})
    rng = np.random.default_rng(0)
    n, k, references = 400, 3, 6
    member = np.arange(n) < n // 2
    labels = rng.integers(0, k, n)
    difficulty = rng.exponential(2.0, n)  # each record's typical loss on a model that did not see it

    def logits_with_loss(loss: np.ndarray) -> np.ndarray:
        """Logits whose cross-entropy at ``labels`` is ``loss`` (the others at 0)."""
        p = np.exp(-loss)
        true = np.log(p * (k - 1) / (1 - p))
        out = np.zeros((loss.size, k))
        out[np.arange(loss.size), labels] = true
        return out

    reference_in = rng.random((references, n)) < 0.5
    reference_in[0] = False  # every record has a reference model that did not train on it …
    reference_in[:, 0] = True  # … but the first, whose typical loss is then the mean over all of them
    reference_loss = difficulty * rng.uniform(0.9, 1.1, (references, n))
    reference_loss = np.where(reference_in, 0.5 * reference_loss, reference_loss)
    target_loss = np.where(member, 0.5, 1.0) * difficulty * rng.uniform(0.9, 1.1, n)
    inputs = AttackInputs(
        logits_with_loss(target_loss),
        labels,
        np.zeros((0, k)),
        np.zeros(0, dtype=int),
        np.stack([logits_with_loss(loss) for loss in reference_loss]),
        reference_in,
    )
    config = validate(
        {
            **params(),
            "plugins": [str(EXAMPLE)],
            "audit": {**params().get("audit", {}), "attacks": ["loss", "loss-calibrated"], "references": 6},
        }
    )
    scores = attack_functions(config.audit)
    calibrated = scores["loss-calibrated"](inputs)
    outside = ~reference_in
    reference = cross_entropy_losses(inputs.reference_logits, labels)
    typical = np.r_[reference[:, 0].mean(), (reference * outside)[:, 1:].sum(0) / outside[:, 1:].sum(0)]
    np.testing.assert_allclose(calibrated, typical - cross_entropy_losses(inputs.logits, labels), rtol=1e-9)
    np.testing.assert_allclose(-cross_entropy_losses(inputs.logits, labels), -target_loss, rtol=1e-6)
    auc_calibrated = auc(calibrated[member], calibrated[~member])
    loss_scores = scores["loss"](inputs)
    auc_loss = auc(loss_scores[member], loss_scores[~member])
    assert auc_calibrated > 0.95 and auc_calibrated > auc_loss + 0.1, (auc_calibrated, auc_loss)


@pytest.mark.exhaustive  # CI runs it after the default suite, which stays near 20 min on 2 cores
def test_the_example_attack_runs_through_the_pipeline(tmp_path: Path) -> None:
    """Listed under plugins:, the attack is audited beside LOSS in a fresh process (as `dvc repro` runs)."""
    done = run_pipeline_with_plugin(tmp_path, EXAMPLE, audit={"attacks": ["loss", "loss-calibrated"], "references": 2})
    assert done.returncode == 0, done.stderr[-3000:]
    audit = io.read_json(Layout(load(tmp_path / "params.yaml")).audit)
    attacks = audit["target"]["attacks"]
    assert set(attacks) == {"loss", "loss-calibrated"}
    assert 0.0 <= attacks["loss-calibrated"]["auc"] <= 1.0 and audit["references"]["per_subject"] == 2
