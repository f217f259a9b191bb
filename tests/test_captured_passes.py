"""Clipped sums replayed from CUDA graphs (dpml/train/captured.py).

On the CPU: a chunk padded to its bucket (its first row repeated, the padding's clip factors masked to 0) gives the
chunk's own clipped sum and norms, against a float64 per-example loop, for an MLP, a GroupNorm convolution and a
transformer encoder on padded tokens. On a GPU (skipped without one): chunks of each size met replay from their
bucket's graph, captured when first met, and give the eager engine's sums; a model that draws random numbers, or
whose pass reads a value on the host, runs eagerly; a replaced parameter is captured anew.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from dpml.train import captured
from dpml.train.capture_checks import HostTensorsOnTheDevice, synchronising_calls
from dpml.train.captured import (
    bucket,
    capture_report,
    buckets_up_to,
    clipped_chunk_sum,
    eager_passes,
    fill,
    graph_memory,
    largest_bucket,
    masked_clipped_sum,
)
from dpml.train.clipping import clipped_gradient_sum
from dpml.train.dpsgd import clipped_sum_and_noise, per_example_cross_entropy

CLIP = 0.5

# TF32 off (no effect on a CPU): a replay padded to its bucket and an eager pass of the chunk's own rows are different
# shapes, for which cuDNN may pick different TF32 algorithms (1e-3 apart); in float32 they agree to 1e-4. (On an H200
# the conv model's one-row chunk failed the comparison in a process where no earlier test had turned TF32 off.)
pytestmark = pytest.mark.usefixtures("float32_on_the_gpu")


class TokenEncoder(nn.Module):
    """Token ids (0 = padding) → embeddings with positions → one encoder layer masking the padding → mean → classes."""

    def __init__(self, vocabulary: int = 20, width: int = 16, length: int = 6) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocabulary, width), nn.Embedding(length, width)
        self.block = nn.TransformerEncoderLayer(width, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(width, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        hidden = self.block(self.tokens(ids) + self.positions(positions), src_key_padding_mask=ids == 0)
        return self.head(hidden.mean(dim=1))


def model_and_rows(kind: str, rows: int, device: str = "cpu") -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(3)
    if kind == "mlp":
        model: nn.Module = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))
        x = torch.randn(rows, 10)
    elif kind == "conv":
        model = nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 5 * 5, 3)
        )
        x = torch.randn(rows, 2, 5, 5)
    else:
        model = TokenEncoder()
        x = torch.randint(1, 20, (rows, 6))
        x[::2, 4:] = 0  # every other record padded after its fourth token
    dtype = torch.float64 if device == "cpu" else torch.float32
    return (
        model.to(device, dtype),
        x.to(device, dtype if x.is_floating_point() else x.dtype),
        torch.randint(0, 3, (rows,), device=device),
    )


def per_example_loop(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Σ_i clip_C(∇ℓ_i) and ‖∇ℓ_i‖, one backward pass per record."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    sums = {n: torch.zeros_like(p) for n, p in params.items()}
    norms = []
    for i in range(x.shape[0]):
        loss = per_example_cross_entropy(model(x[i : i + 1]), y[i : i + 1]).sum()
        grads = torch.autograd.grad(loss, list(params.values()))
        norm = torch.sqrt(sum((g**2).sum() for g in grads))
        for n, g in zip(params, grads, strict=True):
            sums[n] += g * min(1.0, CLIP / (float(norm) + 1e-6))
        norms.append(norm)
    return sums, torch.stack(norms)


@pytest.mark.parametrize("kind", ["mlp", "conv", "tokens"])
@pytest.mark.parametrize("rows", [1, 5, 8, 13, 17, 37])
def test_a_chunk_padded_to_its_bucket_gives_its_own_clipped_sum_and_norms(kind: str, rows: int) -> None:
    """As a replay runs it: the chunk copied into the first rows of the largest bucket's buffers (shared by every
    bucket's graph), its first row repeated up to its bucket, the pass on those views, the padding's factors × 0."""
    model, x, y = model_and_rows(kind, rows)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    size, largest = bucket(rows), largest_bucket(2 * rows)
    buffer_x, buffer_y = x.new_full((largest, *x.shape[1:]), 7), y.new_full((largest,), 2)
    mask = torch.full((largest,), 0.5, dtype=torch.float64)
    fill(buffer_x[:size], buffer_y[:size], mask[:size], x, y)
    assert torch.equal(buffer_x[rows:size], x[:1].expand(size - rows, *x.shape[1:]))
    assert mask[:size].tolist() == [1.0] * rows + [0.0] * (size - rows)
    sums, norms = masked_clipped_sum(
        model, per_example_cross_entropy, buffer_x[:size], buffer_y[:size], mask[:size], CLIP, (), names
    )
    want_sums, want_norms = per_example_loop(model, x, y)
    torch.testing.assert_close(norms[:rows], want_norms, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(norms[rows:], want_norms[:1].expand(size - rows), rtol=1e-9, atol=1e-12)
    for name, total in zip(names, sums, strict=True):
        torch.testing.assert_close(total, want_sums[name], rtol=1e-9, atol=1e-12, msg=name)


def test_the_bucket_of_a_chunk_has_four_significant_bits_and_at_least_eight_rows() -> None:
    """Padding under an eighth of the rows: the smallest m·2^e ≥ rows with 8 ≤ m ≤ 15."""
    got = [bucket(r) for r in (1, 7, 8, 9, 16, 17, 19, 33, 300, 512, 513, 577, 4097)]
    assert got == [8, 8, 8, 9, 16, 18, 20, 36, 320, 512, 576, 640, 4608]
    for rows in range(9, 3000):
        assert rows <= bucket(rows) < rows * 9 / 8, rows
    assert [largest_bucket(r) for r in (1, 26, 64, 400, 512)] == [8, 32, 80, 512, 640]
    octaves = [list(range(8, 17)), list(range(18, 33, 2)), list(range(36, 65, 4)), [72, 80]]
    assert buckets_up_to(80) == [rows for octave in octaves for rows in octave]
    assert len(buckets_up_to(640)) == 51 and buckets_up_to(8) == [8]


def test_no_graph_is_larger_than_the_physical_batch_size() -> None:
    """A quarter more rows than the first chunk's, but never more than a chunk can have: a fixed batch of 512 in chunks
    of 512 captured graphs up to 640 rows, memory for rows that never come."""
    assert [largest_bucket(512, most) for most in (None, 512, 576, 10_000)] == [640, 512, 576, 640]
    assert largest_bucket(400, 512) == 512 and largest_bucket(64, 70) == 72  # (its bucket: 70 rows replay in 72)
    assert largest_bucket(512, 100) == 512  # a first chunk larger than the bound (never given): its own rows


def test_on_the_cpu_a_chunk_runs_eagerly_and_nothing_is_captured() -> None:
    model, x, y = model_and_rows("mlp", 6)
    sums, norms = clipped_chunk_sum(model, per_example_cross_entropy, x, y, CLIP)
    want_sums, want_norms = clipped_gradient_sum(model, per_example_cross_entropy, x, y, CLIP)
    assert model not in captured._CAPTURES
    assert capture_report(model) is None, "no chunk of it has been on a GPU"
    torch.testing.assert_close(norms, want_norms, rtol=0, atol=0)
    for name in want_sums:
        torch.testing.assert_close(sums[name], want_sums[name], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["mlp", "conv"])
def test_a_padded_pass_neither_reads_the_batchs_device_nor_copies_host_memory_to_it(kind: str) -> None:
    """What a CUDA graph cannot hold, on the meta device (no values: any read raises): the masked pass of an MLP and of
    a GroupNorm convolution reads no value of the batch's device and copies no host tensor there (a copy from
    pageable memory is refused in a capture). (A pass that does either runs eagerly on a GPU.)"""
    model, x, y = model_and_rows(kind, 8)
    model.to("meta")
    x, y, mask = x.to("meta"), y.to("meta"), torch.ones(8, dtype=torch.float64, device="meta")
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    with HostTensorsOnTheDevice() as crossings:
        sums, norms = masked_clipped_sum(model, per_example_cross_entropy, x, y, mask, CLIP, (), names)
    assert crossings.operations == []
    assert norms.shape == (8,) and [s.shape for s in sums] == [p.shape for p in model.parameters()]


class TakesHostTensors(nn.Module):
    """Host tensors reach the batch's device three ways: a copy, an index, and a scale (a 0-dimensional tensor, taken by
    value: not counted)."""

    def __init__(self, way: str) -> None:
        super().__init__()
        self.way, self.layer = way, nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.way == "copy":
            x = x * torch.linspace(0.5, 1.5, 10).to(x.device, x.dtype)
        elif self.way == "index":
            x = x[:, torch.tensor([0, 2, 4, 6, 8, 1, 3, 5, 7, 9])]
        else:
            x = x * torch.tensor(2.0, dtype=x.dtype)
        return self.layer(x)


@pytest.mark.parametrize(("way", "counted"), [("copy", True), ("index", True), ("scalar", False)])
def test_a_host_tensor_taken_to_the_batchs_device_in_the_pass_is_seen(way: str, counted: bool) -> None:
    """What keeps such a pass out of a CUDA graph (its replays would read the host memory again, by then reused)."""
    model = TakesHostTensors(way).to("meta", torch.float64)
    x, y = torch.empty(8, 10, dtype=torch.float64, device="meta"), torch.zeros(8, dtype=torch.int64, device="meta")
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    mask = torch.ones(8, dtype=torch.float64, device="meta")
    with HostTensorsOnTheDevice() as crossings:
        masked_clipped_sum(model, per_example_cross_entropy, x, y, mask, CLIP, (), names)
    assert bool(crossings.operations) == counted, crossings.operations


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@torch.library.custom_op("dpml_test::scaled_with_host_seed", mutates_args=())
def scaled_with_host_seed(x: torch.Tensor, seed_shape: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """2x and a host tensor of ``seed_shape``, as efficient attention returns its random seed (0-dimensional)."""
    return x * 2, torch.zeros(seed_shape, dtype=torch.long)


@scaled_with_host_seed.register_fake
def _(x: torch.Tensor, seed_shape: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty(seed_shape, dtype=torch.long, device="cpu")


@pytest.mark.parametrize(("seed_shape", "counted"), [([], False), ([2], True)])
def test_a_scalar_made_on_the_host_beside_the_devices_outputs_is_not_a_crossing(
    seed_shape: list[int], counted: bool
) -> None:
    """PyTorch's memory-efficient attention returns its random seed and offset as 0-dimensional host tensors: counted,
    they sent every model using it (timm's ViT on an H200) to the eager pass. A host tensor of values is counted."""
    x = torch.empty(4, 3, device="meta")
    with HostTensorsOnTheDevice() as crossings:
        scaled, seed = scaled_with_host_seed(x, seed_shape)
    assert scaled.device.type == "meta" and seed.device.type == "cpu"
    assert bool(crossings.operations) == counted, crossings.operations


def _eager(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    with eager_passes():
        return clipped_chunk_sum(model, per_example_cross_entropy, x, y, CLIP)


def _assert_same(
    got: tuple[dict[str, torch.Tensor], torch.Tensor], want: tuple[dict[str, torch.Tensor], torch.Tensor]
) -> None:
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-6)
    assert got[0].keys() == want[0].keys()
    for name in want[0]:
        torch.testing.assert_close(got[0][name], want[0][name], rtol=1e-4, atol=1e-6, msg=name)


@gpu
@pytest.mark.parametrize("kind", ["mlp", "conv"])
def test_on_the_gpu_each_chunk_size_met_replays_from_its_own_graph_and_gives_the_eager_sums(kind: str) -> None:
    """A bucket's graph is captured when a chunk of its size first comes (judged on it), up to that of the first
    chunk's rows and a quarter more; a larger chunk runs eagerly and captures nothing."""
    model, x, y = model_and_rows(kind, 90, "cuda")
    first = clipped_chunk_sum(model, per_example_cross_entropy, x[:64], y[:64], CLIP)
    captures = captured._CAPTURES[model]
    assert list(captures.graphs) == [64] and captures.largest == 80, "the first chunk's bucket alone, so far"
    assert graph_memory(model) > 0, "their memory pool, which torch.cuda.memory_allocated does not count"
    _assert_same(first, _eager(model, x[:64], y[:64]))
    sizes = (80, 64, 37, 16, 9, 8, 3, 1, 37)
    for rows in sizes:
        part_x, part_y = x[-rows:], y[-rows:]  # (other rows than the first chunk's)
        _assert_same(
            clipped_chunk_sum(model, per_example_cross_entropy, part_x, part_y, CLIP), _eager(model, part_x, part_y)
        )
    assert sorted(captures.graphs) == [8, 9, 16, 40, 64, 80], "one graph for each bucket met (1 and 3 rows in 8)"
    report = capture_report(model)
    assert report is not None and report.startswith("replayed from 6 CUDA graphs of 8 to 80 rows"), report
    assert "up to 80 rows" in report and "the GPU ran it in" in report
    graphs = dict(captures.graphs)
    _assert_same(clipped_chunk_sum(model, per_example_cross_entropy, x, y, CLIP), _eager(model, x, y))  # (90 rows)
    assert captured._CAPTURES[model] is captures and captures.graphs == graphs, "nothing captured anew, or for 96"
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)  # an optimizer's in-place step: the graphs read the new values
    _assert_same(
        clipped_chunk_sum(model, per_example_cross_entropy, x[:20], y[:20], CLIP), _eager(model, x[:20], y[:20])
    )


@gpu
def test_on_the_gpu_a_steps_graphs_stop_at_its_physical_batch_size() -> None:
    model, x, y = model_and_rows("mlp", 100, "cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    sums, _, _ = clipped_sum_and_noise(model, x, y, CLIP, 0.0, 64, generator)  # chunks of 64 and 36 rows
    captures = captured._CAPTURES[model]
    assert captures.largest == 64, "none for the 80 rows no chunk has"
    assert sorted(captures.graphs) == [36, 64], "the buckets of the step's two chunks"
    with eager_passes():
        want, _, _ = clipped_sum_and_noise(model, x, y, CLIP, 0.0, 64, generator)
    for name in want:
        torch.testing.assert_close(sums[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


@gpu
def test_on_the_gpu_a_model_that_draws_random_numbers_runs_eagerly(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.Dropout(0.5), nn.Linear(16, 3)).cuda()
    x, y = torch.randn(32, 10, device="cuda"), torch.randint(0, 3, (32,), device="cuda")
    with caplog.at_level(logging.INFO, logger="dpml.train.captured"):
        clipped_chunk_sum(model, per_example_cross_entropy, x, y, CLIP)
    assert captured._CAPTURES[model].graphs == {}
    assert graph_memory(model) == 0
    assert "draws random numbers" in caplog.text
    report = capture_report(model)
    assert report is not None and report.startswith("eager: its pass draws random numbers"), report


class ReadsTheHost(nn.Module):
    """A forward pass that reads a value of the batch on the host: a graph cannot hold it."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) * (2.0 if bool(x.abs().sum() > 0) else 1.0)


@gpu
@pytest.mark.parametrize("kind", ["reads_the_host", "tokens", "copy", "index"])
def test_on_the_gpu_a_pass_that_reads_the_host_runs_eagerly_with_the_eager_sums(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A forward pass that reads the batch, position ids looked up in an embedding (whether they repeat decides how
    their uses combine: read on the host), and host tensors copied or indexing on the GPU."""
    if kind == "tokens":
        model, x, y = model_and_rows("tokens", 16, "cuda")
    elif kind in ("copy", "index"):
        torch.manual_seed(0)
        model = TakesHostTensors(kind).cuda()
        x, y = torch.randn(16, 10, device="cuda"), torch.randint(0, 3, (16,), device="cuda")
    else:
        torch.manual_seed(0)
        model = ReadsTheHost().cuda()
        x, y = torch.randn(16, 10, device="cuda"), torch.randint(0, 3, (16,), device="cuda")
    with caplog.at_level(logging.INFO, logger="dpml.train.captured"):
        got = clipped_chunk_sum(model, per_example_cross_entropy, x, y, CLIP)
    assert captured._CAPTURES[model].graphs == {}
    assert "runs eagerly" in caplog.text
    _assert_same(got, _eager(model, x, y))


@gpu
def test_on_the_gpu_a_model_whose_setting_keeps_changing_stops_being_captured() -> None:
    model, x, y = model_and_rows("mlp", 16, "cuda")
    for change in range(captured.MOST_SETTINGS + 2):
        model[0].weight = nn.Parameter(model[0].weight.detach() + 0.01)  # as an optimizer assigning p.data
        got = clipped_chunk_sum(model, per_example_cross_entropy, x, y, CLIP)
        _assert_same(got, _eager(model, x, y))
        assert bool(captured._CAPTURES[model].graphs) == (change < captured.MOST_SETTINGS), change
    assert capture_report(model) == f"eager: its setting changed {captured.MOST_SETTINGS} times"


@gpu
def test_on_the_gpu_a_replaced_parameter_is_captured_anew() -> None:
    model, x, y = model_and_rows("mlp", 16, "cuda")
    clipped_chunk_sum(model, per_example_cross_entropy, x, y, CLIP)
    before = captured._CAPTURES[model]
    assert before.graphs
    model[0].weight = nn.Parameter(model[0].weight.detach() * 2.0)  # a new tensor at another address
    got = clipped_chunk_sum(model, per_example_cross_entropy, x, y, CLIP)
    assert captured._CAPTURES[model] is not before
    _assert_same(got, _eager(model, x, y))


def test_only_a_synchronising_call_counts_as_a_wait_not_the_warning_that_the_debug_mode_is_on() -> None:
    """torch warns once a process, on switching the sync debug mode on, that the mode "does not yet detect all
    synchronizing operations": read as a wait, it sent the first model of every process to the eager pass."""
    switched_on = (
        "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations "
        "(Triggered internally at /pytorch/torch/csrc/cuda/Module.cpp:1003.)"
    )
    waited = "called a synchronizing CUDA operation (Triggered internally at /pytorch/c10/cuda/CUDAFunctions.cpp:1)"
    assert synchronising_calls([switched_on]) == []
    assert synchronising_calls([switched_on, waited, "an unrelated warning"]) == [waited]


FIRST_CAPTURE = textwrap.dedent(
    """
    import torch
    from torch import nn
    from dpml.train.captured import capture_report, clipped_chunk_sum
    from dpml.train.dpsgd import clipped_sum_and_noise, per_example_cross_entropy
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3)).cuda()
    x, y = torch.randn(64, 10, device="cuda"), torch.randint(0, 3, (64,), device="cuda")
    clipped_chunk_sum(model, per_example_cross_entropy, x, y, 0.5)
    print("REPORT", capture_report(model))
    """
)


@gpu
def test_on_the_gpu_the_first_model_of_a_fresh_process_is_captured() -> None:
    """In a process that has never switched the sync debug mode on (the trainer's, the benchmarks'), the first
    launch-bound model replays from graphs: the other GPU tests run after others that switched it on already."""
    done = subprocess.run(
        [sys.executable, "-c", FIRST_CAPTURE],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = done.stdout.split("REPORT ", 1)[1].strip()
    assert report.startswith("replayed from"), report
