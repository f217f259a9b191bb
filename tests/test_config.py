from pathlib import Path

import pytest

from dpml.config import ConfigError, load, validate
from tests.conftest import REPO, small_params, write_params


def test_repository_params_are_valid() -> None:
    config = load(REPO / "params.yaml")
    assert config.data.source == "sklearn:digits"
    assert config.dp.target_epsilon is not None


@pytest.mark.parametrize(
    ("section", "key", "value", "fragment"),
    [
        ("dp", "noise_multiplier", -1.0, "dp.noise_multiplier = -1.0"),
        ("dp", "delta", 1.0, "dp.delta = 1.0"),
        ("dp", "delta", 0.0, "dp.delta = 0.0"),
        ("dp", "target_epsilon", 0, "dp.target_epsilon = 0"),
        ("dp", "clip_norm", 0, "dp.clip_norm = 0"),
        ("train", "sample_rate", 1.5, "train.sample_rate = 1.5"),
        ("train", "sample_rate", 0.0, "train.sample_rate = 0.0"),
        ("preprocess", "clip_norm", -2, "preprocess.clip_norm = -2"),
        ("data", "source", "sklearn:nope", "data.source = 'sklearn:nope'"),
        ("data", "source", "idx:/definitely/not/here", "does not exist"),
        ("data", "source", "csv:/no/such.csv", "does not exist"),
        ("data", "source", "s3://bucket", "must look like one of"),
        ("train", "optimizer", "lbfgs", "train.optimizer = 'lbfgs'"),
        ("dp", "noise_multiplier", float("nan"), "must be a finite number"),
    ],
)
def test_invalid_values_name_key_value_and_rule(
    tmp_path: Path, section: str, key: str, value: object, fragment: str
) -> None:
    params = small_params(tmp_path)
    params[section][key] = value
    if section == "dp" and key == "target_epsilon":
        params["dp"].pop("noise_multiplier")
    with pytest.raises(ConfigError) as error:
        validate(params)
    assert fragment in str(error.value)


def test_messages_say_what_is_allowed(tmp_path: Path) -> None:
    params = small_params(tmp_path)
    params["dp"]["delta"] = 2
    with pytest.raises(ConfigError, match=r"dp.delta = 2: Input should be less than 1"):
        validate(params)


def test_unknown_keys_are_rejected(tmp_path: Path) -> None:
    params = small_params(tmp_path)
    params["dp"]["noise_multplier"] = 1.0
    params["extra_section"] = {}
    with pytest.raises(ConfigError) as error:
        validate(params)
    assert "dp.noise_multplier = 1.0: unknown key" in str(error.value)
    assert "extra_section" in str(error.value)


def test_noise_and_target_are_mutually_exclusive(tmp_path: Path) -> None:
    params = small_params(tmp_path)
    params["dp"]["target_epsilon"] = 2.0
    with pytest.raises(ConfigError, match="exactly one of dp.noise_multiplier and dp.target_epsilon"):
        validate(params)


def test_overrides_are_parsed_and_validated(tmp_path: Path) -> None:
    path = write_params(tmp_path / "params.yaml", small_params(tmp_path))
    config = load(path, ["dp.noise_multiplier=null", "dp.target_epsilon=2", "model.hidden=[8, 4]"])
    assert config.dp.target_epsilon == 2.0 and config.dp.noise_multiplier is None
    assert config.model.hidden == [8, 4]
    with pytest.raises(ConfigError, match="dp.noise_multiplier = -3"):
        load(path, ["dp.noise_multiplier=-3"])
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load(path, ["noise=3"])


def test_tabular_source_needs_declared_columns_and_classes(tmp_path: Path) -> None:
    table = tmp_path / "t.csv"
    table.write_text("a,label\n1,x\n")
    params = small_params(tmp_path, data={"source": f"csv:{table}"})
    with pytest.raises(
        ConfigError, match=r"needs data.label_column, data.classes, data.columns \(or feature_columns\)"
    ):
        validate(params)


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("dp: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load(bad)


def test_delta_at_least_inverse_n_is_refused_unless_allowed(tmp_path: Path) -> None:
    from dpml.stages import check_delta

    config = validate(small_params(tmp_path, dp={"delta": 0.01}))
    with pytest.raises(ValueError, match=r"dp.delta = 0.01 is ≥ 1/n = 0.005 for n = 200"):
        check_delta(config, 200)
    check_delta(config, 50)  # 0.01 < 1/50: fine
    allowed = validate(small_params(tmp_path, dp={"delta": 0.01, "allow_delta_above_inverse_n": True}))
    with pytest.warns(UserWarning, match="permits releasing some record"):
        check_delta(allowed, 200)
