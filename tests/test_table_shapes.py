"""Tables that cannot mislead (issue 51): a column named twice, a nested Parquet column, another
separator, another encoding, a binary file, a ragged row, a boolean column read against yes/no — each
refused before the ledger reserves anything, naming the real problem; and the same records in any
encoding, line ending or separator are the same records (the same features, the same people)."""

from __future__ import annotations

import codecs
import datetime
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dpml.config import validate
from dpml.data.sources import DataError, load_source
from dpml.preflight import PreflightError, check_table_header
from dpml.ledger.ledger import Ledger
from dpml.data.units import digests_of_rows
from dpml.stages import run_all
from tests.conftest import REPO, small_params, write_params

COLORS = ["rot", "grün", "blau", "Ærø"]


def frame(n: int = 60) -> pd.DataFrame:
    rng = np.random.default_rng(1)
    return pd.DataFrame(
        {
            "pid": [f"p{i:04d}" for i in range(n)],
            "age": rng.integers(18, 90, n),
            "score": np.round(rng.normal(0, 1, n), 3),
            "color": [COLORS[i % 4] for i in range(n)],
            "label": ["yes" if i % 2 else "no" for i in range(n)],
        }
    )


def data_section(source: str, id_column: bool = True, **extra: Any) -> dict[str, Any]:
    return {
        "source": source,
        "label_column": "label",
        "classes": ["no", "yes"],
        "columns": {
            "age": {"type": "numeric", "lower": 0, "upper": 120},
            "score": {"type": "numeric", "lower": -5, "upper": 5},
            "color": {"type": "categorical", "categories": COLORS},
        },
        **({"id_column": "pid"} if id_column else {}),
        **extra,
    }


def config_for(source: str, **extra: Any):  # noqa: ANN201
    return validate({"dp": {"noise_multiplier": 1.0}, "data": data_section(source, **extra)})


def as_text(table: pd.DataFrame, separator: str = ",", newline: str = "\n") -> str:
    return table.to_csv(index=False, sep=separator, lineterminator=newline)


# ------------------------------------------------------------------------- the same records, any bytes

VARIANTS = {
    "plain": (lambda t: as_text(t).encode("utf-8"), {}),
    "bom-crlf": (lambda t: codecs.BOM_UTF8 + as_text(t, newline="\r\n").encode("utf-8"), {}),
    "cr-only": (lambda t: as_text(t, newline="\r").encode("utf-8"), {}),
    "cp1252": (lambda t: as_text(t).encode("cp1252"), {}),
    "latin-1-declared": (lambda t: as_text(t).encode("latin-1"), {"encoding": "latin-1"}),
    "utf-16": (lambda t: as_text(t).encode("utf-16"), {}),
    "utf-8-declared-with-bom": (lambda t: codecs.BOM_UTF8 + as_text(t).encode("utf-8"), {"encoding": "utf-8"}),
    "semicolon": (lambda t: as_text(t, ";").encode("utf-8"), {"separator": ";"}),
    "tab": (lambda t: as_text(t, "\t").encode("utf-8"), {"separator": "\t"}),
    "tab-by-name": (lambda t: as_text(t, "\t").encode("utf-8"), {"separator": "tab"}),
    "pipe-cp1252-crlf": (lambda t: as_text(t, "|", "\r\n").encode("cp1252"), {"separator": "|"}),
}


@pytest.mark.parametrize("id_column", [True, False], ids=["id-column", "row-content"])
def test_the_same_records_in_any_encoding_or_separator_are_the_same_people(tmp_path: Path, id_column: bool) -> None:
    table = frame()
    reference = None
    for name, (write, extra) in VARIANTS.items():
        path = tmp_path / f"{name}.csv"
        path.write_bytes(write(table))
        raw = load_source(config_for(f"csv:{path}", id_column=id_column, **extra).data)
        units = raw.units if id_column else digests_of_rows(raw.x, raw.y)
        if reference is None:
            reference = (raw.x, raw.y, units)
            assert raw.slot_counts == {"missing": {}, "other": {}}  # "grün" and "Ærø" matched, not <other>
            continue
        np.testing.assert_array_equal(raw.x, reference[0], err_msg=name)
        np.testing.assert_array_equal(raw.y, reference[1], err_msg=name)
        np.testing.assert_array_equal(units, reference[2], err_msg=name)
    parquet = tmp_path / "t.parquet"
    table.to_parquet(parquet)
    raw = load_source(config_for(f"parquet:{parquet}", id_column=id_column).data)
    np.testing.assert_array_equal(raw.x, reference[0])


# ----------------------------------------------------------------------------------------- refusals


def csv_file(tmp_path: Path, text: str | bytes, name: str = "t.csv") -> str:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return f"csv:{path}"


def parquet_file(tmp_path: Path, columns: dict[str, pa.Array], name: str = "t.parquet") -> str:
    path = tmp_path / name
    pq.write_table(pa.Table.from_arrays(list(columns.values()), names=list(columns)), path)
    return f"parquet:{path}"


def duplicated(tmp_path: Path, column: str) -> str:
    table = frame(8)
    text = as_text(table).splitlines()
    stale = ["no"] * 8 if column == "label" else ["0"] * 8
    lines = [f"{column},{text[0]}"] + [f"{v},{row}" for v, row in zip(stale, text[1:], strict=True)]
    return csv_file(tmp_path, "\n".join(lines) + "\n")


def n_rows(n: int = 8) -> dict[str, pa.Array]:
    table = frame(n)
    return {
        "pid": pa.array(table["pid"]),
        "age": pa.array(table["age"]),
        "score": pa.array(table["score"]),
        "label": pa.array(table["label"]),
    }


BAD_TABLES = {
    "duplicate label (a stale copy first)": (
        lambda d: duplicated(d, "label"),
        {},
        r"the column\(s\) \['label'\] more than once \('label' at columns 1, 6\)",
    ),
    "duplicate feature": (lambda d: duplicated(d, "age"), {}, r"\['age'\] more than once"),
    "list-typed categorical": (
        lambda d: parquet_file(d, {**n_rows(), "color": pa.array([["rot"]] * 8)}),
        {},
        r"column 'color' is list<.*string> in the Parquet file, a nested type",
    ),
    "struct column": (
        lambda d: parquet_file(d, {**n_rows(), "color": pa.array([{"a": "rot"}] * 8)}),
        {},
        r"column 'color' is struct<a: string>",
    ),
    "map column": (
        lambda d: parquet_file(
            d, {**n_rows(), "color": pa.array([[("a", "rot")]] * 8, pa.map_(pa.string(), pa.string()))}
        ),
        {},
        r"column 'color' is map<string, string",
    ),
    "date as a feature": (
        lambda d: parquet_file(d, {**n_rows(), "color": pa.array([datetime.date(2026, 11, 20)] * 8)}),
        {},
        r"column 'color' is date32.*a feature or label is a number, a boolean or a text",
    ),
    "boolean label against no/yes": (
        lambda d: parquet_file(d, {**n_rows(), "color": pa.array(["rot"] * 8), "label": pa.array([True, False] * 4)}),
        {},
        r"column 'label' is boolean .* declare them .*\[\"True\", \"False\"\]",
    ),
    "semicolon": (
        lambda d: csv_file(d, as_text(frame(8), ";")),
        {},
        r"the file has \['pid;age;score;color;label'\]\. Its header looks semicolon-separated \(5 columns "
        r"with ';'\): set data\.separator: ';'",
    ),
    "tab": (lambda d: csv_file(d, as_text(frame(8), "\t"), "t.tsv"), {}, r"tab-separated .* data\.separator: \"\\t\""),
    "pipe": (lambda d: csv_file(d, as_text(frame(8), "|")), {}, r"pipe-separated .* data\.separator: '\|'"),
    "comma file declared ';'": (
        lambda d: csv_file(d, as_text(frame(8))),
        {"separator": ";"},
        r"comma-separated .* data\.separator: ','",
    ),
    "parquet named csv": (
        lambda d: parquet_file(d, {**n_rows(), "color": pa.array(["rot"] * 8)}).replace("parquet:", "csv:"),
        {},
        r"not a text file \(it holds NUL bytes\).* use data\.source: parquet:",
    ),
    "csv named parquet": (
        lambda d: csv_file(d, as_text(frame(8))).replace("csv:", "parquet:"),
        {},
        r"cannot parse as parquet: .*looks like text \(CSV\?\): use data\.source: csv:",
    ),
    "ragged row": (
        lambda d: csv_file(d, as_text(frame(8)) + "p9,30,0.1,Smith, John,yes\n"),
        {},
        r"Expected 5 fields in line 10, saw 6 \(a row with more fields than the header",
    ),
    "two encodings in one file": (
        lambda d: csv_file(d, as_text(frame(8)).encode("utf-8") + "p9,30,0.1,grün,no\n".encode("cp1252")),
        {},
        r"the file mixes encodings",
    ),
    "declared utf-8, is cp1252": (
        lambda d: csv_file(d, as_text(frame(8)).encode("cp1252")),
        {"encoding": "utf-8"},
        r"not utf-8 text .* data\.encoding \(e\.g\. cp1252",
    ),
    "empty file": (lambda d: csv_file(d, ""), {}, r"the file is empty"),
}


def test_a_parquet_column_named_twice_is_refused(tmp_path: Path) -> None:
    columns = [*n_rows().values(), pa.array(["rot"] * 8), pa.array([1] * 8)]
    path = tmp_path / "dup.parquet"
    pq.write_table(pa.Table.from_arrays(columns, names=["pid", "age", "score", "label", "color", "age"]), path)
    with pytest.raises(DataError, match=r"\['age'\] more than once \('age' at columns 2, 6\)"):
        load_source(config_for(f"parquet:{path}").data)


@pytest.mark.parametrize("case", list(BAD_TABLES))
def test_a_misleading_table_is_refused_naming_the_problem(tmp_path: Path, case: str) -> None:
    make, extra, message = BAD_TABLES[case]
    source = make(tmp_path)
    with pytest.raises(DataError) as refused:
        load_source(config_for(source, **extra).data)
    assert re.search(message, str(refused.value)), str(refused.value)
    assert "\n" not in str(refused.value)


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.mark.parametrize("case", list(BAD_TABLES))
def test_each_refusal_comes_before_the_ledger_reserves_anything(workdir: Path, mlflow_store: str, case: str) -> None:
    """The whole pipeline as ``dpml run --engine local`` runs it: pre-flight, then the stages."""
    make, extra, message = BAD_TABLES[case]
    params = small_params(workdir, data=data_section(make(workdir), **extra), tracking={"uri": mlflow_store})
    with pytest.raises((DataError, PreflightError)) as refused:
        run_all(validate(params), echo=lambda _line: None)
    assert re.search(message, str(refused.value)), str(refused.value)
    assert Ledger(workdir / "ledger.db", 1e-5).spends(counted_only=False) == []
    assert not (workdir / "artifacts" / "train").exists()


def test_preflight_refuses_a_duplicate_named_column_from_the_header_alone(tmp_path: Path) -> None:
    config = config_for(duplicated(tmp_path, "label"))
    with pytest.raises(PreflightError, match=r"\['label'\] more than once"):
        check_table_header(config)
    # a header that another usual separator splits into the declared columns passes pre-flight (which does
    # not know data.separator); the ingest stage, which does, checks it again before any record is read
    config = config_for(csv_file(tmp_path, as_text(frame(8), ";"), "semi.csv"), separator=";")
    check_table_header(config)


def test_the_cli_says_it_in_one_line_and_spends_nothing(workdir: Path, mlflow_store: str) -> None:
    params = small_params(workdir, data=data_section(duplicated(workdir, "label")), tracking={"uri": mlflow_store})
    path = write_params(workdir / "params.yaml", params)
    result = subprocess.run(
        [sys.executable, "-m", "dpml", "run", "--engine", "local", "--params", str(path)],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("dpml: error:")]
    assert result.returncode == 1 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "['label'] more than once" in errors[0]
    assert not (workdir / "ledger.db").exists() or not Ledger(workdir / "ledger.db", 1e-5).spends(counted_only=False)
