"""A launch-bound model's clipped sums on a GPU, replayed from CUDA graphs instead of issued op by op.

On a GPU a small model's DP step is bound by the host: the engine's pass (the recording forward pass, the backward
pass to the recorded outputs, the per-example norms, the clip factors, the clipped sums) issues a few hundred
operations through Python, each taking the host longer than the GPU takes to run it (issue 48: five DP steps of the
MLP at batch 512 took 25.1 ms of host time against 1.2 ms of GPU time on an H100). A CUDA graph replays the pass's
kernels, captured once, in one launch.

**Shapes.** A graph replays fixed shapes; Poisson batches change size every step. A chunk of r rows runs in the
graph of its *bucket* b, the smallest number m·2^e ≥ r with m one of 8, …, 15 (four significant bits: b < r·9/8, at
least :data:`SMALLEST_BUCKET`): its rows are copied into the graph's inputs, the b − r rows after them repeat its
first row, and a mask m (m_i = 1 for i < r, 0 after) multiplies the clip factors (:func:`masked_clipped_sum`):

    Σ_i m_i · c_i · g_i = Σ_{i<r} c_i g_i,   c_i = min(1, C / (‖g_i‖ + 1e-6)),

the chunk's clipped sum, since each record's gradient g_i comes from its own rows only (the clipping check refuses a
model whose loss for one example changes with another's rows), and the repeated rows' gradients are those of a real
record (finite where it is). A bucket's graph is captured the first time a chunk of its size comes, and judged on
that chunk: a run of Poisson batches meets the few buckets around its mean and those of its last chunks. Buckets go
up to that of the first chunk's rows and a quarter more (a Poisson batch's size varies around its mean), no further
than the physical batch size; a larger chunk runs eagerly. The graphs share one memory pool (they never replay at
once), one set of inputs (the largest bucket's rows, of which a graph of b rows reads the first b) and one set of
outputs (copied out after each replay): they hold an eager pass of the largest bucket met, one copy of the sums
(:func:`graph_memory`), and the blocks of one graph's sizes that another's cannot reuse (captured for every bucket
from 8 rows up, as until this change, ViT's pool held 2.7 times its eager pass on an H200). A new bucket costs its
chunk a warm-up pass, the capture and the judge's eager pass, once.

**When.** Only where it is exact and faster: a batch on a CUDA device, no Dirac canaries (the audit's), no autocast,
a pass that never waits for the GPU (no value read on the host, no copy from pageable host memory: a capture cannot
hold them; position ids looked up in an embedding are read) and takes no host tensor to it (a replay would read the
host's memory again, by then reused: :class:`HostTensorsOnTheDevice`), a model whose pass draws no random numbers
(dropout: a replay would draw new masks where the eager pass it is judged against drew others), and a launch-bound
pass (the GPU runs the first chunk's pass, queued behind a sleep, in less than 1/:data:`REPLAY_ROWS_BOUND` of the
time the host took to issue it), so that a replay, padded by less than an eighth (and a chunk by up to a quarter more
rows than the first), takes the GPU no longer than the host took to issue the eager pass.

**The judge.** Each graph's first replay is compared with the eager engine on the same rows: norms and sums must
agree (rtol 1e-4). Any difference, or any error while capturing or judging (out of memory; an operation the eager
pass's check missed), and the model's chunks run eagerly from then on (its graphs let go), with one log line saying
why.
A captured pass replays what the forward pass did when it was captured: a model whose forward pass depends on
Python state that changes between steps must run eagerly (:func:`eager_passes`). A model, a loss, a clip norm, a
plan, an input shape or the address of any parameter or buffer that differs from the capture's (a model moved, a
parameter replaced) is a new setting, captured anew; the old one's graphs are let go.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
import weakref
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dpml.train.capture_checks import HostTensorsOnTheDevice, synchronisations
from dpml.train.clipping import LossFn, clip_factors, clipped_gradient_sum, engine_dtype, engine_pass
from dpml.train.diracs import DiracGradients
from dpml.train.exact_path import say_unplanned_exact

LOG = logging.getLogger(__name__)

SMALLEST_BUCKET = 8
"""The fewest rows a graph is captured for: a chunk of 1 to 8 rows runs in the 8-row graph."""

REPLAY_ROWS_BOUND = 1.25 * 9 / 8
"""A replay runs at most this many times the first chunk's rows: a chunk up to a quarter larger than the first, in a
bucket under 9/8 of its rows. A pass is captured where the GPU runs the first chunk's pass in less than 1/1.41 of
the time the host takes to issue it, so that even the largest replay ends before the eager pass's issue would. (It
was 1/2: the CNN at batch 4096 on an H200, its pass run by the GPU in 2.1 ms and issued by the host in 3.8, ran
eagerly at 0.50 of the non-private throughput.)"""

JUDGE_RTOL = 1e-4
"""How far a replay's norms and sums may be from the eager engine's on the same rows (relative), the same kernels
chosen afresh: a graph that read another tensor than the one it was captured from is off by far more."""

_ENABLED = [True]


@contextlib.contextmanager
def eager_passes() -> Iterator[None]:
    """Within the block, every chunk runs eagerly (a model whose forward pass depends on state that changes between
    steps; the benchmark's eager row)."""
    _ENABLED.append(False)
    try:
        yield
    finally:
        _ENABLED.pop()


def masked_clipped_sum(
    model: nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    mask: torch.Tensor,
    clip_norm: float,
    exact: Collection[str],
    names: list[str],
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(Σ_i m_i c_i g_i per trainable parameter, in the order of ``names``; ‖g_i‖ for every row): the engine's clipped
    sum (:func:`dpml.train.clipping.clipped_gradient_sum` without canaries) with the clip factor of every row whose
    mask m_i is 0 set to 0."""
    found = engine_pass(model, loss_fn, x, y, exact)
    say_unplanned_exact(model, found.reasons, exact, found.batch)
    norms = found.squared().sqrt()
    sums = found.sums(clip_factors(norms, clip_norm) * mask, spent=True)
    return [sums[name].detach() for name in names], norms.detach()


@dataclass(frozen=True)
class _Pass:
    """One model's masked clipping pass (:func:`masked_clipped_sum`) in one setting: what is timed, captured and
    judged."""

    model: nn.Module
    loss_fn: LossFn
    clip_norm: float
    exact: Collection[str]
    names: list[str]

    def __call__(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        return masked_clipped_sum(self.model, self.loss_fn, x, y, mask, self.clip_norm, self.exact, self.names)


def bucket(rows: int) -> int:
    """The rows of the graph a chunk of ``rows`` runs in: the smallest m·2^e ≥ rows with 8 ≤ m ≤ 15 (so less than
    rows·9/8), at least 8."""
    if rows <= SMALLEST_BUCKET:
        return SMALLEST_BUCKET
    step = 1 << max(0, (rows - 1).bit_length() - 4)
    return -(-rows // step) * step


def largest_bucket(rows: int, most_rows: int | None = None) -> int:
    """The largest bucket captured for a model whose first chunk has ``rows`` rows: that of a quarter more rows (a
    Poisson batch's size varies around its mean: a later single-chunk batch may be larger than the first), but not
    more than ``most_rows``, the physical batch size, where it is known: no chunk has more rows, and a graph for more
    would hold memory for rows that never come (a benchmark's fixed batch of 512 captured graphs up to 640)."""
    wanted = rows + rows // 4
    if most_rows is not None:
        wanted = min(wanted, max(rows, most_rows))
    return bucket(wanted)


def buckets_up_to(largest: int) -> list[int]:
    """Every bucket from :data:`SMALLEST_BUCKET` to ``largest``, ascending (eight in each doubling past 8)."""
    found = [SMALLEST_BUCKET]
    while found[-1] < largest:
        found.append(bucket(found[-1] + 1))
    return found


@dataclass
class _Buffers:
    """The inputs and outputs a setting's graphs share: the largest bucket's rows, labels and mask (a graph of b rows
    reads the first b), the clipped sums and the norms (a graph of b rows writes the first b norms)."""

    x: torch.Tensor
    y: torch.Tensor
    mask: torch.Tensor
    sums: list[torch.Tensor]
    norms: torch.Tensor

    def replayed(
        self, graph: torch.cuda.CUDAGraph, rows: int, x: torch.Tensor, y: torch.Tensor, names: list[str]
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The chunk's clipped sums and its rows' norms by ``graph`` of ``rows`` rows (fresh tensors: the next replay
        overwrites the buffers)."""
        fill(self.x[:rows], self.y[:rows], self.mask[:rows], x, y)
        graph.replay()
        return dict(zip(names, torch._foreach_mul(self.sums, 1.0), strict=True)), self.norms[: x.shape[0]].clone()


def fill(static_x: torch.Tensor, static_y: torch.Tensor, mask: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
    """The chunk's r rows into a bucket's inputs, the rows after them its first row again, m_i = 1 for i < r only
    (device copies only: the host reads nothing)."""
    rows = x.shape[0]
    for static, given in ((static_x, x), (static_y, y)):
        static[:rows].copy_(given)
        static[rows:].copy_(given[:1].expand(static.shape[0] - rows, *given.shape[1:]))
    mask[:rows].fill_(1)
    mask[rows:].fill_(0)


@dataclass
class _Captures:
    """A model's graphs for one setting (:func:`_setting`), by bucket, captured as chunks of their sizes come; none
    where it runs eagerly."""

    setting: tuple[Any, ...]
    loss_fn: LossFn  # (held: the setting names it by id)
    names: list[str]
    graphs: dict[int, torch.cuda.CUDAGraph] = field(default_factory=dict)
    buffers: _Buffers | None = None  # (None: every chunk runs eagerly)
    pool: torch.cuda._POOL_HANDLE | None = None
    side: torch.cuda.Stream | None = None  # the stream warm-ups run on (one, so that its cuBLAS workspace is one)
    settings: int = 1  # how many settings the model has had: past MOST_SETTINGS, it runs eagerly
    why: str = ""  # why its chunks run eagerly ('' where they replay)
    timing: tuple[float, float] | None = None  # (seconds the GPU ran the first chunk's pass in, the host issued it in)

    @property
    def largest(self) -> int:
        """The largest bucket a graph is captured for (0 where none is)."""
        return 0 if self.buffers is None else self.buffers.x.shape[0]


MOST_SETTINGS = 3
"""The most settings a model's chunks are captured for: a model whose setting keeps changing (a parameter replaced at
every step, by an optimizer that assigns ``p.data``) would be captured anew at every chunk; it runs eagerly."""


_CAPTURES: weakref.WeakKeyDictionary[nn.Module, _Captures] = weakref.WeakKeyDictionary()


def clipped_chunk_sum(
    model: nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    clip_norm: float,
    diracs: DiracGradients | None = None,
    exact: Collection[str] = (),
    autocast: torch.dtype | None = None,
    most_rows: int | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """:func:`dpml.train.clipping.clipped_gradient_sum` of one chunk, replayed from a CUDA graph where that is exact and
    faster (this module's docstring), else eagerly. ``most_rows``: the physical batch size, where known (no chunk of
    the run has more rows: :func:`largest_bucket`)."""
    if not _may_capture(x, y, diracs, autocast):
        return clipped_gradient_sum(model, loss_fn, x, y, clip_norm, diracs, exact, autocast)
    setting = _setting(model, loss_fn, clip_norm, exact, x, y)
    captures = _CAPTURES.get(model)
    if captures is None or captures.setting != setting:
        settings = 1 if captures is None else captures.settings + 1
        _CAPTURES.pop(model, None)  # (the old setting's graphs let go before new ones take memory)
        captures = _CAPTURES[model] = _prepared(model, loss_fn, x, y, clip_norm, exact, setting, settings, most_rows)
    rows = bucket(x.shape[0])
    graph = captures.graphs.get(rows)
    if graph is None and rows <= captures.largest:
        graph = _new_graph(_Pass(model, loss_fn, clip_norm, exact, captures.names), captures, x, y, rows)
    if graph is None or captures.buffers is None:
        return clipped_gradient_sum(model, loss_fn, x, y, clip_norm, diracs, exact, autocast)
    return captures.buffers.replayed(graph, rows, x, y, captures.names)


def graph_memory(model: nn.Module) -> int:
    """The bytes the model's CUDA graphs hold on its device (0 where it has none): their pool, which
    ``torch.cuda.memory_allocated`` does not count (free between replays, kept for them), and their shared inputs and
    outputs, which it does (so counted twice: an overestimate by a copy of the sums and the largest bucket's rows)."""
    captures = _CAPTURES.get(model)
    if captures is None or captures.pool is None or captures.buffers is None:
        return 0
    pool = sum(_pool_segments(captures.pool))
    buffers = captures.buffers
    tensors = [buffers.x, buffers.y, buffers.mask, buffers.norms, *buffers.sums]
    return pool + sum(t.numel() * t.element_size() for t in tensors)


def _pool_segments(pool: tuple[int, int]) -> list[int]:
    """The sizes in bytes of the device memory segments a graph pool holds."""
    return [
        int(segment["total_size"])
        for segment in torch.cuda.memory_snapshot()
        if tuple(segment.get("segment_pool_id", ())) == tuple(pool)
    ]


def capture_report(model: nn.Module) -> str | None:
    """How the model's chunks run on its GPU, for a benchmark's page: from how many graphs (their pool's memory), or
    eagerly and why; the first chunk's GPU and host time. None where no chunk of it was captured or judged."""
    captures = _CAPTURES.get(model)
    if captures is None:
        return None
    timing = _timing_words(captures.timing)
    if captures.graphs:
        rows = sorted(captures.graphs)
        segments = _pool_segments(captures.pool) if captures.pool is not None else []
        held = f", their pool holding {sum(segments) / 2**20:.0f} MiB in {len(segments)} segments"
        return (
            f"replayed from {len(rows)} CUDA graphs of {rows[0]} to {rows[-1]} rows (those of the chunk sizes met; up "
            f"to {captures.largest} rows){held}{timing}"
        )
    return f"eager: {captures.why or 'no trainable parameters'}{timing}"


def _timing_words(timing: tuple[float, float] | None) -> str:
    if timing is None:
        return ""
    return " (the first chunk's pass: the GPU ran it in {:.2f} ms, the host issued it in {:.2f} ms)".format(
        *(1e3 * seconds for seconds in timing)
    )


def _may_capture(x: torch.Tensor, y: torch.Tensor, diracs: DiracGradients | None, autocast: torch.dtype | None) -> bool:
    return (
        _ENABLED[-1]
        and isinstance(x, torch.Tensor)
        and isinstance(y, torch.Tensor)
        and x.device.type == "cuda"
        and x.shape[0] > 0
        and diracs is None
        and autocast is None
        and not torch.cuda.is_current_stream_capturing()
    )


def _setting(
    model: nn.Module, loss_fn: LossFn, clip_norm: float, exact: Collection[str], x: torch.Tensor, y: torch.Tensor
) -> tuple[Any, ...]:
    """What a graph replays as it was captured: the loss, the clip norm, the plan, the rows' shapes and dtypes, the
    model's mode, and the address, shape and dtype of every parameter and buffer it reads."""
    tensors = tuple(
        (t.data_ptr(), tuple(t.shape), t.dtype, t.requires_grad)
        for t in itertools.chain(model.parameters(), model.buffers())
    )
    return (
        id(loss_fn),
        clip_norm,
        frozenset(exact),
        getattr(exact, "constant_reads", ()),
        tuple(x.shape[1:]),
        x.dtype,
        tuple(y.shape[1:]),
        y.dtype,
        x.device,
        model.training,
        tensors,
    )


def _prepared(
    model: nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    clip_norm: float,
    exact: Collection[str],
    setting: tuple[Any, ...],
    settings: int,
    most_rows: int | None = None,
) -> _Captures:
    """A new setting's captures, before any graph: the graphs' shared buffers (:func:`warmed_buffers`, up to
    :func:`largest_bucket`), pool and side stream; none of them, with a log line saying why, where capturing would
    not be exact or not faster (:func:`_why_eager`)."""
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    captures = _Captures(setting, loss_fn, names, settings=settings)
    if not names:
        return captures
    if settings > MOST_SETTINGS:
        captures.why = f"its setting changed {MOST_SETTINGS} times"
        if settings == MOST_SETTINGS + 1:
            LOG.info("per-example clipping: a model's %s: its chunks run eagerly", captures.why)
        return captures
    run = _Pass(model, loss_fn, clip_norm, exact, names)
    device = x.device
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(side):
            why, captures.timing = _why_eager(run, x, y)
            if not why:
                captures.buffers = warmed_buffers(run, x, y, largest_bucket(x.shape[0], most_rows))
        torch.cuda.current_stream(device).wait_stream(side)
    except RuntimeError as error:  # out of memory
        torch.cuda.current_stream(device).wait_stream(side)
        why = f"preparing its graphs failed ({str(error).splitlines()[0]})"
    if why:
        _run_eagerly(captures, why, device)
    else:
        captures.pool, captures.side = torch.cuda.graph_pool_handle(), side
    return captures


def _new_graph(
    run: _Pass, captures: _Captures, x: torch.Tensor, y: torch.Tensor, rows: int
) -> torch.cuda.CUDAGraph | None:
    """The graph of the chunk's bucket of ``rows`` rows, met for the first time: captured into the setting's pool
    (:func:`capture_graph`) and judged on the chunk (:func:`_judged_equal`); None where capturing or judging it
    failed, or its replay differed: the model's chunks then run eagerly (its graphs let go), with a log line saying
    why."""
    buffers, side, device = captures.buffers, captures.side, x.device
    assert buffers is not None and side is not None and captures.pool is not None
    side.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(side):
            fill(buffers.x[:rows], buffers.y[:rows], buffers.mask[:rows], x, y)
            graph = capture_graph(run, buffers, captures.pool, rows)
        torch.cuda.current_stream(device).wait_stream(side)
        why = "" if _judged_equal(run, buffers, graph, rows, x, y) else "a replay differed from the eager engine"
    except RuntimeError as error:  # an operation a capture cannot hold (a host read, a pageable copy), out of memory
        torch.cuda.current_stream(device).wait_stream(side)
        why = f"capturing or judging its pass failed ({str(error).splitlines()[0]})"
    if why:
        _run_eagerly(captures, f"{why} (its graph of {rows} rows)", device)
        return None
    captures.graphs[rows] = graph
    return graph


def _run_eagerly(captures: _Captures, why: str, device: torch.device) -> None:
    """From now on the setting's chunks run eagerly: its graphs, buffers and pool let go, one log line saying why."""
    captures.graphs, captures.buffers, captures.pool, captures.side = {}, None, None, None
    torch.cuda.empty_cache()
    eager = "every chunk runs eagerly, not from a CUDA graph"
    LOG.info("per-example clipping on %s: %s: %s%s", device, eager, why, _timing_words(captures.timing))
    captures.why = why


def _static_inputs(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A bucket's inputs of ``rows`` rows, holding the chunk's first rows (repeated where it has fewer)."""
    static_x = x.new_empty((rows, *x.shape[1:]))
    static_y = y.new_empty((rows, *y.shape[1:]))
    mask = torch.empty(rows, device=x.device, dtype=engine_dtype(model))
    fill(static_x, static_y, mask, x[:rows], y[:rows])
    return static_x, static_y, mask


def _why_eager(run: _Pass, x: torch.Tensor, y: torch.Tensor) -> tuple[str, tuple[float, float] | None]:
    """Why the model's chunks should run eagerly ('' if they should not): the chunk's pass waits for the GPU, draws
    random numbers, or would take the GPU, replayed, as long as the host takes to issue it (a replay runs at most
    :data:`REPLAY_ROWS_BOUND` times the timed rows); and, where it was timed, (seconds the GPU
    ran the pass in, seconds the host issued it in). The pass is timed on the GPU queued behind a sleep longer than
    its issue (so the GPU runs it back to back), after one warm-up pass; both on the chunk's own rows (no more memory
    than its eager pass)."""
    device = x.device
    inputs = _static_inputs(run.model, x, y, x.shape[0])
    before = torch.cuda.get_rng_state(device)
    start = time.perf_counter()
    with synchronisations() as waits, HostTensorsOnTheDevice() as crossings:
        run(*inputs)
    warm_up = time.perf_counter() - start
    if waits:
        return f"its pass waits for the GPU ({waits[0]}), which a capture cannot hold", None
    if crossings.operations:
        operation = crossings.operations[0]
        return f"its pass takes host tensors to the GPU ({operation}), which a replay would read stale", None
    if not torch.equal(before, torch.cuda.get_rng_state(device)):
        return "its pass draws random numbers (dropout), which a replay would draw anew", None
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(max(warm_up, 1e-3) * 5e9))  # ≥ 2× the warm-up's issue time at any clock below 2.5 GHz
    begin.record()
    start = time.perf_counter()
    run(*inputs)
    issued = time.perf_counter() - start
    end.record()
    end.synchronize()
    ran = begin.elapsed_time(end) / 1e3
    if REPLAY_ROWS_BOUND * ran >= issued:
        return "its pass is not launch-bound", (ran, issued)
    return "", (ran, issued)


def warmed_buffers(run: _Pass, x: torch.Tensor, y: torch.Tensor, largest: int) -> _Buffers:
    """The graphs' shared inputs, ``largest`` rows holding the chunk's (:func:`_static_inputs`), and outputs, shaped by
    one warm-up pass on the chunk's own bucket (no more memory than a replay of it)."""
    static_x, static_y, mask = _static_inputs(run.model, x, y, largest)
    first = min(bucket(x.shape[0]), largest)
    sums, norms = run(static_x[:first], static_y[:first], mask[:first])  # (warm-up)
    return _Buffers(static_x, static_y, mask, [torch.empty_like(s) for s in sums], norms.new_empty(largest))


def capture_graph(run: _Pass, buffers: _Buffers, pool: torch.cuda._POOL_HANDLE, rows: int) -> torch.cuda.CUDAGraph:
    """The graph of the masked pass on the buffers' first ``rows`` rows, writing the shared outputs, captured into
    ``pool`` after one warm-up pass on the same rows (on the current stream: cuDNN's and cuBLAS's choices for the shape
    made before the capture)."""
    inputs = buffers.x[:rows], buffers.y[:rows], buffers.mask[:rows]
    run(*inputs)  # (warm-up)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):  # (another thread's copies go on)
        sums, norms = run(*inputs)
        torch._foreach_copy_(buffers.sums, sums)
        buffers.norms[:rows].copy_(norms)
    return graph


def _judged_equal(
    run: _Pass, buffers: _Buffers, graph: torch.cuda.CUDAGraph, rows: int, x: torch.Tensor, y: torch.Tensor
) -> bool:
    """Whether the graph's replay on the chunk (x, y), padded to its ``rows``, gives the eager engine's norms and
    sums on the same padded rows (one host read)."""
    sums, norms = buffers.replayed(graph, rows, x, y, run.names)
    eager_sums, eager_norms = run(buffers.x[:rows], buffers.y[:rows], buffers.mask[:rows])  # (the replay's rows)
    pairs = [(norms, eager_norms[: x.shape[0]])]
    pairs += [(sums[n], s) for n, s in zip(run.names, eager_sums, strict=True)]
    scale = float(run.clip_norm) * rows * 1e-6
    agree = torch.ones((), dtype=torch.bool, device=x.device)
    for got, want in pairs:
        agree &= torch.isclose(got, want, rtol=JUDGE_RTOL, atol=scale, equal_nan=True).all()
    return bool(agree)
