"""A configuration that cannot lie (issue 51): duplicate keys at any level, numbers that bound privacy in
every spelling of infinity and NaN, YAML 1.1's booleans and numbers in category lists, bounds that
overflow the encoding, and a directory where a file belongs — each refused before any work, naming the
key, the value and what is allowed, or read as the text the user wrote."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dpml.config import ConfigError, load, validate
from dpml.data.sources import load_source
from dpml.ledger.ledger import Ledger, LedgerError
from dpml.ledger.units import UnitKeyError, load_or_create_key
from tests.conftest import REPO, small_params, write_params

BASE = """\
dp: {noise_multiplier: 1.0, delta: 1.0e-5}
ledger:
  path: ledger.db
  epsilon_budget: 3
"""


def written(tmp_path: Path, text: str, name: str = "params.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------------ duplicates


@pytest.mark.parametrize(
    ("text", "key", "lines"),
    [
        (BASE + "gate: {epsilon_budget: 4}\nledger:\n  epsilon_budget: 1000\n", "ledger", "lines 2 and 6"),
        ("dp:\n  target_epsilon: 2\n  delta: 1.0e-5\n  target_epsilon: 20\n", "dp.target_epsilon", "lines 2 and 4"),
        ("dp: {target_epsilon: 2, target_epsilon: 20}\n", "dp.target_epsilon", "line 1, columns 6 and 25"),
        (
            "data:\n  columns:\n    age:\n      type: numeric\n      lower: 0\n      upper: 9\n      lower: -1\n",
            "data.columns.age.lower",
            "lines 5 and 7",
        ),
        (
            "data:\n  columns:\n    age: {type: numeric, lower: 0, upper: 9}\n"
            "    age: {type: numeric, lower: 0, upper: 90}\n",
            "data.columns.age",
            "lines 3 and 4",
        ),
        (
            "tune:\n  space:\n    train.learning_rate: [1]\n    train.learning_rate: [2]\n",
            "tune.space.train.learning_rate",
            "lines 3 and 4",
        ),
        (
            "dp: {noise_multiplier: 1.0}\naudit:\n  attacks: [loss]\n  'attacks': [rmia-online]\n",
            "audit.attacks",
            "lines 3 and 4",
        ),
    ],
)
def test_a_key_given_twice_at_any_level_is_refused_naming_it_and_both_lines(
    tmp_path: Path, text: str, key: str, lines: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        load(written(tmp_path, text))
    message = str(refused.value)
    assert f"{key} is given twice ({lines})" in message and "\n" not in message


def test_two_spellings_of_one_key_are_one_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"under dp, the keys 'delta' and '\"delta\"'|dp.delta is given twice"):
        load(written(tmp_path, 'dp: {noise_multiplier: 1.0, delta: 1.0e-5, "delta": 0.5}\n'))
    with pytest.raises(ConfigError, match=r"under model.options, the keys 'yes' and 'true' are the same key \(True\)"):
        load(written(tmp_path, "model: {options: {yes: 1, true: 2}}\n"))
    with pytest.raises(ConfigError, match=r"the keys '1' and '1.0' are the same key"):
        load(written(tmp_path, "model: {options: {1: a, 1.0: b}}\n"))


def test_overrides_are_read_as_strictly_as_the_file(tmp_path: Path) -> None:
    path = written(tmp_path, BASE)
    with pytest.raises(ConfigError, match=r"--set data.columns: data.columns.age is given twice"):
        load(
            path, ["data.columns={age: {type: numeric, lower: 0, upper: 1}, age: {type: numeric, lower: 0, upper: 9}}"]
        )
    with pytest.raises(ConfigError, match=r"--set tune.space: tune.space.train.momentum is given twice"):
        load(path, ["tune.space={train.momentum: [0.1], train.momentum: [0.9]}"])
    # the same key in two flags: the last flag wins (documented), and the file's duplicates are still refused
    assert load(path, ["ledger.epsilon_budget=5", "ledger.epsilon_budget=2"]).ledger.epsilon_budget == 2
    with pytest.raises(ConfigError, match="ledger is given twice"):
        load(written(tmp_path, BASE + "ledger: {epsilon_budget: 1000}\n"), ["ledger.epsilon_budget=2"])
    # deeper keys reach a column's bounds
    table = tmp_path / "t.csv"
    table.write_text("age,label\n30,a\n40,b\n")
    data = (
        f"data: {{source: 'csv:{table}', label_column: label, classes: [a, b], "
        "columns: {age: {type: numeric, lower: 0, upper: 100}}}\n"
    )
    assert load(written(tmp_path, BASE + data), ["data.columns.age.upper=120"]).data.columns["age"].upper == 120


def test_a_merge_key_may_be_overridden_it_is_not_a_duplicate(tmp_path: Path) -> None:
    text = "defaults: &d {noise_multiplier: 1.0, delta: 1.0e-5}\n"
    config = load(written(tmp_path, "dp:\n  <<: {noise_multiplier: 1.0, delta: 1.0e-3}\n  delta: 1.0e-5\n"))
    assert config.dp.delta == 1e-5
    with pytest.raises(ConfigError, match="defaults = .*unknown key"):
        load(written(tmp_path, text + "dp: *d\n"))


# --------------------------------------------------------------------------------------- finite numbers

NON_FINITE = [
    ".inf",
    ".Inf",
    ".INF",
    "+.inf",
    "-.inf",
    "-.Inf",
    ".nan",
    ".NaN",
    ".NAN",
    "1e999",
    "-1e999",
    "1.0e+400",
    "1E400",
    "'inf'",
    "'-Infinity'",
    "'nan'",
    "'NaN'",
    "'1e999'",
    '"+inf"',
    "1" + "0" * 400,
]
BOUNDING = [
    "ledger.epsilon_budget",
    "ledger.kl_budget",
    "ledger.delta",
    "dp.target_epsilon",
    "dp.noise_multiplier",
    "dp.delta",
    "dp.clip_norm",
    "gate.epsilon_budget",
    "preprocess.clip_norm",
    "preprocess.upper",
]


@pytest.mark.parametrize("spelling", NON_FINITE)
def test_a_number_that_bounds_privacy_is_finite_in_every_spelling(tmp_path: Path, spelling: str) -> None:
    path = written(tmp_path, BASE)
    for key in BOUNDING:
        section, name = key.split(".")
        with pytest.raises(ConfigError) as in_flag:
            load(path, [f"{key}={spelling}"])
        assert key in str(in_flag.value) and "finite" in str(in_flag.value)
        with pytest.raises(ConfigError) as in_file:
            load(written(tmp_path, f"{section}:\n  {name}: {spelling}\n", "file.yaml"))
        assert key in str(in_file.value) and "finite" in str(in_file.value)


def test_non_finite_numbers_in_lists_and_free_form_values_are_refused(tmp_path: Path) -> None:
    path = written(tmp_path, BASE)
    with pytest.raises(ConfigError, match=r"tune.space.train.learning_rate\[1\] = \.inf: not a finite number"):
        load(path, ["tune.space={train.learning_rate: [0.5, .inf]}"])
    with pytest.raises(ConfigError, match=r"model.options.scale = 1e999: not a finite number"):
        load(path, ["model.options={scale: 1e999}"])
    with pytest.raises(ConfigError, match=r"model.hidden\[0\] = nan: must be a finite number"):
        validate({"dp": {"noise_multiplier": 1.0}, "model": {"hidden": [float("nan")]}})


@pytest.mark.parametrize("spelling", ["yes", "no", "on", "off", "true", "True", "FALSE"])
def test_a_boolean_is_not_a_number(tmp_path: Path, spelling: str) -> None:
    with pytest.raises(ConfigError, match=r"ledger.epsilon_budget = (True|False): a boolean"):
        load(written(tmp_path, BASE), [f"ledger.epsilon_budget={spelling}"])
    with pytest.raises(ConfigError, match=r"model.hidden = \[(True|False)\]: a boolean"):
        load(written(tmp_path, BASE), [f"model.hidden=[{spelling}]"])


def test_yaml_12_numbers_mean_what_they_say(tmp_path: Path) -> None:
    config = load(written(tmp_path, "dp: {noise_multiplier: 1e0, delta: 1e-5}\ntrain: {seed: 010, epochs: 2e1}\n"))
    assert config.dp.delta == 1e-5 and config.train.seed == 10 and config.train.epochs == 20.0


# ------------------------------------------------------------------------------------ category texts


def test_category_lists_keep_the_text_written(tmp_path: Path) -> None:
    """YAML 1.1 reads no/yes/NO/on/off as booleans, 1.10 as 1.1, 010 as 8 and 2026-11-20 as a date; each cell
    of those texts must land in its own slot, never in <other>."""
    table = tmp_path / "t.csv"
    frame = pd.DataFrame(
        {
            "answer": ["no", "yes", "yes", "no"],
            "country": ["NO", "SE", "DK", "NO"],
            "switch": ["on", "off", "off", "on"],
            "version": ["1.10", "1.2", "1.10", "1.2"],
            "code": ["010", "011", "010", "011"],
            "day": ["2026-11-20", "2026-11-27"] * 2,
            "no": [1, 2, 3, 4],
            "label": ["no", "yes", "no", "yes"],
        }
    )
    frame.to_csv(table, index=False)
    text = (
        BASE
        + f"""\
data:
  source: csv:{table}
  label_column: label
  classes: [no, yes]
  columns:
    answer: {{type: categorical, categories: [no, yes]}}
    country: {{type: categorical, categories: [NO, SE, DK]}}
    switch: {{type: categorical, categories: [on, off]}}
    version: {{type: categorical, categories: [1.10, 1.2]}}
    code: {{type: categorical, categories: [010, 011]}}
    day: {{type: categorical, categories: [2026-11-20, 2026-11-27]}}
    no: {{type: numeric, lower: 0, upper: 9}}
"""
    )
    config = load(written(tmp_path, text))
    assert config.data.classes == ["no", "yes"] and "no" in config.data.columns
    assert config.data.columns["version"].categories == ["1.10", "1.2"]
    raw = load_source(config.data, config.preprocess)
    assert raw.slot_counts == {"missing": {}, "other": {}}, raw.slot_counts
    assert raw.y.tolist() == [0, 1, 0, 1]
    # the same through --set, and a list built in Python with booleans is refused with the fix
    over = load(written(tmp_path, text), ["data.columns.answer.categories=[yes, no]"])
    assert over.data.columns["answer"].categories == ["yes", "no"]
    with pytest.raises(ConfigError, match=r"False in categories is a boolean.*quoted \(e\.g\. \['no', 'yes'\]\)"):
        validate(
            {
                "dp": {"noise_multiplier": 1.0},
                "data": {
                    "source": f"csv:{table}",
                    "label_column": "label",
                    "classes": ["no", "yes"],
                    "columns": {"answer": {"type": "categorical", "categories": [False, True]}},
                },
            }
        )


# ------------------------------------------------------------------------------------------ bounds


@pytest.mark.parametrize(("lower", "upper"), [(-1e308, 1e308), (-1.7e308, 0.5e308), (0.0, 5e-324)])
def test_bounds_whose_width_overflows_are_refused_at_validation(tmp_path: Path, lower: float, upper: float) -> None:
    table = tmp_path / "t.csv"
    table.write_text("x,label\n1,a\n2,b\n")
    data = {
        "source": f"csv:{table}",
        "label_column": "label",
        "classes": ["a", "b"],
        "columns": {"x": {"type": "numeric", "lower": lower, "upper": upper}},
    }
    with pytest.raises(ConfigError, match=r"data\.columns\.x: lower = .*upper − lower = .* cannot scale"):
        validate({"dp": {"noise_multiplier": 1.0}, "data": data})
    with pytest.raises(ConfigError, match=r"preprocess\.lower = .*cannot scale"):
        validate({"dp": {"noise_multiplier": 1.0}, "preprocess": {"lower": lower, "upper": upper}})


def test_bounds_near_the_float_range_that_do_fit_have_a_finite_midpoint(tmp_path: Path) -> None:
    table = tmp_path / "t.csv"
    table.write_text("x,label\n,a\n1e308,b\n")
    config = validate(
        {
            "dp": {"noise_multiplier": 1.0},
            "data": {
                "source": f"csv:{table}",
                "label_column": "label",
                "classes": ["a", "b"],
                "columns": {"x": {"type": "numeric", "lower": 1.0e308, "upper": 1.7e308}},
            },
        }
    )
    raw = load_source(config.data)
    assert np.isfinite(raw.x).all() and raw.x[0, 0] == pytest.approx(1.35e308)


# ------------------------------------------------------------------------------------ the real problem


def test_a_directory_is_not_reported_as_missing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"configuration file .* is a directory; give the parameter file itself"):
        load(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match=r"data\.source = 'csv:.*': .* is a directory, not a csv file"):
        validate(
            {
                "dp": {"noise_multiplier": 1.0},
                "data": {
                    "source": f"csv:{tmp_path}",
                    "label_column": "y",
                    "classes": ["a", "b"],
                    "feature_columns": ["x"],
                },
            }
        )
    with pytest.raises(LedgerError, match=r"is a directory; the ledger is a file in it"):
        Ledger(tmp_path, 1e-5)
    with pytest.raises(UnitKeyError, match=r"is a directory; ledger.unit_key names the unit key file itself"):
        load_or_create_key(tmp_path, create=True)
    latin = written(tmp_path, "", "latin.yaml")
    latin.write_bytes("dp: {noise_multiplier: 1.0}\n# café\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 0xe9"):
        load(latin)


def dpml(workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dpml", *args],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
    )


def test_the_cli_refuses_each_in_one_line_before_the_ledger_exists(workdir: Path) -> None:
    params = small_params(workdir)
    path = write_params(workdir / "params.yaml", params)
    path.write_text(path.read_text() + "ledger:\n  epsilon_budget: 1000\n")
    cases = [
        (["run", "--engine", "local"], r"params\.yaml: ledger is given twice \(lines \d+ and \d+\)"),
        (["run", "--engine", "local", "--params", str(workdir)], r"is a directory"),
        (
            [
                "run",
                "--engine",
                "local",
                "--params",
                str(write_params(workdir / "ok.yaml", params)),
                "--set",
                "ledger.epsilon_budget=1e999",
            ],
            r"ledger\.epsilon_budget = 1e999: not a finite number",
        ),
    ]
    for args, expected in cases:
        result = dpml(workdir, *args)
        assert result.returncode == 2, result.stderr
        errors = [line for line in result.stderr.splitlines() if line.startswith("dpml: error:")]
        assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
        assert __import__("re").search(expected, errors[0]), errors[0]
    assert not (workdir / "ledger.db").exists() or not Ledger(workdir / "ledger.db", 1e-5).spends(counted_only=False)
