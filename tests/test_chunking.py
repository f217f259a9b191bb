"""The physical chunk DP-SGD clips in (:mod:`dpml.train.chunking`): measured, never from the data, never a
change to the sums.

- the tuner takes the chunk with the least time per example: a model whose cost per example grows
  with the chunk gets the smallest, one with a fixed cost per pass the largest (declared timings: the
  model advances the tuner's clock in its forward pass, a virtual clock that moves only then, so the
  ranking is the declared one exactly, with no sleep and no dependence on the machine's load);
- it times a copy on synthetic probe inputs only: the model's parameters, buffers, mode and the
  global random state are as before, and no record reaches it;
- training with the tuned chunk gives the same model as one chunk per batch (same seeds), and the
  chunk is recorded in the history (pipeline and library), bounded by ``physical_batch_size``;
- a chunk the model fails on ends the search; with nothing measured the chunk is the bound (as untuned);
- the setting is validated before any work, naming the key.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from dpml.api import train_private
from dpml.train import chunking
from dpml.train.chunking import candidate_chunks, fastest_chunk, physical_chunk
from dpml.train.clipping_check import probe_batch
from dpml.train.dpsgd import per_example_cross_entropy, train_dpsgd


class Clock:
    """The tuner's clock in these tests (``chunking.time``): it moves only when a model's forward pass says
    it took time, so what the tuner measures is exactly what the models declare."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


CLOCK = Clock()


class Sleeper(nn.Module):
    """A dense layer whose forward pass takes ``fixed`` + ``quadratic``·B² seconds of the tuner's clock for a
    batch of B rows (:class:`Clock`: no real sleep), and remembers the inputs it saw and counts its calls
    in a buffer."""

    def __init__(self, fixed: float, quadratic: float) -> None:
        super().__init__()
        self.dense = nn.Linear(4, 3)
        self.fixed, self.quadratic = fixed, quadratic
        self.seen: list[torch.Tensor] = []
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CLOCK.advance(self.fixed + self.quadratic * x.shape[0] ** 2)
        self.seen.append(x.detach().clone())
        self.calls += 1
        return self.dense(x)


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    chunking._CHOICES.clear()
    monkeypatch.setattr(chunking, "time", CLOCK)  # the tuner times passes on the declared clock


def test_candidates_stop_at_the_bound_or_the_expected_batch() -> None:
    assert candidate_chunks(1024, 100) == [16, 32, 64, 100]
    assert candidate_chunks(48, 5000) == [16, 32, 48]
    assert candidate_chunks(7, 5000) == [7]  # nothing to choose: no timing at all
    assert candidate_chunks(1024, 0.3) == [1]
    assert fastest_chunk(Sleeper(0.0, 0.0), per_example_cross_entropy, (4,), torch.float32, 7, 100).timings == ()


def test_a_cost_per_example_that_grows_with_the_chunk_gets_the_smallest_chunk() -> None:
    # per example: 2e-5·B seconds, so 16 rows cost 0.3 ms each and 32 rows 0.6 ms: the search stops there
    choice = fastest_chunk(Sleeper(0.0, 2e-5), per_example_cross_entropy, (4,), torch.float32, 256, 256)
    assert choice.chunk == 16, choice.line()
    assert [size for size, _ in choice.timings] == [16, 32]  # 2× the best per example: no larger chunk is timed


def test_a_fixed_cost_per_pass_gets_the_largest_chunk() -> None:
    choice = fastest_chunk(Sleeper(0.01, 0.0), per_example_cross_entropy, (4,), torch.float32, 100, 1000)
    assert choice.chunk == 100, choice.line()
    assert [size for size, _ in choice.timings] == [16, 32, 64, 100]
    seconds = dict(choice.timings)
    assert seconds[16] == pytest.approx(100 / 16 * seconds[100], rel=1e-9)  # 10 ms (per forward) over 16 rows vs 100


class Picky(Sleeper):
    """Refuses batches of more than ``limit`` rows (a model with a fixed-size buffer, say)."""

    def __init__(self, limit: int) -> None:
        super().__init__(0.005, 0.0)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.limit:
            raise ValueError(f"at most {self.limit} rows")
        return super().forward(x)


def test_a_chunk_the_model_fails_on_ends_the_search_and_never_fails_the_run() -> None:
    choice = fastest_chunk(Picky(40), per_example_cross_entropy, (4,), torch.float32, 128, 128)
    assert choice.chunk == 32 and [size for size, _ in choice.timings] == [16, 32]
    assert fastest_chunk(Picky(3), per_example_cross_entropy, (4,), torch.float32, 128, 128).chunk == 128  # as untuned


def test_the_tuner_times_a_copy_on_probe_inputs_and_leaves_everything_as_it_was() -> None:
    model = Sleeper(0.0, 0.0).eval()
    before = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    choice = fastest_chunk(model, per_example_cross_entropy, (4,), torch.float32, 64, 64)
    assert choice.timings  # it did time something
    assert model.seen == [] and int(model.calls) == 0 and not model.training  # the model itself never ran
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    # what the copy saw was the public probe batch, whatever the records are
    twin = Sleeper(0.0, 0.0)
    chunking._CHOICES.clear()
    original = copy.deepcopy

    def keep_twin(obj, memo=None):  # noqa: ANN001, ANN202 — record the copy the tuner makes
        nonlocal twin
        twin = original(obj, memo)
        return twin

    copy.deepcopy = keep_twin  # type: ignore[assignment]
    try:
        fastest_chunk(model, per_example_cross_entropy, (4,), torch.float32, 64, 64)
    finally:
        copy.deepcopy = original  # type: ignore[assignment]
    assert twin.seen and all(
        torch.equal(seen, probe_batch(model, (4,), torch.float32, len(seen))[: len(seen)].float()) for seen in twin.seen
    )


def test_the_choice_is_made_once_per_architecture_and_setting() -> None:
    model = Sleeper(0.002, 0.0)
    first = fastest_chunk(model, per_example_cross_entropy, (4,), torch.float32, 64, 64)
    twin = copy.deepcopy(model)
    assert fastest_chunk(twin, per_example_cross_entropy, (4,), torch.float32, 64, 64) is first  # from the cache
    assert fastest_chunk(twin, per_example_cross_entropy, (4,), torch.float32, 32, 64) is not first  # another bound
    assert physical_chunk(False, model, per_example_cross_entropy, (4,), torch.float32, 64, 64) == 64


def data(n: int = 300) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(n, 4, generator=generator, dtype=torch.float64)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def test_training_in_the_tuned_chunk_gives_the_model_of_one_chunk_per_batch() -> None:
    x, y = data()
    models = {}
    for tune in (True, False):
        torch.manual_seed(0)
        model = Sleeper(0.0, 5e-5).double()  # small chunks are the fastest here
        result = train_dpsgd(
            model,
            x,
            y,
            sample_rate=0.4,
            epochs=0.8,
            clip_norm=0.7,
            noise_multiplier=1.1,
            neighbouring="add-remove",
            optimizer=torch.optim.SGD(model.parameters(), lr=0.2),
            seed=5,
            physical_batch_size=1000,
            tune_physical_batch=tune,
        )
        models[tune] = model
        assert result.history["physical_chunk"] == (16 if tune else 1000)
        batch_sizes = {seen.shape[0] for seen in model.seen}
        assert max(batch_sizes) <= result.history["physical_chunk"]
    for (name, a), b in zip(models[True].named_parameters(), models[False].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=name)


def test_the_library_records_its_chunk_and_checks_the_setting() -> None:
    x, y = data(200)
    torch.manual_seed(0)
    model = Sleeper(0.0, 5e-5)
    result = train_private(
        model,
        TensorDataset(x.float(), y),
        epochs=0.5,
        clip_norm=1.0,
        delta=1e-5,
        noise_multiplier=1.0,
        sample_rate=0.5,
        physical_batch_size=64,
        seed=1,
        device="cpu",
    )
    assert result.history["physical_chunk"] == 16
    torch.manual_seed(0)
    fixed = train_private(
        Sleeper(0.0, 0.0),
        TensorDataset(x.float(), y),
        epochs=0.5,
        clip_norm=1.0,
        delta=1e-5,
        noise_multiplier=1.0,
        sample_rate=0.5,
        physical_batch_size=64,
        seed=1,
        device="cpu",
        tune_physical_batch=False,
    )
    assert fixed.history["physical_chunk"] == 64
    with pytest.raises(ValueError, match="tune_physical_batch = 'yes': Input should be a valid boolean"):
        train_private(
            Sleeper(0.0, 0.0),
            TensorDataset(x.float(), y),
            epochs=0.5,
            clip_norm=1.0,
            delta=1e-5,
            noise_multiplier=1.0,
            sample_rate=0.5,
            tune_physical_batch="yes",
        )  # type: ignore[arg-type]


class Hungry(Sleeper):
    """A model whose pass over more than ``limit`` rows raises ``torch.OutOfMemoryError``, as PyTorch's caching
    allocator does on a GPU when a chunk does not fit (here on the CPU, where torch never raises it itself)."""

    def __init__(self, limit: int) -> None:
        super().__init__(0.005, 0.0)  # a fixed cost per pass: larger chunks are faster per example
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"{x.shape[0]} rows: the device holds {self.limit}")
        return super().forward(x)


def test_a_chunk_that_runs_out_of_memory_ends_the_search_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="dpml.chunking"):
        choice = fastest_chunk(Hungry(40), per_example_cross_entropy, (4,), torch.float32, 128, 128)
    assert (choice.chunk, choice.ran_out) == (32, 64) and [size for size, _ in choice.timings] == [16, 32]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "physical_batch_size 128: a chunk of 64 rows ran out of cpu's memory" in warnings[0]
    assert "clipping in chunks of 32" in warnings[0]
    caplog.clear()
    with caplog.at_level("INFO", logger="dpml.chunking"):  # a chunk the model fails on for another reason: no warning
        fastest_chunk(Picky(40), per_example_cross_entropy, (4,), torch.float32, 128, 128)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_where_the_smallest_timed_chunk_runs_out_of_memory_the_largest_smaller_one_that_fits_is_taken() -> None:
    choice = fastest_chunk(Hungry(5), per_example_cross_entropy, (4,), torch.float32, 128, 128)
    assert (choice.chunk, choice.ran_out, choice.timings) == (4, 8, ())  # 16, then 8 ran out; 4 fits
    with pytest.raises(torch.OutOfMemoryError, match=r"one record's clipping pass does not fit in cpu's memory"):
        fastest_chunk(Hungry(0), per_example_cross_entropy, (4,), torch.float32, 128, 128)


def test_an_untuned_chunk_is_the_bound_halved_until_it_fits_on_a_device_that_says_it_ran_out() -> None:
    assert chunking._untuned(Hungry(40), per_example_cross_entropy, (4,), torch.float32, 100, (), None) == (
        chunking.ChunkChoice(25, (), 50)  # 100 and 50 ran out
    )
    assert chunking._untuned(Hungry(400), per_example_cross_entropy, (4,), torch.float32, 100, (), None).chunk == 100
    # on the CPU (whose failed allocations torch does not raise as OutOfMemoryError) no pass is run: the bound stands
    model = Hungry(40)
    assert physical_chunk(False, model, per_example_cross_entropy, (4,), torch.float32, 100, 100) == 100
    assert model.seen == []


def test_training_whose_bound_runs_out_of_memory_trains_in_chunks_that_fit(caplog: pytest.LogCaptureFixture) -> None:
    x, y = data(200)
    torch.manual_seed(0)
    with caplog.at_level("WARNING", logger="dpml.chunking"):
        result = train_private(
            Hungry(20),
            TensorDataset(x.float(), y),
            epochs=0.5,
            clip_norm=1.0,
            delta=1e-5,
            noise_multiplier=1.0,
            sample_rate=0.5,
            physical_batch_size=128,
            seed=1,
            device="cpu",
        )
    assert result.history["physical_chunk"] == 16 and result.history["steps"] == 1
    assert any("physical_batch_size 128: a chunk of 32 rows ran out" in r.getMessage() for r in caplog.records)
