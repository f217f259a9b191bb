"""``dpml.train_private`` takes its settings as the pipeline's section models (:mod:`dpml.api_settings`).

- the sections a ``params.yaml`` validates into train exactly what the same keywords train;
- every field of the ``dp`` and ``train`` sections is a keyword, read from the section models themselves
  (a field added to a section is covered here with nothing to change), and one given both ways is refused
  before any record is read;
- a misspelt setting, another trainer's settings and a pipeline-only seed are refused, naming them;
- a ``LedgerConfig`` charges its ``dataset`` lineage at its budget, and refuses what it cannot do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

import dpml
from dpml.api_settings import DP_KEYS, TRAIN_KEYS, library_settings
from dpml.config import validate
from dpml.ledger.ledger import BudgetExceeded, Ledger
from dpml.sections import DpConfig, TrainSettings
from dpml.sections_stores import LedgerConfig
from dpml.train.trainers.dpsgd import DpGdSettings, DpSgdSettings
from test_api import SETTINGS, Blobs, largest_difference, moved, network

DP_SETTINGS = {"delta": 1e-4, "clip_norm": 1.0, "noise_multiplier": 1.0}
TRAIN_SETTINGS = {"epochs": 2, "sample_rate": 0.1, "physical_batch_size": 7, "learning_rate": 0.5, "device": "cpu"}
assert {**DP_SETTINGS, **TRAIN_SETTINGS, "seed": 5} == SETTINGS  # the same run as test_api's

# A value each field accepts (its default, or a valid one where the default is None).
VALID = {"noise_multiplier": 1.0, "target_epsilon": 2.0}


def valid_value(section: type[Any], key: str) -> Any:
    default = section.model_fields[key].get_default(call_default_factory=True)
    return VALID.get(key, default) if default is None else default


def test_the_sections_of_a_params_yaml_train_what_the_keywords_train() -> None:
    params = yaml.safe_load(
        "dp: {delta: 1.0e-4, clip_norm: 1.0, noise_multiplier: 1.0}\n"
        "train: {epochs: 2, sample_rate: 0.1, physical_batch_size: 7, learning_rate: 0.5, "
        "device: cpu}\n"
    )
    config = validate(params)
    assert isinstance(config.train, DpSgdSettings)
    by_keywords = dpml.train_private(network(), Blobs(), **SETTINGS)
    by_sections = dpml.train_private(network(), Blobs(), dp=config.dp, train=config.train, seed=5)
    assert largest_difference(by_keywords.model, by_sections.model) == 0.0 and moved(by_sections.model) > 0
    assert all(by_sections.certificate[k] == by_keywords.certificate[k] for k in ("epsilon", "delta", "mechanism"))
    public = dpml.train_private(
        network(), Blobs(), dp=dpml.DpConfig(**DP_SETTINGS), train=dpml.DpSgdSettings(**TRAIN_SETTINGS), seed=5
    )  # the names dpml exports
    assert largest_difference(by_keywords.model, public.model) == 0.0


PIPELINE_ONLY = ("algorithm", "seed")  # DP-SGD here; the pipeline's initialisation seed (refused below)


def test_the_library_reads_every_setting_of_both_sections() -> None:
    assert set(DP_KEYS) == set(DpConfig.model_fields)
    assert set(TRAIN_KEYS) == set(DpSgdSettings.model_fields) - set(PIPELINE_ONLY)


@pytest.mark.parametrize(
    "section, key",
    [(DpConfig, k) for k in DpConfig.model_fields]
    + [(DpSgdSettings, k) for k in DpSgdSettings.model_fields if k not in PIPELINE_ONLY],
)
def test_every_section_setting_is_a_keyword_and_refused_when_given_twice(section: type[Any], key: str) -> None:
    value = valid_value(section, key)
    noise = {} if key in ("noise_multiplier", "target_epsilon") else {"noise_multiplier": 1.0}
    checked = library_settings(
        300, None, None, {**noise, key: value, "delta": 1e-4} if key != "delta" else {**noise, key: 1e-4}, None
    )
    held = checked.dp if section is DpConfig else checked.train
    assert getattr(held, key) == (1e-4 if key == "delta" else value)

    data = Blobs()
    objects = {"dp": DpConfig(delta=1e-4, noise_multiplier=1.0)} if section is DpConfig else {"train": DpSgdSettings()}
    keywords = {} if section is DpConfig else {"delta": 1e-4, "noise_multiplier": 1.0}
    with pytest.raises(ValueError, match=rf"^{key} = .*: also given in {'dp' if section is DpConfig else 'train'}="):
        dpml.train_private(network(), data, **objects, **keywords, **{key: value})
    assert data.reads == 0


def test_expected_batch_size_replaces_a_sample_rate_left_at_its_default() -> None:
    noise = {"noise_multiplier": 1.0, "delta": 1e-4}
    assert library_settings(300, None, DpSgdSettings(epochs=1), noise, 30).sample_rate == 0.1
    assert library_settings(300, None, None, {**noise, "epochs": 1}, 30).sample_rate == 0.1
    assert library_settings(300, None, None, noise, None).sample_rate == DpSgdSettings().sample_rate
    for train, keywords in ((DpSgdSettings(sample_rate=0.2), noise), (None, {**noise, "sample_rate": 0.2})):
        with pytest.raises(ValueError, match="give exactly one of sample_rate and expected_batch_size"):
            library_settings(300, None, train, keywords, 30)


def test_a_keyword_is_its_fields_type_strictly() -> None:
    """A Python value, not text read from YAML: ``"yes"`` is no boolean and 7.0 no count of records."""
    noise = {"noise_multiplier": 1.0, "delta": 1e-4}
    for key, value, fragment in (
        ("tune_physical_batch", "yes", "valid boolean"),
        ("physical_batch_size", 7.0, "valid integer"),
        ("epochs", "2", "valid number"),
    ):
        with pytest.raises(ValueError, match=f"{key} = {value!r}: Input should be a {fragment}"):
            library_settings(300, None, None, {**noise, key: value}, None)


def test_a_misspelt_setting_is_refused_naming_the_settings() -> None:
    data = Blobs()
    with pytest.raises(TypeError, match=r"unknown setting 'learnig_rate'.*learning_rate"):
        dpml.train_private(network(), data, learnig_rate=0.1, **SETTINGS)
    assert data.reads == 0


@pytest.mark.parametrize(
    "train, fragment",
    [
        (TrainSettings(algorithm="noisycgd"), "algorithm = 'noisycgd': Input should be 'dpsgd'"),
        (DpGdSettings(algorithm="dpgd"), "algorithm = 'dpgd': Input should be 'dpsgd'"),
        (DpSgdSettings(seed=3), "train.seed = 3: initialises a model the pipeline builds"),
        ({"epochs": 2}, "train = 'dict': must be the DP-SGD trainer's settings"),
    ],
)
def test_settings_the_library_cannot_honour_are_refused(train: Any, fragment: str) -> None:
    data = Blobs()
    with pytest.raises(ValueError) as raised:
        dpml.train_private(network(), data, train=train, **DP_SETTINGS)
    assert fragment in str(raised.value) and data.reads == 0


def test_a_pipeline_loss_reaches_the_library_through_its_section() -> None:
    """``train.loss`` with its own setting (τ of the τ-cross-entropy): the library trains with the loss the
    pipeline would, and τ changes what it trains."""
    runs = [
        dpml.train_private(network(), Blobs(), loss="tau_cross_entropy", loss_tau=tau, **SETTINGS).model
        for tau in (1.0, 1.0, 8.0)
    ]
    assert largest_difference(runs[0], runs[1]) == 0.0 and largest_difference(runs[0], runs[2]) > 1e-4


def test_a_ledger_section_charges_its_lineage_at_its_budget(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    section = LedgerConfig(path=str(path), epsilon_budget=100.0, dataset="blobs", delta=1e-4)
    first = dpml.train_private(network(), Blobs(), ledger=section, **SETTINGS)
    spent = Ledger(path, 1e-4).total("blobs")
    assert first.spend_id is not None and spent == pytest.approx(first.epsilon, rel=1e-6)

    data = Blobs()
    with pytest.raises(BudgetExceeded):  # its budget, not a keyword's: the second run would go over it
        dpml.train_private(
            network(), data, ledger=section.model_copy(update={"epsilon_budget": spent * 1.05}), **SETTINGS
        )
    assert data.reads <= 1 and Ledger(path, 1e-4).total("blobs") == spent  # the first record's shape only

    data = Blobs()
    for extra, fragment in (
        ({"epsilon_budget": 3.0}, "epsilon_budget = 3.0: also given in ledger="),
        ({"lineage": "other"}, "lineage = 'other': also given in ledger="),
    ):
        with pytest.raises(ValueError, match=fragment):
            dpml.train_private(network(), data, ledger=section, **extra, **SETTINGS)
    with pytest.raises(ValueError, match="ledger.on_exhausted = 'exclude': train_private trains on every record"):
        dpml.train_private(network(), data, ledger=section.model_copy(update={"on_exhausted": "exclude"}), **SETTINGS)
    with pytest.raises(ValueError, match="lineage = None: a ledger needs"):
        dpml.train_private(network(), data, ledger=LedgerConfig(path=str(path)), **SETTINGS)
    assert data.reads == 0 and len(Ledger(path, 1e-4).spends(counted_only=False)) == 1
