import gzip
import struct
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dpml.config import DataConfig, PreprocessConfig, SplitConfig
from dpml.data.preprocess import clip_input_norms, preprocess, scale_features
from dpml.data.sources import DataError, RawData, content_hash, load_idx, load_sklearn, load_source, read_idx
from dpml.data.split import split_indices
from dpml.data.units import digests_of_ids, digests_of_rows


def write_idx(path: Path, array: np.ndarray, gz: bool = True) -> Path:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + b"".join(struct.pack(">I", s) for s in array.shape)
    blob = header + array.astype(np.uint8).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(blob))
    else:
        path.write_bytes(blob)
    return path


def make_idx_dir(root: Path, n: int = 60, n_test: int = 20) -> Path:
    rng = np.random.default_rng(0)
    write_idx(root / "train-images-idx3-ubyte", rng.integers(0, 256, (n, 4, 4)))
    write_idx(root / "train-labels-idx1-ubyte", np.arange(n) % 10)
    write_idx(root / "t10k-images-idx3-ubyte", rng.integers(0, 256, (n_test, 4, 4)), gz=False)
    write_idx(root / "t10k-labels-idx1-ubyte", np.arange(n_test) % 10, gz=False)
    return root


def test_sklearn_digits() -> None:
    raw = load_sklearn("digits")
    assert raw.x.shape == (1797, 64) and raw.classes == [str(i) for i in range(10)]
    assert raw.x.max() == 16 and raw.x.min() == 0


def test_idx_round_trip(tmp_path: Path) -> None:
    raw = load_idx(make_idx_dir(tmp_path))
    assert raw.x.shape == (60, 16) and raw.x_test is not None and raw.x_test.shape == (20, 16)
    assert raw.y[:12].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]


def test_idx_wrong_magic_names_file(tmp_path: Path) -> None:
    make_idx_dir(tmp_path)
    target = tmp_path / "train-labels-idx1-ubyte.gz"
    target.write_bytes(gzip.compress(b"\x12\x34\x08\x01" + b"\x00" * 8))
    with pytest.raises(DataError, match=r"train-labels-idx1-ubyte.gz: wrong magic number 12340801"):
        load_idx(tmp_path)


def test_idx_truncated_content(tmp_path: Path) -> None:
    path = write_idx(tmp_path / "x-idx3-ubyte", np.zeros((5, 2, 2)), gz=False)
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(DataError, match=r"truncated or oversized content: header says shape \(5, 2, 2\)"):
        read_idx(path)


def test_idx_label_count_mismatch(tmp_path: Path) -> None:
    make_idx_dir(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.arange(59) % 10)
    with pytest.raises(DataError, match="labels do not match 60 images"):
        load_idx(tmp_path)


def test_idx_missing_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no train-images-idx3-ubyte"):
        load_idx(tmp_path)


def table(tmp_path: Path, frame: pd.DataFrame, kind: str = "csv") -> DataConfig:
    path = tmp_path / f"t.{kind}"
    if kind == "csv":
        frame.to_csv(path, index=False)
    else:
        frame.to_parquet(path)
    return DataConfig(source=f"{kind}:{path}", label_column="label", feature_columns=["a", "b"], classes=["no", "yes"])


@pytest.mark.parametrize("kind", ["csv", "parquet"])
def test_tabular_sources(tmp_path: Path, kind: str) -> None:
    frame = pd.DataFrame(
        {"a": [1.0, 2, 3, 4], "b": [0.5, 0, 1, 2], "label": ["no", "yes", "yes", "no"], "id": range(4)}
    )
    raw = load_source(table(tmp_path, frame, kind))
    assert raw.x.tolist() == [[1, 0.5], [2, 0], [3, 1], [4, 2]]
    assert raw.y.tolist() == [0, 1, 1, 0]


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (pd.DataFrame({"a": [1.0, np.nan], "b": [1, 2], "label": ["no", "yes"]}), r"row 1, column 'a': missing value"),
        (
            pd.DataFrame({"a": [1.0, np.inf], "b": [1, 2], "label": ["no", "yes"]}),
            r"row 1, column 'a': value inf is not finite",
        ),
        (
            pd.DataFrame({"a": [1.0, 2], "b": [1, "x"], "label": ["no", "yes"]}),
            r"row 1, column 'b': 'x' is not a number",
        ),
        (
            pd.DataFrame({"a": [1.0, 2], "b": [1, 2], "label": ["no", "maybe"]}),
            r"row 1, column 'label': label 'maybe' is not in data.classes",
        ),
        (pd.DataFrame({"a": [1.0, 2], "b": [1, 2], "label": ["no", "no"]}), r"only one class present"),
        (pd.DataFrame({"a": [1.0], "b": [1], "lbl": ["no"]}), r"column\(s\) \['label'\] not found"),
        (pd.DataFrame({"a": [], "b": [], "label": []}), r"no records"),
    ],
)
def test_malformed_tables_name_row_column_and_reason(tmp_path: Path, frame: pd.DataFrame, message: str) -> None:
    with pytest.raises(DataError, match=message):
        load_source(table(tmp_path, frame))


def test_empty_csv_file(tmp_path: Path) -> None:
    config = table(tmp_path, pd.DataFrame({"a": [1.0], "b": [1], "label": ["no"]}))
    Path(config.source.split(":", 1)[1]).write_text("")
    with pytest.raises(DataError, match="the file is empty"):
        load_source(config)


def _units(raw: RawData) -> np.ndarray:
    return digests_of_rows(raw.x, raw.y)


def test_split_is_deterministic_disjoint_and_covers_every_class() -> None:
    raw = load_sklearn("digits")
    units = _units(raw)
    config = SplitConfig(seed=3, test_fraction=0.2, audit_fraction=0.25)
    first, second = split_indices(raw, units, config), split_indices(raw, units, config)
    assert all(np.array_equal(getattr(first, p), getattr(second, p)) for p in ("train", "test", "audit"))
    parts = [set(first.train), set(first.test), set(first.audit)]
    assert not (parts[0] & parts[1] or parts[0] & parts[2] or parts[1] & parts[2])
    n_units = np.unique(units.view("V16")).size
    assert sum(map(len, parts)) == n_units == raw.x.shape[0] - first.rows_dropped
    assert abs(len(first.audit) / n_units - 0.25) < 0.035  # each unit's own draw: binomial, 3.5 sd
    for part in (first.train, first.test, first.audit):
        assert set(raw.y[part]) == set(range(10))
    other = split_indices(raw, units, SplitConfig(seed=4, test_fraction=0.2, audit_fraction=0.25))
    assert not np.array_equal(first.train, other.train)


def test_split_is_stable_as_the_table_grows_and_neighbours_differ_in_one_unit() -> None:
    raw = load_sklearn("digits")
    units = _units(raw)
    config = SplitConfig(seed=1, test_fraction=0.2, audit_fraction=0.2)
    n = 1500
    small = RawData(raw.x[:n], raw.y[:n], raw.classes, raw.feature_names, raw.origin)
    before, after = split_indices(small, units[:n], config), split_indices(raw, units, config)
    for part in ("train", "test", "audit"):  # every unit of the smaller table stays in its part
        old, new = getattr(before, part), getattr(after, part)
        assert set(old.tolist()) <= set(new.tolist())
    without = np.delete(np.arange(raw.x.shape[0]), after.train[7])  # one unit fewer
    neighbour = split_indices(
        RawData(raw.x[without], raw.y[without], raw.classes, raw.feature_names, raw.origin), units[without], config
    )
    assert set(without[neighbour.train].tolist()) == set(after.train.tolist()) - {int(after.train[7])}


def test_rows_sharing_a_unit_keep_one() -> None:
    raw = load_sklearn("iris")
    ids = [i // 3 for i in range(raw.x.shape[0])]  # 50 people with three rows each
    parts = split_indices(raw, digests_of_ids(ids), SplitConfig(seed=0, test_fraction=0.2, audit_fraction=0.2))
    rows = np.concatenate([parts.train, parts.test, parts.audit])
    assert parts.rows_dropped == 100 and sorted(ids[r] for r in rows) == list(range(50))


def test_split_keeps_predefined_test(tmp_path: Path) -> None:
    raw = load_idx(make_idx_dir(tmp_path, n=100))
    parts = split_indices(raw, _units(raw), SplitConfig(audit_fraction=0.2, max_train=50))
    assert parts.test_is_predefined and parts.test.tolist() == list(range(20))
    assert len(parts.train) == 50 and not set(parts.train) & set(parts.audit) and len(parts.audit) > 0


def test_content_hash_changes_with_data() -> None:
    x = np.arange(6.0).reshape(3, 2)
    assert content_hash(x) == content_hash(x.copy())
    y = x.copy()
    y[0, 0] = 0.5
    assert content_hash(x) != content_hash(y)


def test_scaling_uses_public_bounds_only() -> None:
    config = PreprocessConfig(lower=0, upper=10, clip_norm=100)
    x = np.array([[-5.0, 5.0, 20.0]])
    assert scale_features(x, config.lower, config.upper).tolist() == [[0.0, 0.5, 1.0]]
    # The transformation of a record does not depend on the other records.
    both = np.array([[-5.0, 5.0, 20.0], [1.0, 2.0, 3.0]])
    assert np.array_equal(preprocess(both, config).x[:1], preprocess(x, config).x)


def test_input_norm_clipping_project_and_sphere() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(500, 7)) * rng.uniform(0.1, 5, size=(500, 1))
    norms = np.linalg.norm(x, axis=1)
    projected = clip_input_norms(x, 2.0, "project")
    out = np.linalg.norm(projected.x, axis=1)
    assert np.all(out <= 2.0)
    assert np.allclose(out[norms <= 2.0], norms[norms <= 2.0])
    assert np.allclose(out[norms > 2.0], 2.0)
    assert projected.clipped_fraction == pytest.approx(float(np.mean(norms > 2.0)))
    inside = norms > 2.0  # directions are kept
    cos = np.sum(projected.x[inside] * x[inside], 1) / (out[inside] * norms[inside])
    assert np.allclose(cos, 1.0)
    sphere = clip_input_norms(x, 2.0, "sphere")
    assert np.allclose(np.linalg.norm(sphere.x, axis=1), 2.0) and np.all(np.linalg.norm(sphere.x, axis=1) <= 2.0)


def test_scatternet_features_are_a_per_record_function() -> None:
    """ScatterNet + per-example GroupNorm: each record's features depend on that record alone."""
    from dpml.config import PreprocessConfig
    from dpml.data.features import scatter_features
    from dpml.data.preprocess import preprocess

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(5, 28 * 28)).astype(np.float64)
    config = PreprocessConfig(lower=0, upper=255, clip_norm=64.0, features="scatternet", image_shape=[28, 28])
    together = preprocess(images, config).x
    assert together.shape == (5, 81 * 7 * 7) and together.dtype == np.float32
    alone = np.concatenate([preprocess(images[i : i + 1], config).x for i in range(5)])
    np.testing.assert_allclose(together, alone, rtol=1e-5, atol=1e-5)
    # Every group of 147 features has mean 0 and variance ≤ 1 (= v/(v + 1e-5)) for every record,
    # so ‖x‖ ≤ √3969 = 63 < X0.
    groups = together.reshape(5, 27, -1)
    np.testing.assert_allclose(groups.mean(2), 0, atol=1e-4)
    assert groups.var(2).max() <= 1 + 1e-5 and np.linalg.norm(together, axis=1).max() <= 63 + 1e-3
    assert preprocess(images, config).clipped_fraction == 0.0
    with pytest.raises(ValueError, match="image_shape"):
        scatter_features(images[:, :700] / 255, (28, 28), 27)
    with pytest.raises(ValueError, match="image_shape"):
        PreprocessConfig(features="scatternet")
