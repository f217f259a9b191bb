"""Data sources are an extension point shaped like the trainer (docs/explanations/design.md): one file registers a
scheme for ``data.source``; the configuration checks it before any work and dpml checks the records it returns.

- the example source of the documentation's Design page (``examples/npz_source.py``) is shown there verbatim;
- ``npz:PATH`` validates only once its module is listed under ``plugins:``; a missing file is refused then,
  naming ``data.source``; a built-in scheme cannot be taken;
- what it returns is checked as dpml's own sources are (a NaN feature, a label outside the classes);
- (exhaustive) a whole pipeline run trains and registers a model from it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import run_pipeline_with_plugin

from dpml import io
from dpml.config import ConfigError, load, validate
from dpml.data.records import DataError
from dpml.data.source_kinds import SOURCES, SourceKind, register_source
from dpml.data.sources import load_source
from dpml.stages import Layout

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "npz_source.py"


def params() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


def write_records(path: Path, n: int = 300, nan: bool = False, label: int = 0) -> Path:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, n)
    x = rng.normal(size=(n, 4, 2)) + y[:, None, None]
    if nan:
        x[7, 1, 0] = np.nan
    y[3] = y[3] if label == 0 else label
    np.savez(path, x=x, y=y, classes=np.array(["low", "mid", "high"]))
    return path


def test_the_design_page_shows_the_example_source_verbatim() -> None:
    assert EXAMPLE.read_text().strip() in (ROOT / "docs" / "explanations" / "design.md").read_text()


def test_a_source_validates_once_its_plugin_registered_it(tmp_path: Path) -> None:
    records = write_records(tmp_path / "records.npz")
    wanted = {**params(), "data": {"source": f"npz:{records}"}}
    if "npz" not in SOURCES:  # (another test of this process may have imported the plugin already)
        with pytest.raises(
            ConfigError,
            match=r"data.source = 'npz:.*': must look like one of sklearn:…, idx:…, "
            r"csv:…, parquet:….*register it in a module listed under plugins",
        ):
            validate(wanted)
    config = validate({**wanted, "plugins": [str(EXAMPLE)]})
    with pytest.raises(ConfigError, match=r"data.source = 'npz:.*absent.npz': file .*absent.npz does not exist"):
        validate({**wanted, "plugins": [str(EXAMPLE)], "data": {"source": f"npz:{tmp_path / 'absent.npz'}"}})
    raw = load_source(config.data, config.preprocess)
    assert raw.x.shape == (300, 8) and raw.classes == ["low", "mid", "high"] and raw.origin == f"npz:{records}"
    with pytest.raises(ValueError, match="built-in schemes"):
        register_source(SourceKind("csv", lambda rest: None))  # type: ignore[arg-type, return-value]
    with pytest.raises(ValueError, match="a source of scheme 'npz' is already registered"):
        register_source(SourceKind("npz", lambda rest: None))  # type: ignore[arg-type, return-value]


@pytest.mark.parametrize(
    ("nan", "label", "message"),
    [
        (True, 0, r"row 7, column 2: value nan is not finite"),
        (False, 5, r"row 3: label index 5 is not one of the 3 classes"),
    ],
)
def test_what_a_registered_source_returns_is_checked_as_dpml_checks_its_own(
    tmp_path: Path, nan: bool, label: int, message: str
) -> None:
    records = write_records(tmp_path / "records.npz", nan=nan, label=label)
    config = validate({**params(), "plugins": [str(EXAMPLE)], "data": {"source": f"npz:{records}"}})
    with pytest.raises(DataError, match=message):
        load_source(config.data, config.preprocess)


@pytest.mark.exhaustive  # CI runs it after the default suite, which stays near 20 min on 2 cores
def test_a_pipeline_trains_and_registers_a_model_from_the_example_source(tmp_path: Path) -> None:
    records = write_records(tmp_path / "records.npz", n=600)
    done = run_pipeline_with_plugin(tmp_path, EXAMPLE, data={"source": f"npz:{records}"})
    assert done.returncode == 0, done.stderr[-3000:]
    layout = Layout(load(tmp_path / "params.yaml"))
    meta = io.read_json(layout.raw_meta)
    assert meta["origin"] == f"npz:{records}" and meta["n_records"] == 600 and meta["classes"] == ["low", "mid", "high"]
    assert io.read_json(layout.release)["model_uri"].startswith("models:/")
