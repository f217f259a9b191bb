"""Clipless DP-SGD (seed 004): bounds instead of clipping, the noise the certificate assumes, the soundness check."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dpml.config import ConfigError, load
from dpml.models.lipschitz import LOSS_LIPSCHITZ, LipschitzSpec, build_lipschitz, tau_cross_entropy
from dpml.train.clipless import clipless_bounds, clipless_mechanism, soundness_check, train_clipless
from tests.conftest import small_params, write_params


def data(n: int = 400, d: int = 10, classes: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, d))
    y = rng.integers(0, classes, size=n)
    x = centres[y] + 0.3 * rng.normal(size=(n, d))
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    return torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y)


def test_clipless_training_learns_and_passes_its_soundness_check() -> None:
    x, y = data()
    torch.manual_seed(0)
    model = build_lipschitz(LipschitzSpec(10, (16,), 3, input_bound=1.0, bias_bound=0.5))
    bounds = clipless_bounds(model, 1.0, LOSS_LIPSCHITZ["tau_cross_entropy"])
    result = train_clipless(
        model,
        x,
        y,
        sample_rate=0.25,
        epochs=30,
        noise_multiplier=0.5,
        noise="global",
        bounds=bounds,
        neighbouring="add-remove",
        loss_fn=tau_cross_entropy(8.0),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        seed=0,
    )
    assert result.history["soundness_passed"] and result.history["soundness_violations"] == 0
    assert 0 < result.history["soundness_max_ratio"] <= 1 and result.history["spectral_norm_max"] <= 1 + 1e-4
    assert float((model(x).argmax(1) == y).float().mean()) > 0.9
    assert result.mechanism == clipless_mechanism(bounds, 0.25, 0.5, "global", 30, "add-remove", 400)
    assert result.mechanism.clip_norm == pytest.approx(bounds.total)


@pytest.mark.parametrize("noise", ["global", "per_layer"])
def test_noise_has_the_scale_the_certificate_assumes(noise: str) -> None:
    """With a zero loss the weights after T full-batch SGD steps (lr 1) are −Σ_t noise_t/n: per coordinate
    N(0, T·(σΔ)²/n²) for global noise, N(0, T·(σΔ_d)²/n²) for layer d with per-layer noise (small enough
    that no projection acts: spectral norms stay far below 1)."""
    torch.manual_seed(0)
    model = build_lipschitz(LipschitzSpec(300, (8,), 40, input_bound=1.0, bias_bound=0.1))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    bounds = clipless_bounds(model, 1.0, 1.0)
    n = 2000
    x, y = torch.zeros(n, 300), torch.zeros(n, dtype=torch.long)
    sigma, steps = 2.0, 25
    train_clipless(
        model,
        x,
        y,
        sample_rate=1.0,
        epochs=steps,
        noise_multiplier=sigma,
        noise=noise,
        bounds=bounds,
        neighbouring="add-remove",
        loss_fn=lambda z, t: 0.0 * z.sum(1),
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        seed=1,
        soundness_records=10,
    )
    layers = bounds.per_layer()
    for index, layer in (("1", model[1]), ("3", model[3])):
        assert float(torch.linalg.matrix_norm(layer.weight.detach(), ord=2)) < 0.5  # no projection happened
        delta = bounds.total if noise == "global" else layers[index]
        expected = sigma * delta * steps**0.5 / n
        assert float(layer.weight.detach().std()) == pytest.approx(expected, rel=0.12), index
    mechanism = clipless_mechanism(bounds, 1.0, sigma, noise, steps, "add-remove", n)
    assert mechanism.events[0].noise_multiplier == pytest.approx(sigma if noise == "global" else sigma / 2**0.5)


def test_the_soundness_check_catches_a_layer_above_its_constraint() -> None:
    x, y = data()
    model = build_lipschitz(LipschitzSpec(10, (16,), 3, input_bound=1.0, bias_bound=0.5))
    bounds = clipless_bounds(model, 1.0, LOSS_LIPSCHITZ["tau_cross_entropy"])
    with torch.no_grad():
        model[3].weight.mul_(5.0)  # ‖W‖₂ = 5: the input gradient of the first layer grows fivefold
        model[3].bias.normal_(0, 5.0)
    report = soundness_check(model, x, y, tau_cross_entropy(8.0), bounds, 400, seed=0)
    assert report["soundness_violations"] > 0 and report["soundness_max_ratio"] > 1


def test_clipless_configuration_errors() -> None:
    with pytest.raises(ConfigError) as error:
        load("params.yaml", ["train.algorithm=clipless"])
    assert "model.kind = 'mlp'" in str(error.value) and "train.loss = 'cross_entropy'" in str(error.value)
    with pytest.raises(ConfigError, match="even widths"):
        load("params.yaml", ["model.kind=lipschitz", "model.hidden=[5]"])


def test_clipless_pipeline_certifies_and_voids_an_unsound_run(workdir: Path) -> None:
    from dpml import io
    from dpml.stages import STAGES, Layout

    config = load(
        write_params(
            workdir / "cl.yaml",
            small_params(
                workdir,
                model={"kind": "lipschitz", "hidden": [32], "bias_bound": 0.5},
                train={
                    "algorithm": "clipless",
                    "loss": "tau_cross_entropy",
                    "loss_tau": 8.0,
                    "epochs": 10,
                    "learning_rate": 0.5,
                    "clipless_noise": "per_layer",
                },
                dp={
                    "noise_multiplier": None,
                    "target_epsilon": 3.0,
                    "delta": 1e-5,
                    "clip_norm": 1.0,
                    "neighbouring": "add-remove",
                },
            ),
        )
    )
    for name in ("ingest", "split", "preprocess", "train"):
        STAGES[name](config)
    certificate = STAGES["certify"](config)["certificate"]
    assert certificate["mechanism"]["trainer"] == "clipless" and not certificate.get("void")
    assert certificate["epsilon"] == pytest.approx(3.0, abs=1e-3) and certificate["epsilon"] <= 3.0 + 1e-9
    metrics = io.read_json(Layout(config).train_metrics)
    assert metrics["train_soundness_passed"] is True
    assert metrics["noise_multiplier"] == pytest.approx(
        certificate["mechanism"]["events"][0]["noise_multiplier"] * 2**0.5
    )
    # A run whose check failed gets no guarantee, and the gate says why.
    io.write_json(
        Layout(config).train_metrics, metrics | {"train_soundness_passed": False, "train_soundness_violations": 3}
    )
    void = STAGES["certify"](config)["certificate"]
    assert void["void"] and void["epsilon"] == float("inf") and "soundness check" in void["statement"]


def image_data(n: int = 400, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """1×8×8 images: class 0 is bright on the left half, class 1 on the right; unit-norm inputs."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, size=n)
    x = 0.3 * rng.normal(size=(n, 1, 8, 8))
    x[y == 0, :, :, :4] += 1.0
    x[y == 1, :, :, 4:] += 1.0
    x = x.reshape(n, -1) / np.linalg.norm(x.reshape(n, -1), axis=1, keepdims=True)
    return torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y)


@pytest.mark.parametrize("dense_layer", ["spectral", "bjorck"])
def test_convolutional_clipless_training_passes_its_certified_soundness_check(dense_layer: str) -> None:
    x, y = image_data()
    torch.manual_seed(0)
    spec = LipschitzSpec(
        64, (8,), 2, input_bound=1.0, bias_bound=None, conv=(4,), input_shape=(1, 8, 8), dense_layer=dense_layer
    )
    model = build_lipschitz(spec)
    bounds = clipless_bounds(model, 1.0, LOSS_LIPSCHITZ["tau_cross_entropy"])
    result = train_clipless(
        model,
        x,
        y,
        sample_rate=0.25,
        epochs=10,
        noise_multiplier=0.5,
        noise="per_layer",
        bounds=bounds,
        neighbouring="add-remove",
        loss_fn=tau_cross_entropy(8.0),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        seed=0,
        soundness_records=400,
    )
    assert result.history["soundness_passed"] and result.history["soundness_violations"] == 0
    assert 0 < result.history["soundness_max_ratio"] <= 1
    assert 0.9 < result.history["spectral_norm_max"] <= 1 + 1e-6  # certified (FFT bound for the convolution)
    assert float((model(x).argmax(1) == y).float().mean()) > 0.9


def test_convolutional_clipless_pipeline_logs_certified_robustness(workdir: Path) -> None:
    """model.conv through the config: Algorithm 1 over conv layers, certificate, and robustness in the metrics."""
    from dpml import io
    from dpml.stages import STAGES, Layout

    config = load(
        write_params(
            workdir / "conv.yaml",
            small_params(
                workdir,
                model={
                    "kind": "lipschitz",
                    "conv": [4],
                    "input_shape": [1, 8, 8],
                    "hidden": [16],
                    "bias_bound": None,
                    "dense_layer": "bjorck",
                },
                train={
                    "algorithm": "clipless",
                    "loss": "hinge_kantorovich_rubinstein",
                    "loss_alpha": 4.0,
                    "epochs": 2,
                    "learning_rate": 0.01,
                    "optimizer": "adam",
                },
                dp={"noise_multiplier": 1.0, "delta": 1e-5, "clip_norm": 1.0, "neighbouring": "add-remove"},
            ),
        )
    )
    for name in ("ingest", "split", "preprocess", "train"):
        STAGES[name](config)
    certificate = STAGES["certify"](config)["certificate"]
    assert not certificate.get("void")
    metrics = io.read_json(Layout(config).train_metrics)
    assert metrics["train_soundness_passed"] is True
    radii = [metrics[f"robust_certified_accuracy_r{k}"] for k in (0, 1, 2, 4, 8, 16)]
    assert radii[0] == pytest.approx(metrics["test_accuracy"], abs=1e-9)
    assert all(a >= b for a, b in zip(radii, radii[1:], strict=False))
    assert 0 < metrics["robust_lipschitz"] <= 1 + 1e-5
    with pytest.raises(ConfigError, match="conv channels"):
        load(
            write_params(
                workdir / "bad.yaml",
                small_params(
                    workdir,
                    model={"kind": "lipschitz", "conv": [3], "input_shape": [1, 8, 8], "hidden": [16]},
                    train={"algorithm": "clipless", "loss": "tau_cross_entropy"},
                    dp={"noise_multiplier": 1.0, "delta": 1e-5, "clip_norm": 1.0, "neighbouring": "add-remove"},
                ),
            )
        )


def test_loss_gradient_clipping_tracks_a_private_quantile_and_is_charged() -> None:
    """Clipped logit gradients, noise scaled by min(L, C_t)/L, the threshold near the quantile, the count charged."""
    from dpml.train.clipless import (
        LossClipping,
        backward_with_clipped_loss_gradient,
        combined_noise_multiplier,
        gradient_noise_for,
    )
    from dpml.train.dpsgd import make_optimizer

    torch.manual_seed(0)
    model = build_lipschitz(LipschitzSpec(10, (16,), 3, input_bound=1.0, bias_bound=0.1))
    x, y = torch.randn(64, 10), torch.randint(0, 3, (64,))
    loss_fn = tau_cross_entropy(4.0)
    # The clipped backward equals the sum of per-example gradients with clipped logit gradients.
    model.zero_grad()
    kept = backward_with_clipped_loss_gradient(model, loss_fn, x, y, threshold=0.5)
    expected = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    for i in range(64):
        logits = model(x[i : i + 1])
        (g,) = torch.autograd.grad(loss_fn(logits, y[i : i + 1]).sum(), logits, retain_graph=True)
        grads = torch.autograd.grad(logits, list(model.parameters()), grad_outputs=g * min(1.0, 0.5 / float(g.norm())))
        for (name, _), grad in zip(model.named_parameters(), grads, strict=True):
            expected[name] += grad
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-6)
    assert 0 < kept < 64
    # Training: the threshold settles where about the target fraction is unclipped; the certificate pays for the count.
    clipping = LossClipping(quantile=0.6, initial=1.4, count_noise=20.0, learning_rate=0.3)
    x, y = torch.randn(2000, 10), torch.randint(0, 3, (2000,))
    model = build_lipschitz(LipschitzSpec(10, (16,), 3, input_bound=1.0, bias_bound=0.1))
    bounds = clipless_bounds(model, 1.0, LOSS_LIPSCHITZ["tau_cross_entropy"])
    result = train_clipless(
        model,
        x,
        y,
        sample_rate=0.2,
        epochs=10,
        noise_multiplier=1.0,
        noise="global",
        bounds=bounds,
        neighbouring="add-remove",
        loss_fn=loss_fn,
        optimizer=make_optimizer(model, "adam", 0.01, 0.0),
        seed=3,
        loss_clipping=clipping,
        loss_lipschitz=LOSS_LIPSCHITZ["tau_cross_entropy"],
    )
    assert 0.45 < result.history["loss_clip_unclipped_fraction"] < 0.75
    assert result.history["loss_clip_final_threshold"] < LOSS_LIPSCHITZ["tau_cross_entropy"]
    event = result.mechanism.events[0]
    assert event.noise_multiplier == pytest.approx(1 / (1 + 20.0**-2) ** 0.5)  # (σ⁻² + σ_b⁻²)^(−1/2)
    assert gradient_noise_for(combined_noise_multiplier(1.3, 20.0), 20.0) == pytest.approx(1.3)
    with pytest.raises(ValueError, match="loss_clip_count_noise"):
        gradient_noise_for(2.0, 1.5)


def test_loss_clipping_through_the_pipeline_is_calibrated_to_the_target(workdir: Path) -> None:
    from dpml import io
    from dpml.stages import STAGES, Layout

    config = load(
        write_params(
            workdir / "lc.yaml",
            small_params(
                workdir,
                model={"kind": "lipschitz", "hidden": [32], "bias_bound": 0.5},
                train={
                    "algorithm": "clipless",
                    "loss": "tau_cross_entropy",
                    "loss_tau": 8.0,
                    "epochs": 4,
                    "learning_rate": 0.01,
                    "optimizer": "adam",
                    "loss_clip_quantile": 0.8,
                    "loss_clip_count_noise": 30.0,
                },
                dp={
                    "noise_multiplier": None,
                    "target_epsilon": 2.0,
                    "delta": 1e-5,
                    "clip_norm": 1.0,
                    "neighbouring": "add-remove",
                },
            ),
        )
    )
    for name in ("ingest", "split", "preprocess", "train"):
        STAGES[name](config)
    certificate = STAGES["certify"](config)["certificate"]
    assert certificate["epsilon"] == pytest.approx(2.0, abs=1e-3) and certificate["epsilon"] <= 2.0 + 1e-9
    assert any("quantile" in note for note in certificate["mechanism"]["notes"])
    metrics = io.read_json(Layout(config).train_metrics)
    event_sigma = certificate["mechanism"]["events"][0]["noise_multiplier"]
    # the gradient's σ (metrics) is above the event's: the count's noise shares the step's budget
    assert metrics["noise_multiplier"] == pytest.approx((event_sigma**-2 - 30.0**-2) ** -0.5)
    assert 0 < metrics["train_loss_clip_unclipped_fraction"] < 1
