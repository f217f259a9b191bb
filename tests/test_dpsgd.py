import copy
import os

import numpy as np
import pytest
import torch
from torch import nn

from dpml.models.mlp import MlpSpec, build_mlp
from dpml.train.clipping import clipped_gradient_sum
from dpml.train.dpsgd import per_example_cross_entropy, train_dpsgd
from dpml.train.steps import poisson_batch
from tests.noise_laws import box_muller

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine: not run")


def naive_clipped_sum_and_norms(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Reference: one backward pass per example, clip, add; and the per-example norms (trainable parameters)."""
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    total = {n: torch.zeros_like(p) for n, p in trainable.items()}
    norms = []
    for i in range(x.shape[0]):
        model.zero_grad()
        per_example_cross_entropy(model(x[i : i + 1]), y[i : i + 1]).sum().backward()
        grads = {
            n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for n, p in trainable.items()
        }
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads.values()))
        norms.append(norm)
        factor = min(1.0, clip / (float(norm) + 1e-6))
        for n in total:
            total[n] += factor * grads[n]
    return total, torch.stack(norms)


def naive_clipped_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float) -> dict[str, torch.Tensor]:
    return naive_clipped_sum_and_norms(model, x, y, clip)[0]


def data(n: int = 40, d: int = 6, k: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * 2, torch.randint(0, k, (n,), generator=g)


@pytest.mark.parametrize("clip", [0.05, 1.0, 100.0])
@pytest.mark.parametrize("hidden", [(), (8,), (8, 5)])
def test_linear_fast_path_matches_naive_loop(hidden: tuple[int, ...], clip: float) -> None:
    torch.manual_seed(1)
    model = build_mlp(MlpSpec(6, hidden, 3, "tanh")).double()
    x, y = data()
    x = x.double()
    fast, norms = clipped_gradient_sum(model, per_example_cross_entropy, x, y, clip)
    reference = naive_clipped_sum(model, x, y, clip)
    for name in reference:
        torch.testing.assert_close(fast[name], reference[name], rtol=1e-9, atol=1e-12)
    assert norms.shape == (40,)


class WithNorm(nn.Module):
    """Dense layers around a LayerNorm (fast path for all three; more cases in test_clipping_layers.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.inp(x))))


def test_fallback_matches_naive_loop() -> None:
    torch.manual_seed(2)
    model = WithNorm().double()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
    x, y = data()
    fast, _ = clipped_gradient_sum(model, per_example_cross_entropy, x.double(), y, 0.3)
    reference = naive_clipped_sum(model, x.double(), y, 0.3)
    for name in reference:
        torch.testing.assert_close(fast[name], reference[name], rtol=1e-9, atol=1e-12)


def test_removing_one_example_moves_the_sum_by_at_most_c() -> None:
    torch.manual_seed(3)
    model = build_mlp(MlpSpec(6, (8,), 3))
    x, y = data(n=30)
    clip = 0.7
    full, _ = clipped_gradient_sum(model, per_example_cross_entropy, x, y, clip)
    for i in range(30):
        keep = torch.arange(30) != i
        part, _ = clipped_gradient_sum(model, per_example_cross_entropy, x[keep], y[keep], clip)
        diff = torch.sqrt(sum((full[n] - part[n]).pow(2).sum() for n in full))
        assert float(diff) <= clip * (1 + 1e-5)


def test_one_dpsgd_step_equals_the_formula() -> None:
    """θ₁ = θ₀ − η (Σ_{i∈B} clip(∇ℓ_i) + N(0, σ²C²)) / (q n), with the trainer's own RNG streams.

    The reference noise is the Box–Muller construction written out in the test helper
    (:func:`tests.noise_laws.box_muller`), not dpml's own :func:`gaussian`: a wrong draw (the planted
    bug "std × 0.9 in the CPU draw") fails here instead of agreeing with itself."""
    torch.manual_seed(4)
    x, y = data(n=50)
    model = build_mlp(MlpSpec(6, (8,), 3)).double()
    x = x.double()
    start = copy.deepcopy(model)
    q, clip, sigma, lr, seed = 0.3, 0.5, 1.3, 0.1, 11
    result = train_dpsgd(
        model,
        x,
        y,
        sample_rate=q,
        epochs=q,
        clip_norm=clip,
        noise_multiplier=sigma,
        neighbouring="add-remove",
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        seed=seed,
        physical_batch_size=7,
    )
    assert result.history["steps"] == 1
    batch = poisson_batch(torch.Generator().manual_seed(seed), 50, q)
    reference = naive_clipped_sum(start, x[batch], y[batch], clip)
    # the step's noise: one flat draw over all parameters, in named_parameters order
    total = sum(p0.numel() for p0 in start.parameters())
    flat = box_muller(total, sigma * clip, seed + 1, torch.float64)
    offset = 0
    for name, p0 in start.named_parameters():
        z = flat[offset : offset + p0.numel()].view(p0.shape)
        offset += p0.numel()
        expected = p0.detach() - lr * (reference[name] + z) / (q * 50)
        torch.testing.assert_close(dict(model.named_parameters())[name].detach(), expected, rtol=1e-6, atol=1e-7)
    event = result.mechanism.events[0]
    assert (event.sample_rate, event.noise_multiplier, event.steps) == (q, sigma, 1)
    assert result.mechanism.sensitivity == clip and result.mechanism.threat_model == "all-iterates"


def test_poisson_sampling_rate_and_empty_batches() -> None:
    g = torch.Generator().manual_seed(0)
    sizes = torch.tensor([poisson_batch(g, 1000, 0.05).numel() for _ in range(400)], dtype=torch.float64)
    assert abs(float(sizes.mean()) - 50) < 1.5  # mean 50, std of the mean ≈ 0.34
    assert 4 < float(sizes.var()) ** 0.5 < 10  # Binomial(1000, 0.05): std ≈ 6.9 (not a fixed batch size)
    # An empty batch still takes a noise-only step: the parameters move.
    torch.manual_seed(0)
    model = build_mlp(MlpSpec(6, (), 3))
    before = [p.detach().clone() for p in model.parameters()]
    x, y = data(n=5)
    result = train_dpsgd(
        model,
        x,
        y,
        sample_rate=1e-9,
        epochs=1e-9,
        clip_norm=1.0,
        noise_multiplier=1.0,
        neighbouring="add-remove",
        optimizer=torch.optim.SGD(model.parameters(), lr=1e-9),
        seed=0,
    )
    assert result.history["empty_batches"] == 1
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters(), strict=True))


class SmallCnn(nn.Module):
    """Convolutions (strided, padded, dilated), a GroupNorm, dense layers on 3-D inputs."""

    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 4, 3, stride=2, padding=1)
        self.c2 = nn.Conv2d(4, 6, 3, dilation=2, bias=False)
        self.norm = nn.GroupNorm(2, 6) if norm else nn.Identity()
        self.seq = nn.Linear(3, 5)  # applied per row of a (B, 6, 3·3)-shaped activation: T = 18 positions
        self.out = nn.Linear(6 * 3 * 5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.c1(x))
        h = torch.tanh(self.norm(self.c2(h)))  # (B, 6, 3, 3)
        h = torch.tanh(self.seq(h.reshape(h.shape[0], 6 * 3, 3)))
        return self.out(h.reshape(h.shape[0], -1))


@pytest.mark.parametrize("norm", [False, True])
def test_conv_and_sequence_layers_match_naive_loop(norm: bool) -> None:
    torch.manual_seed(5)
    model = SmallCnn(norm).double()
    if norm:
        with torch.no_grad():
            model.norm.weight.uniform_(0.5, 1.5)
            model.norm.bias.uniform_(-0.5, 0.5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(12, 1, 13, 13, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (12,), generator=g)
    for clip in (0.01, 0.5, 1e3):
        fast, norms = clipped_gradient_sum(model, per_example_cross_entropy, x, y, clip)
        reference = naive_clipped_sum(model, x, y, clip)
        assert set(fast) == set(reference)
        for name in reference:
            torch.testing.assert_close(fast[name], reference[name], rtol=1e-9, atol=1e-12)


class Shared(nn.Module):
    """One Linear applied twice: its per-example gradient is a sum over both calls."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.layer(torch.tanh(self.layer(x)))))


def test_a_layer_used_twice_is_handled_exactly() -> None:
    torch.manual_seed(7)
    model = Shared().double()
    x, y = data()
    fast, _ = clipped_gradient_sum(model, per_example_cross_entropy, x.double(), y, 0.3)
    reference = naive_clipped_sum(model, x.double(), y, 0.3)
    for name in reference:
        torch.testing.assert_close(fast[name], reference[name], rtol=1e-9, atol=1e-12)


def test_released_models_draw_batches_and_noise_from_a_secret_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A public seed would make the release a deterministic function of the data (no DP at all)."""
    from dpml.config import validate
    from dpml.train.fit import fit

    config = validate(
        {"model": {"hidden": []}, "train": {"epochs": 1, "sample_rate": 0.2}, "dp": {"noise_multiplier": 1.0}}
    )
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(200, 6)).astype(np.float32), rng.integers(0, 3, 200)

    def weights(**kwargs: object) -> torch.Tensor:
        model = fit(config, x, y, 3, private=True, noise_multiplier=1.0, seed=0, **kwargs).model  # type: ignore[arg-type]
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    monkeypatch.delenv("DPML_NOISE_SEED", raising=False)
    assert not torch.equal(weights(), weights())  # same config and init seed, fresh secret noise
    torch.testing.assert_close(weights(noise_seed=5), weights(noise_seed=5))  # the audit's simulations
    monkeypatch.setenv("DPML_NOISE_SEED", "42")  # the operator's secret, to reproduce a release
    torch.testing.assert_close(weights(), weights())
    monkeypatch.setenv("DPML_NOISE_SEED", "not a number")
    with pytest.raises(ValueError, match="DPML_NOISE_SEED"):
        weights()


@pytest.mark.parametrize(
    "kernel,stride,padding,dilation",
    [((3, 3), (1, 1), (0, 0), (1, 1)), ((8, 8), (2, 2), (3, 3), (1, 1)), ((3, 2), (2, 1), (1, 2), (2, 1))],
)
def test_patches_equal_torch_unfold(kernel: tuple, stride: tuple, padding: tuple, dilation: tuple) -> None:
    from dpml.train.clipping_layers import unfold_patches

    x = torch.randn(3, 2, 11, 12, dtype=torch.float64)
    expected = torch.nn.functional.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)
    assert torch.equal(unfold_patches(x, kernel, stride, padding, dilation), expected)
    from dpml.train.clipping_conv import channels_last_patches  # the same patches, channel fastest

    last = channels_last_patches(x, kernel, stride, padding, dilation)  # (B, T, kh·kw·C)
    reordered = expected.reshape(3, 2, kernel[0] * kernel[1], -1).permute(0, 3, 2, 1).reshape(last.shape)
    assert torch.equal(last, reordered)
    assert torch.equal(
        channels_last_patches(x.contiguous(memory_format=torch.channels_last), kernel, stride, padding, dilation),
        reordered,
    )


@pytest.mark.parametrize("stream_class", ["PrefetchedNoise", "SynchronousNoise"])
def test_cpu_noise_streams_are_the_synchronous_draw_sequence(stream_class: str) -> None:
    """The noise drawn a step ahead in the background (into two alternating buffers), or in the step into
    one buffer, is exactly what fresh synchronous draws from the same seed give, step after step (each
    draw valid until the next), and a std other than the stream's is refused."""
    from dpml.train import noise

    params = dict(build_mlp(MlpSpec(6, (8,), 3)).named_parameters())
    stream = getattr(noise, stream_class)(torch.Generator().manual_seed(9), params, 0.7)
    reference = torch.Generator().manual_seed(9)
    try:
        draws = [{name: value.clone() for name, value in stream.draw(0.7).items()} for _ in range(3)]
        with pytest.raises(ValueError, match="noise std = 1.4"):
            stream.draw(1.4)
    finally:
        stream.close()
    for draw in draws:
        expected = noise.gaussian_noise(params, 0.7, reference)
        assert list(draw) == list(params)
        for name, p in params.items():
            assert draw[name].shape == p.shape
            assert torch.equal(draw[name], expected[name])
    assert not torch.equal(draws[0]["0.weight"], draws[1]["0.weight"])
    assert not torch.equal(draws[0]["0.weight"], draws[2]["0.weight"])


NOISE_SOURCES = [
    ("cpu", "generator"),
    ("cpu", "PrefetchedNoise"),
    ("cpu", "SynchronousNoise"),
    ("cpu", "none"),
    pytest.param("cuda", "generator", marks=needs_cuda),
    pytest.param("cuda", "none", marks=needs_cuda),
]


@pytest.mark.parametrize(("device", "source"), NOISE_SOURCES)
@pytest.mark.parametrize("rows", [40, 0])
def test_every_noise_source_gives_each_trainable_parameter_its_noise(device: str, source: str, rows: int) -> None:
    """:func:`clipped_sum_and_noise`'s three outputs for each noise source the trainers pass (a torch generator, as on
    a GPU; either CPU stream; none, a distributed run's worker), on a batch and on an empty one: the clipped sums
    and the noise keyed by every trainable parameter in order (a frozen one gets neither), the noise the source's own
    draw (zeros for none), and the count of clipped records in torch's default dtype."""
    from dpml.train import noise
    from dpml.train.dpsgd import clipped_sum_and_noise

    torch.manual_seed(2)
    model = build_mlp(MlpSpec(6, (8,), 3)).to(device)
    model[0].bias.requires_grad_(False)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    x, y = data()
    x, y = x[:rows].to(device), y[:rows].to(device)
    generator = torch.Generator(device).manual_seed(4)
    streams = {"PrefetchedNoise": noise.PrefetchedNoise, "SynchronousNoise": noise.SynchronousNoise}
    drawn_from = streams[source](generator, trainable, 0.3) if source in streams else generator
    try:
        sums, noises, clipped = clipped_sum_and_noise(
            model, x, y, 0.5, 0.6, 16, None if source == "none" else drawn_from
        )
        noises = {name: value.clone() for name, value in noises.items()}
    finally:
        if source in streams:
            drawn_from.close()
    assert list(sums) == list(trainable) and list(noises) == list(trainable)
    expected = noise.gaussian_noise(trainable, 0.5 * 0.6, torch.Generator(device).manual_seed(4))
    for name, p in trainable.items():
        assert sums[name].shape == p.shape and noises[name].shape == p.shape
        if source == "none":
            assert not noises[name].any()
        else:
            assert torch.equal(noises[name], expected[name])
    reference, norms = naive_clipped_sum_and_norms(model, x, y, 0.5) if rows else ({}, torch.zeros(0, device=device))
    for name in trainable:
        torch.testing.assert_close(sums[name], reference.get(name, torch.zeros_like(sums[name])), rtol=1e-5, atol=1e-6)
    assert clipped.dtype == torch.get_default_dtype() and clipped.shape == ()
    assert int(clipped) == int((norms > 0.5).sum()) and (rows == 0 or int(clipped) > 0)


def test_the_noise_is_drawn_ahead_only_where_torch_leaves_a_core_idle() -> None:
    from dpml.train.noise import PrefetchedNoise, SynchronousNoise, cpu_noise_stream

    params = dict(nn.Linear(3, 2).named_parameters())
    cores, threads = len(os.sched_getaffinity(0)), torch.get_num_threads()
    try:
        torch.set_num_threads(cores)
        stream = cpu_noise_stream(torch.Generator(), params, 1.0)
        assert isinstance(stream, SynchronousNoise)
        if cores > 1:
            torch.set_num_threads(cores - 1)
            stream = cpu_noise_stream(torch.Generator(), params, 1.0)
            assert isinstance(stream, PrefetchedNoise)
            stream.close()
    finally:
        torch.set_num_threads(threads)
