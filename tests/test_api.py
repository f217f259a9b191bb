"""``dpml.train_private``, the Python API: the pipeline's DP-SGD over a map-style Dataset.

- the Dataset path is the tensor path: the same seed gives the parameters ``train_dpsgd`` gives, and
  reading in DataLoader workers gives exactly the same parameters as reading in this process;
- physical chunks never exceed ``physical_batch_size`` and add up to each step's Poisson sample;
- bad arguments are refused before any record is read, naming the key and the value;
- a model the clipping engine cannot handle, and a run over budget, spend nothing and read nothing;
- a label outside the model's classes, or an input of another shape than the first record's, anywhere in the data
  set, is refused before the run starts (after the reservation, which it cancels), naming the record and what is
  wrong: no budget is spent on a run that would fail on it;
- the certificate matches dp_accounting's PLD accountant, asked independently, and a target ε is met;
- a charged run is in the ledger per unit; a failed one stays counted with its ``failed`` event;
- an MLflow run (a real SQLite store) holds ε, the certificate and weights that load back;
- the documentation's example (docs/tutorials/python-api.md) runs as printed, in a subprocess.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import dp_accounting
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import dpml
from dpml.ledger.ledger import BudgetExceeded, Ledger
from dpml.train.clipping_check import ClippingUnsupported
from dpml.train.dpsgd import train_dpsgd

ROOT = Path(__file__).resolve().parents[1]


class Blobs(Dataset):  # type: ignore[type-arg]
    """n records of 10 features, 3 classes; counts how many records were read. ``fails_after``: the storage goes
    away after that many reads (an ``OSError``, as a lost network mount gives)."""

    def __init__(self, n: int = 300, bad_label_at: int | None = None, fails_after: int | None = None) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 10, generator=generator)
        self.y = torch.randint(0, 3, (n,), generator=generator)
        if bad_label_at is not None:
            self.y[bad_label_at] = 7
        self.reads = 0
        self.fails_after = fails_after

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        self.reads += 1
        if self.fails_after is not None and self.reads > self.fails_after:
            raise OSError(f"record {i}: the storage went away")
        return self.x[i], int(self.y[i])


def network(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))


def largest_difference(a: nn.Module, b: nn.Module) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def moved(model: nn.Module, seed: int = 0) -> float:
    return largest_difference(model, network(seed))


SETTINGS: dict[str, Any] = dict(
    epochs=2,
    clip_norm=1.0,
    delta=1e-4,
    noise_multiplier=1.0,
    sample_rate=0.1,
    seed=5,
    physical_batch_size=7,
    learning_rate=0.5,
    device="cpu",
)  # the GPU: test_devices.py


def test_dataset_path_trains_exactly_what_the_tensor_path_trains() -> None:
    data = Blobs()
    through_api = network()
    result = dpml.train_private(through_api, data, **SETTINGS)
    reference = network()
    train_dpsgd(
        reference,
        data.x,
        data.y,
        sample_rate=0.1,
        epochs=2,
        clip_norm=1.0,
        noise_multiplier=1.0,
        neighbouring="add-remove",
        optimizer=torch.optim.SGD(reference.parameters(), lr=0.5),
        seed=5,
        physical_batch_size=7,
    )
    assert moved(reference) > 0.05  # the comparison is between trained models
    assert largest_difference(through_api, reference) < 1e-5
    assert result.history["steps"] == 20 and result.history["world_size"] == 1
    with_workers = network()
    dpml.train_private(with_workers, Blobs(), num_workers=2, **SETTINGS)
    assert largest_difference(with_workers, through_api) == 0.0
    other_seed = network()
    dpml.train_private(other_seed, Blobs(), **{**SETTINGS, "seed": 6})
    assert largest_difference(other_seed, through_api) > 0.01  # the seed drives the batches and the noise


def test_workers_need_a_dataset_that_pickles_and_say_so_before_training() -> None:
    data = Blobs()
    data.transform = lambda x: x  # type: ignore[attr-defined]  # a lambda does not pickle
    model = network()
    with pytest.raises(
        ValueError,
        match=r"num_workers = 2: the dataset goes to each process by pickling .*"
        r"read in this process \(num_workers = 0\)",
    ):
        dpml.train_private(model, data, num_workers=2, **SETTINGS)
    assert largest_difference(model, network()) == 0.0


class Indices(Dataset):  # type: ignore[type-arg]
    """Record i is (tensor([i]), i % 3): a chunk's inputs say which records it holds."""

    def __len__(self) -> int:
        return 60

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.tensor([float(i)]), i % 3


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.exhaustive)])
def test_chunks_are_bounded_and_add_up_to_each_poisson_sample(num_workers: int) -> None:
    """Each step reads exactly its sample (empty ones included), in chunks of at most 4 records; the
    two shares of a 2-process run split it without overlap."""
    from dpml.train.dataset_steps import dataset_steps
    from dpml.train.distributed import Collective
    from dpml.train.steps import poisson_batches

    batches = list(poisson_batches(60, 0.03, 20, seed=3)) + list(poisson_batches(60, 0.3, 10, seed=3))
    assert any(b.numel() == 0 for b in batches) and max(b.numel() for b in batches) > 8
    shares: list[list[list[int]]] = []
    for collective in (None, Collective(0, 2), Collective(1, 2)):
        steps = dataset_steps(
            Indices(),
            iter(batches),
            physical_batch_size=4,
            device=torch.device("cpu"),
            dtype=torch.float32,
            n_classes=3,
            collective=collective,
            num_workers=num_workers,
        )
        read = []
        for step, batch in zip(steps, batches, strict=True):
            assert torch.equal(step.batch, batch)
            chunks = list(step.chunks)
            assert all(0 < x.shape[0] <= 4 and x.dtype == torch.float32 for x, _ in chunks)
            assert all(torch.equal(y, x[:, 0].long() % 3) for x, y in chunks)
            read.append([int(v) for x, _ in chunks for v in x[:, 0]])
        shares.append(read)
    whole, first, second = shares
    assert whole == [b.tolist() for b in batches]
    for step, batch in enumerate(batches):
        assert sorted(first[step] + second[step]) == batch.tolist() and not set(first[step]) & set(second[step])


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"epochs": 0}, "epochs = 0: Input should be greater than 0"),
        ({"clip_norm": float("nan")}, "clip_norm = nan"),
        ({"delta": 0.5}, "delta = 0.5: is ≥ 1/n"),
        ({"delta": 1.5}, "delta = 1.5: Input should be less than 1"),
        ({"target_epsilon": 2.0}, "give exactly one of target_epsilon and noise_multiplier"),
        ({"noise_multiplier": -1.0}, "noise_multiplier = -1.0"),
        ({"expected_batch_size": 30}, "give exactly one of sample_rate and expected_batch_size"),
        ({"sample_rate": 1.5}, "sample_rate = 1.5: Input should be less than or equal to 1"),
        (
            {"sample_rate": None, "expected_batch_size": 301},
            "expected_batch_size = 301: must be an integer in [1, n = 300]",
        ),
        ({"optimizer": "lbfgs"}, "optimizer = 'lbfgs'"),
        ({"loss": "hinge"}, "loss = 'hinge'"),
        ({"neighbouring": "swap"}, "neighbouring = 'swap'"),
        ({"physical_batch_size": 0}, "physical_batch_size = 0: Input should be greater than 0"),
        ({"world_size": 0}, "world_size = 0"),
        ({"device": "tpu"}, "device = 'tpu'"),
        ({"ledger": "x.sqlite"}, "epsilon_budget = None: a ledger needs"),
        ({"ledger": "x.sqlite", "epsilon_budget": 3.0}, "lineage = None"),
        (
            {"ledger": "x.sqlite", "epsilon_budget": 3.0, "lineage": "l", "privacy_units": [1, 2]},
            "privacy_units = '2 ids': must give one id per record",
        ),
        (
            {"ledger": "x.sqlite", "epsilon_budget": 3.0, "lineage": "l", "privacy_units": [0] + list(range(299))},
            "privacy_units = 0: appears at records 0 and 1",
        ),
    ],
)
def test_bad_arguments_are_refused_before_any_record_is_read(
    change: dict[str, Any], fragment: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    data, model = Blobs(), network()
    with pytest.raises(ValueError) as raised:
        dpml.train_private(model, data, **{**SETTINGS, **change})
    assert fragment in str(raised.value)
    assert data.reads == 0 and moved(model) == 0.0
    assert not (tmp_path / "x.sqlite").exists()


def test_malformed_records_are_named() -> None:
    class Triples(Blobs):
        def __getitem__(self, i: int) -> Any:
            return self.x[i], int(self.y[i]), 0

    with pytest.raises(
        ValueError, match=r"dataset\[0\]: a record must be a pair \(input, label\), got tuple of length 3"
    ) as raised:
        dpml.train_private(network(), Triples(), **SETTINGS)
    assert "forward names input_ids and attention_mask" in str(raised.value)  # (where a triple is read)

    class FloatLabels(Blobs):
        def __getitem__(self, i: int) -> Any:
            return self.x[i], 0.5

    with pytest.raises(ValueError, match=r"dataset\[0\]: the label must be one integer class, got 0.5"):
        dpml.train_private(network(), FloatLabels(), **SETTINGS)
    with pytest.raises(ValueError, match="map-style torch Dataset with __len__"):
        dpml.train_private(network(), iter([]), **SETTINGS)  # type: ignore[arg-type]


def test_a_model_the_engine_refuses_spends_nothing(tmp_path: Path) -> None:
    ledger_path = tmp_path / "ledger.sqlite"
    batch_norm = nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.Linear(16, 3))
    with pytest.raises(ValueError, match="BatchNorm1d.*nn.GroupNorm"):
        dpml.train_private(batch_norm, Blobs(), ledger=ledger_path, epsilon_budget=5.0, lineage="blobs", **SETTINGS)
    assert not ledger_path.exists() or Ledger(ledger_path, 1e-4).spends() == []

    class MixesTheBatch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(10, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x - x.mean(0, keepdim=True))

    data = Blobs()
    with pytest.raises(ClippingUnsupported, match="the model or its loss mixes the examples of a batch"):
        dpml.train_private(MixesTheBatch(), data, ledger=ledger_path, epsilon_budget=5.0, lineage="blobs", **SETTINGS)
    assert data.reads <= 2
    assert not ledger_path.exists() or Ledger(ledger_path, 1e-4).spends() == []


def test_certificate_matches_an_independent_pld_accountant_and_meets_the_target() -> None:
    q, sigma, steps = 0.1, 1.0, 20
    result = dpml.train_private(network(), Blobs(), **SETTINGS)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    independent = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4).compose(event)
    expected = independent.get_epsilon(1e-4)
    assert result.mechanism.to_dict()["events"][0]["noise_multiplier"] == sigma
    assert result.epsilon == pytest.approx(expected, rel=0.02)
    calibrated = dpml.train_private(network(), Blobs(), **{**SETTINGS, "noise_multiplier": None, "target_epsilon": 2.0})
    assert 1.94 <= calibrated.epsilon <= 2.0


def test_the_ledger_is_charged_per_unit_and_refuses_a_run_over_budget(tmp_path: Path) -> None:
    ledger_path = tmp_path / "ledger.sqlite"
    units = [f"person-{i}" for i in range(300)]
    charged = dict(ledger=ledger_path, epsilon_budget=3.5, lineage="blobs", privacy_units=units)
    first = dpml.train_private(network(), Blobs(), **SETTINGS, **charged)
    ledger = Ledger(ledger_path, 1e-4)
    (spend,) = ledger.spends()
    assert spend.id == first.spend_id and spend.n_units == 300 and spend.lineage == "blobs"
    assert spend.epsilon_alone == pytest.approx(first.epsilon, rel=0.02)
    assert [kind for kind, _ in ledger.events(spend.id)] == ["started", "trained"]
    data, model = Blobs(), network()
    with pytest.raises(BudgetExceeded):
        dpml.train_private(model, data, **SETTINGS, **charged)  # two runs of ε ≈ 2.88 compose to ≈ 3.85 > 3.5
    assert moved(model) == 0.0 and data.reads <= 1  # the first record's shape only; nothing trained
    assert len(ledger.spends()) == 1
    others = dict(charged, privacy_units=[f"other-{i}" for i in range(300)])
    dpml.train_private(network(), Blobs(), **SETTINGS, **others)  # other people: their own budget
    assert len(ledger.spends()) == 2


def test_a_run_that_fails_after_it_started_stays_counted(tmp_path: Path) -> None:
    ledger_path = tmp_path / "ledger.sqlite"
    data = Blobs(fails_after=300 + 1 + 100)  # (the first record, every label once, then 100 records of training)
    with pytest.raises(OSError, match="the storage went away"):
        dpml.train_private(
            network(), data, ledger=ledger_path, epsilon_budget=50.0, lineage="blobs", **{**SETTINGS, "epochs": 5}
        )
    ledger = Ledger(ledger_path, 1e-4)
    (spend,) = ledger.spends()
    kinds = [kind for kind, _ in ledger.events(spend.id)]
    assert kinds[:2] == ["started", "failed"] and "the storage went away" in ledger.events(spend.id)[1][1]["error"]
    assert ledger.total("blobs") > 0


class Tokens(Dataset):  # type: ignore[type-arg]
    """Token records (input_ids, attention_mask, label) read one at a time (not a TensorDataset)."""

    def __init__(self, labels: torch.Tensor) -> None:
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids = torch.arange(1, 7) + i % 5
        return ids, torch.ones(6, dtype=torch.long), self.labels[i]


class TokenClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embedding(input_ids) * attention_mask[..., None]
        return self.head(h.sum(1) / attention_mask.sum(1, keepdim=True))


class OneShorter(Blobs):
    """Record 200's input has 9 features where the others have 10 (a chunk holding it cannot be stacked)."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x, y = super().__getitem__(i)
        return (x[:9] if i == 200 else x), y


def _bad_labels(where: int, value: int, n: int = 300) -> torch.Tensor:
    labels = torch.arange(n) % 3
    labels[where] = value
    return labels


@pytest.mark.parametrize(
    ("records", "model", "expected"),
    [
        (lambda: Blobs(bad_label_at=299), network, r"dataset\[299\]: label 7 is outside the 3 classes \[0, 3\)"),
        (
            lambda: torch.utils.data.TensorDataset(torch.randn(300, 10), _bad_labels(123, -1)),
            network,
            r"dataset\[123\]: label -1 is outside the 3 classes \[0, 3\)",
        ),
        (
            lambda: torch.utils.data.TensorDataset(torch.randn(300, 10), torch.rand(300)),
            network,
            r"dataset\[0\]: the label must be one integer class, got a torch.float32 tensor",
        ),
        (
            lambda: torch.utils.data.TensorDataset(
                torch.randint(1, 20, (300, 6)), torch.ones(300, 6, dtype=torch.long), _bad_labels(250, 3)
            ),
            TokenClassifier,
            r"dataset\[250\]: label 3 is outside the 3 classes \[0, 3\)",
        ),
        (lambda: Tokens(_bad_labels(42, 9)), TokenClassifier, r"dataset\[42\]: label 9 is outside the 3 classes"),
        (
            lambda: OneShorter(),
            network,
            r"dataset\[200\]: an input of shape \[9\], where dataset\[0\]'s is \[10\]; every record's input has one",
        ),
    ],
    ids=["records-last", "tensor-dataset-negative", "tensor-dataset-float", "token-tensors", "token-records", "shape"],
)
def test_a_bad_record_anywhere_is_refused_before_the_run_starts_and_spends_nothing(
    records: Any, model: Any, expected: str, tmp_path: Path
) -> None:
    ledger_path = tmp_path / "ledger.sqlite"
    net = model()
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(ValueError, match=expected):
        dpml.train_private(net, records(), ledger=ledger_path, epsilon_budget=50.0, lineage="l", **SETTINGS)
    ledger = Ledger(ledger_path, 1e-4)  # reserved, then cancelled: nothing counts
    assert ledger.spends() == [] and ledger.total("l") == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))


def test_a_language_model_s_per_token_logits_are_refused_before_the_probe_naming_the_shape() -> None:
    class PerToken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(20, 8)
            self.head = nn.Linear(8, 20)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.head(self.embedding(input_ids))  # (B, T, vocabulary), as a language model's head

    with pytest.raises(ValueError, match=r"model: its output on one record has shape \(1, 6, 20\); a classifier"):
        dpml.train_private(PerToken(), Tokens(torch.arange(300) % 3), **SETTINGS)


def test_mlflow_run_holds_the_certificate_and_weights(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    model = network()
    result = dpml.train_private(
        model,
        Blobs(),
        mlflow_tracking_uri=uri,
        mlflow_experiment="api-test",
        mlflow_artifact_location=str(tmp_path / "artifacts"),
        run_name="notebook",
        **SETTINGS,
    )
    client = MlflowClient(uri)
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "notebook"
    assert (tmp_path / "artifacts").is_dir()  # the artifacts went where they were sent
    assert run.data.metrics["epsilon"] == pytest.approx(result.epsilon)
    assert run.data.params["noise_multiplier"] == "1.0" and run.data.params["sample_rate"] == "0.1"
    certificate = json.loads(
        Path(client.download_artifacts(run.info.run_id, "certificate.json", str(tmp_path))).read_text()
    )
    assert certificate["statement"] == result.certificate["statement"]
    state = torch.load(client.download_artifacts(run.info.run_id, "model_state.pt", str(tmp_path)))
    reloaded = network(seed=3)
    reloaded.load_state_dict(state)
    assert largest_difference(reloaded, model) == 0.0


def documented_example() -> str:
    page = (ROOT / "docs" / "tutorials" / "python-api.md").read_text()
    found = re.search(r"<!-- python-api-example[^>]*-->\n```python\n(.*?)```", page, re.S)
    assert found, "docs/tutorials/python-api.md lost its Python API example"
    return found.group(1)


def test_the_documented_example_runs_as_printed(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", documented_example()], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    statement = done.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"\([\d.]+, 1e-05\)-DP under add-or-remove-one neighbouring, .*", statement), statement
    epsilon = float(statement[1:].split(",")[0])
    assert 2.9 <= epsilon <= 3.0
    ledger = Ledger(tmp_path / "ledger.sqlite", 1e-5)
    (spend,) = ledger.spends()
    assert spend.lineage == "records" and spend.epsilon_alone <= 3.0
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("dpml").experiment_id])
    assert run.data.metrics["epsilon"] == pytest.approx(epsilon, rel=1e-3)
