"""Users' own tables: a declared public schema (numeric bounds, categories, missing values), its
encoding, the schema draft, and the registered model that takes raw rows through MLflow's own loading."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import yaml

from dpml.config import ConfigError, validate
from dpml.data.sources import DataError, load_source
from dpml.data.tables import table_encoding
from tests.conftest import small_params, write_params

WORK = ["Private", "Self-emp", "Gov", "Never-worked"]
SCHEMA = {
    "label_column": "income",
    "classes": ["<=50K", ">50K"],
    "missing_values": ["?", ""],
    "columns": {
        "age": {"type": "numeric", "lower": 17, "upper": 90},
        "hours": {"type": "numeric", "lower": 1, "upper": 99, "missing": 40, "indicator": True},
        "workclass": {"type": "categorical", "categories": WORK},
        "region": {"type": "categorical", "categories": [1, 2, 3]},
    },
}


def census(n: int, seed: int = 0) -> pd.DataFrame:
    """A census-style table: the label depends on age, hours and the work class; '?' marks a missing
    hours value, some work classes are outside the declared list, some are missing (empty)."""
    rng = np.random.default_rng(seed)
    age = rng.integers(17, 91, n)
    work = rng.choice([*WORK, "Without-pay", ""], n, p=[0.45, 0.2, 0.15, 0.05, 0.1, 0.05])
    hours = rng.integers(1, 100, n).astype(object)
    hours[rng.random(n) < 0.1] = "?"
    region = rng.integers(1, 4, n)
    numeric_hours = np.where(hours == "?", 40, hours).astype(float)
    score = (
        0.06 * (age - 45)
        + 0.04 * (numeric_hours - 40)
        + np.where(work == "Gov", 1.5, 0)
        - np.where(work == "Private", 1.0, 0)
        + rng.normal(0, 0.7, n)
    )
    return pd.DataFrame(
        {
            "id": [f"p{i}" for i in range(n)],
            "age": age,
            "workclass": work,
            "hours": hours,
            "region": region,
            "income": np.where(score > 0, ">50K", "<=50K"),
        }
    )


def data_config(path: Path, **extra: Any):  # noqa: ANN201
    return validate({"dp": {"target_epsilon": 2.0}, "data": {"source": f"csv:{path}", **SCHEMA, **extra}})


# ----------------------------------------------------------------------------------------- schema checks


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"columns": {"age": {"type": "numeric", "lower": 90, "upper": 17}}},
            r"data\.columns\.age: upper = 17\.0 must be > lower = 90\.0",
        ),
        (
            {"columns": {"w": {"type": "categorical", "categories": []}}},
            r"data\.columns\.w\.categories = \[\]: an empty",
        ),
        (
            {"columns": {"w": {"type": "categorical", "categories": ["a", "b", "a"]}}},
            r"\['a'\] are listed more than once",
        ),
        ({"columns": {"w": {"type": "text"}}}, r"data\.columns\.w\.type = 'text': unknown column type"),
        ({"columns": {"w": {"categories": ["a"]}}}, r"data\.columns\.w\.type: required"),
        (
            {"columns": {"age": {"type": "numeric", "lower": 0, "upper": 1, "missing": 2}}},
            r"data\.columns\.age: missing = 2\.0: the fill must lie in \[lower, upper\]",
        ),
        (
            {"columns": {"income": {"type": "numeric", "lower": 0, "upper": 1}}},
            r"label_column = 'income' is also a feature",
        ),
        ({"classes": ["<=50K", ">50K", "<=50K"]}, r"classes \['<=50K'\] are listed more than once"),
        ({"columns": {}}, r"data\.columns is empty"),
        ({"feature_columns": ["age"]}, r"data\.columns and data\.feature_columns: give one"),
    ],
)
def test_schema_mistakes_name_the_column(tmp_path: Path, change: dict, message: str) -> None:
    path = tmp_path / "t.csv"
    census(10).to_csv(path, index=False)
    with pytest.raises(ConfigError, match=message):
        data_config(path, **change)


def test_schema_rules_across_sections(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    census(10).to_csv(path, index=False)
    base = {"dp": {"target_epsilon": 2.0}, "data": {"source": f"csv:{path}", **SCHEMA}}
    with pytest.raises(ConfigError, match=r"preprocess\.lower = 3\.0: not used with data\.columns"):
        validate({**base, "preprocess": {"lower": 3.0}})
    with pytest.raises(ConfigError, match=r"data\.columns: only a csv or parquet source has columns"):
        validate({"dp": {"target_epsilon": 2.0}, "data": {"source": "sklearn:iris", "columns": SCHEMA["columns"]}})
    with pytest.raises(ConfigError, match=r"renamed to tracking\.model_name"):
        validate({**base, "tracking": {"registered_model": "x"}})
    with pytest.raises(ConfigError, match=r"tracking\.model_name = 'a/b': a registered model name"):
        validate({**base, "tracking": {"model_name": "a/b"}})
    # A validated configuration survives its own dump (the logged config.json, a search's candidates).
    from dpml.config import with_hyperparameters

    config = validate(base)
    assert validate(config.to_dict()) == config
    assert with_hyperparameters(config, {"train.learning_rate": 0.25}).train.learning_rate == 0.25
    # Each data set its own registered model, unless named.
    assert validate(base).tracking.model_name == "dpml-t"
    assert validate({"dp": {"target_epsilon": 2.0}}).tracking.model_name == "dpml-digits"
    assert validate({**base, "tracking": {"model_name": "mine"}}).tracking.model_name == "mine"


# -------------------------------------------------------------------------------------------- encoding


def test_one_hot_missing_and_other_slots(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    frame = pd.DataFrame(
        {
            "age": [30, 200, "?", 17],
            "workclass": [" Gov", "Alien", "", "Private"],
            "hours": ["?", "10", "99", "1"],
            "region": [2, 3.0, 1, 2],
            "income": [">50K", "<=50K", "<=50K", ">50K"],
        }
    )
    frame.to_csv(path, index=False)
    raw = load_source(data_config(path).data)
    assert raw.feature_names == [
        "age",
        "hours",
        "hours:missing",
        *[f"workclass={w}" for w in WORK],
        "workclass=<missing>",
        "workclass=<other>",
        "region=1",
        "region=2",
        "region=3",
        "region=<missing>",
        "region=<other>",
    ]
    # age: raw value (clipped to [17, 90] later, by the preprocess stage), a missing one takes the midpoint 53.5
    np.testing.assert_array_equal(raw.x[:, 0], [30, 200, 53.5, 17])
    np.testing.assert_array_equal(raw.x[:, 1:3], [[40, 1], [10, 0], [99, 0], [1, 0]])  # declared fill + indicator
    work = raw.x[:, 3:9]
    np.testing.assert_array_equal(work.argmax(1), [2, 5, 4, 0])  # Gov (spaces stripped), <other>, <missing>, Private
    assert (work.sum(1) == 1).all()
    np.testing.assert_array_equal(raw.x[:, 9:14].argmax(1), [1, 2, 0, 1])  # 3.0 is category 3
    assert raw.slot_counts == {"missing": {"age": 1, "hours": 1, "workclass": 1}, "other": {"workclass": 1}}
    assert raw.y.tolist() == [1, 0, 0, 1]
    # Scaling uses each column's declared bounds; one-hot columns lie in [0, 1].
    encoding = table_encoding(data_config(path).data, data_config(path).preprocess)
    assert encoding is not None
    lower, upper = encoding.bounds()
    assert lower[:3].tolist() == [17, 1, 0] and upper[:3].tolist() == [90, 99, 1]


def test_encoding_is_record_by_record_and_chunking_changes_nothing(tmp_path: Path) -> None:
    table = census(257, seed=3)
    for kind in ("csv", "parquet"):
        path = tmp_path / f"t.{kind}"
        if kind == "csv":
            table.to_csv(path, index=False)
        else:
            table.astype({"hours": str}).to_parquet(path)
        config = validate(
            {"dp": {"target_epsilon": 2.0}, "data": {"source": f"{kind}:{path}", **SCHEMA, "chunk_rows": 100_000}}
        )
        whole = load_source(config.data)
        chunked = load_source(config.data.model_copy(update={"chunk_rows": 7}))
        np.testing.assert_array_equal(whole.x, chunked.x)
        np.testing.assert_array_equal(whole.y, chunked.y)
        assert whole.slot_counts == chunked.slot_counts and whole.slot_counts["other"]["workclass"] > 0
        if kind == "csv":
            reference = whole
        else:
            np.testing.assert_array_equal(whole.x, reference.x)  # the same table as Parquet encodes the same
    encoding = table_encoding(config.data, config.preprocess)
    assert encoding is not None
    alone = np.concatenate([encoding.encode(table.iloc[[i]].astype(object))[0] for i in range(20)])
    np.testing.assert_array_equal(alone, encoding.encode(table.iloc[:20].astype(object))[0])


@pytest.mark.parametrize(
    ("cells", "extra", "message"),
    [
        ({"hours": "many"}, {}, r"row 9, column 'hours': 'many' is not a number"),
        ({"age": "inf"}, {}, r"row 9, column 'age': value inf is not finite"),
        ({"workclass": "Alien"}, {"strict": True}, r"row 9, column 'workclass': 'Alien' is not one of the declared"),
        ({"income": "rich"}, {}, r"row 9, column 'income': label 'rich' is not in data\.classes"),
        ({"income": ""}, {}, r"row 9, column 'income': missing label"),
    ],
)
def test_bad_cells_name_row_and_column_across_chunks(tmp_path: Path, cells: dict, extra: dict, message: str) -> None:
    table = census(12).astype(object)
    table["workclass"] = "Gov"
    for column, value in cells.items():
        table.loc[9, column] = value
    path = tmp_path / "t.csv"
    table.to_csv(path, index=False)
    with pytest.raises(DataError, match=message):
        load_source(data_config(path, chunk_rows=4, **extra).data)


def test_shorthand_feature_columns_still_refuse_missing_values(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    pd.DataFrame({"a": [1.0, None, 2.0], "income": [">50K", "<=50K", ">50K"]}).to_csv(path, index=False)
    config = validate(
        {
            "dp": {"target_epsilon": 2.0},
            "data": {
                "source": f"csv:{path}",
                "label_column": "income",
                "classes": ["<=50K", ">50K"],
                "feature_columns": ["a"],
            },
        }
    )
    with pytest.raises(DataError, match=r"row 1, column 'a': missing value"):
        load_source(config.data)


def test_unknown_column_is_refused_before_any_spend(tmp_path: Path) -> None:
    from dpml.preflight import PreflightError, check_table_header

    path = tmp_path / "t.csv"
    census(10).to_csv(path, index=False)
    columns = {**SCHEMA["columns"], "wrkclass": {"type": "categorical", "categories": ["a"]}}
    with pytest.raises(PreflightError, match=r"column\(s\) named under data: \['wrkclass'\] not found"):
        check_table_header(data_config(path, columns=columns))


# -------------------------------------------------------------------------------------------- dpml schema


def test_schema_draft_is_marked_not_private_and_validates(tmp_path: Path) -> None:
    path = tmp_path / "people.csv"
    census(400).to_csv(path, index=False)
    result = subprocess.run(
        [sys.executable, "-m", "dpml", "schema", str(path), "--label", "income", "--max-categories", "10"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "READ FROM THE DATA: NOT PRIVATE" in text
    draft = yaml.safe_load(text)["data"]
    assert draft["source"] == f"csv:{path}" and sorted(draft["classes"]) == ["<=50K", ">50K"]
    assert "?" in draft["missing_values"] and "" in draft["missing_values"]
    columns = draft["columns"]
    assert "id" not in columns  # every value distinct: an identifier, left out
    assert columns["age"]["type"] == "numeric" and columns["hours"]["type"] == "numeric"
    assert columns["hours"].get("indicator") is True  # '?' cells: missing
    assert set(columns["workclass"]["categories"]) == {*WORK, "Without-pay"}
    for name in columns:  # every drafted value is marked as read from the data
        line = next(row for row in text.splitlines() if row.strip().startswith(f'"{name}"'))
        assert "READ FROM THE DATA" in line
    validate({"dp": {"target_epsilon": 2.0}, "data": draft})


# ----------------------------------------------------------------- a full run and the raw-record model


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


LOAD_WITHOUT_DPML = """
import json, sys
sys.modules["dpml"] = None  # the registered model must not need dpml
import mlflow, pandas as pd
frame = pd.read_csv(sys.argv[2]).iloc[json.loads(sys.argv[3])].drop(columns=["id", "income"])
model = mlflow.pyfunc.load_model(sys.argv[1])
print(model.predict(frame).to_json(orient="split"))
"""


@pytest.mark.slow
def test_pipeline_on_a_table_registers_a_model_that_takes_raw_rows(workdir: Path) -> None:
    import torch

    from dpml.config import load
    from dpml.stages import Layout, load_model

    path = workdir / "census.csv"
    census(1500).to_csv(path, index=False)
    params = small_params(
        workdir,
        data={"source": f"csv:{path}", **SCHEMA, "id_column": "id"},
        preprocess={"clip_norm": 3.0},
        audit={"references": 1, "white_box_canaries": 0, "black_box_canaries": 0, "control": False},
        gate={"epsilon_budget": 1e6},
    )
    del params["preprocess"]["lower"], params["preprocess"]["upper"]
    del params["tracking"]["model_name"]  # each data set its own model: dpml-census
    config_path = write_params(workdir / "p.yaml", params)
    run = subprocess.run(
        [sys.executable, "-m", "dpml", "run", "--engine", "local", "--params", str(config_path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr
    assert "models:/dpml-census/1" in run.stdout
    config = load(config_path)
    layout = Layout(config)
    meta = json.loads(layout.raw_meta.read_text())
    assert meta["columns"] == ["age", "hours", "workclass", "region"] and meta["slot_counts"]["other"]["workclass"] > 0
    assert json.loads(layout.prepared_meta.read_text())["n_features"] == 1 + 2 + 6 + 5

    # MLflow's own loading, in a process where dpml cannot be imported, on rows as pandas reads them.
    test_rows = np.load(layout.split)["test"][:40]
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"sqlite:///{workdir / 'mlflow.db'}",  # and the environment's
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }  # scripts (uvicorn)
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            LOAD_WITHOUT_DPML,
            "models:/dpml-census@champion",
            str(path),
            json.dumps(test_rows.tolist()),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=workdir,
    )
    assert loaded.returncode == 0, loaded.stderr
    predicted = pd.read_json(__import__("io").StringIO(loaded.stdout), orient="split")
    x_test = np.load(layout.prepared["test"])["x"][:40]
    with torch.no_grad():
        ours = torch.softmax(load_model(layout)(torch.from_numpy(x_test)).double(), 1).numpy()
    np.testing.assert_allclose(predicted[["probability(<=50K)", "probability(>50K)"]].to_numpy(), ours, atol=1e-5)
    assert predicted["label"].tolist() == [config.data.classes[i] for i in ours.argmax(1)]

    # `mlflow models serve`, asked over HTTP with raw JSON rows (a missing value, an unknown category,
    # a column left out): the same answers as the loaded model.
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "models",
            "serve",
            "-m",
            "models:/dpml-census@champion",
            "--env-manager",
            "local",
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
        ],
        env=env,
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2):
                    break
            except OSError:
                assert server.poll() is None, server.stderr.read() if server.stderr else "server exited"
                assert time.monotonic() < deadline, "mlflow models serve did not answer /ping in 180 s"
                time.sleep(1)
        rows = [[25, "Gov", None, 2], [60, "Alien", "?", 3], [None, None, 12, 1]]
        body = json.dumps({"dataframe_split": {"columns": ["age", "workclass", "hours", "region"], "data": rows}})
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/invocations", data=body.encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            served = pd.DataFrame(json.loads(response.read())["predictions"])
        import mlflow

        mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
        local = mlflow.pyfunc.load_model("models:/dpml-census@champion").predict(
            pd.DataFrame(rows, columns=["age", "workclass", "hours", "region"])
        )
        np.testing.assert_allclose(
            served[["probability(<=50K)", "probability(>50K)"]].to_numpy(),
            local[["probability(<=50K)", "probability(>50K)"]].to_numpy(),
            atol=1e-6,
        )
        # The declared encoding: any unknown work class is the <other> slot, a column left out is missing.
        model = mlflow.pyfunc.load_model("models:/dpml-census@champion")
        other = model.predict(
            pd.DataFrame(rows[1:2] + [[60, "Without-pay", "?", 3]], columns=["age", "workclass", "hours", "region"])
        )
        assert other["probability(>50K)"].iloc[0] == pytest.approx(other["probability(>50K)"].iloc[1], abs=1e-6)
        without = model.predict(pd.DataFrame([[25, "Gov", None]], columns=["age", "workclass", "hours"]))
        with_missing = model.predict(
            pd.DataFrame([[25, "Gov", None, None]], columns=["age", "workclass", "hours", "region"])
        )
        assert without["probability(>50K)"].iloc[0] == pytest.approx(
            with_missing["probability(>50K)"].iloc[0], abs=1e-6
        )
    finally:
        server.terminate()
        server.wait(timeout=30)
