"""The Eq. 74 estimate of noisy GD's KL privacy loss (Ye et al., seed 000): neighbour gradient
differences Δ = ∇L(D) − ∇L(D') for probe records, from per-example gradients (factored for linear
layers, materialised otherwise), and their running sums. Overview and formulas: :mod:`dpml.train.noisygd`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap


LOSSES = ("cross_entropy", "logistic")
RELATIONS = ("remove_one", "add_one", "replace_one")
KL_LABEL = (
    "estimated KL privacy loss (Ye et al. Thm 3.1/E.1, Eq. 74) along the one trajectory trained on D, "
    "at the probe neighbours only: an estimate, not a certificate"
)
KL_CONVENTION = (
    "cumulative[k] = Σ_{j≤k} η‖∇L(W_j;D) − ∇L(W_j;D')‖²/(2σ²) (after k + 1 steps): the paper's "
    "constant 1/(2σ²), a factor 2 above the exact per-step Gaussian KL η‖Δ‖²/(4σ²) of the update "
    "W − η∇L + sqrt(2ησ²)Z"
)
PROBE_CHUNK = 64  # per-example gradients are formed this many at a time


def _require_positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} = {value!r}: must be a finite number > 0")


def per_example_loss(outputs: torch.Tensor, y: torch.Tensor, loss: str) -> torch.Tensor:
    """ℓ_i: softmax cross-entropy on o ≥ 2 logits, or logistic log(1 + exp(−s f)) with s = 2y − 1 ∈ {±1}, o = 1."""
    if loss == "cross_entropy":
        return F.cross_entropy(outputs, y, reduction="none")
    if loss == "logistic":
        sign = 2.0 * y.to(outputs.dtype) - 1.0
        return F.softplus(-sign * outputs.reshape(-1))
    raise ValueError(f"loss = {loss!r}: expected one of {', '.join(LOSSES)}")


def check_loss_targets(loss: str, outputs: int, y: torch.Tensor) -> None:
    """Raise ValueError unless ``y`` and the network's ``outputs`` suit ``loss``."""
    if loss == "cross_entropy":
        if outputs < 2:
            raise ValueError(f"loss = 'cross_entropy' with {outputs} network output(s): needs o ≥ 2 (use 'logistic')")
        if y.dtype.is_floating_point or (y.numel() and (int(y.min()) < 0 or int(y.max()) >= outputs)):
            raise ValueError(f"labels for 'cross_entropy': must be integer classes in [0, {outputs})")
    elif loss == "logistic":
        if outputs != 1:
            raise ValueError(f"loss = 'logistic' with {outputs} network outputs: needs exactly o = 1")
        if y.numel() and not bool(((y == 0) | (y == 1)).all()):
            raise ValueError("labels for 'logistic': must be 0 or 1 (mapped to −1 and +1)")
    else:
        raise ValueError(f"loss = {loss!r}: expected one of {', '.join(LOSSES)}")


def mean_loss_and_gradient(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str
) -> tuple[float, list[torch.Tensor]]:
    """L(W; D) = (1/n) Σ ℓ_i and ∇L(W; D), one tensor per parameter of ``model``."""
    params = list(model.parameters())
    value = per_example_loss(model(x), y, loss).mean()
    return float(value.detach()), list(torch.autograd.grad(value, params))


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate per-parameter tensors into one vector (``model.parameters()`` order)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def per_example_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str) -> torch.Tensor:
    """(b, P) matrix of flattened ∇_W ℓ(f_W(x_i), y_i), one row per record (``torch.func.vmap`` of ``grad``).

    Materialises b·P numbers: meant for a few records (tests, small models); :func:`neighbour_squared_gaps`
    avoids it for networks made of ``nn.Linear`` layers.
    """
    names = [name for name, _ in model.named_parameters()]
    params = {name: p.detach() for name, p in model.named_parameters()}

    def one_loss(values: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return per_example_loss(functional_call(model, values, (xi.unsqueeze(0),)), yi.unsqueeze(0), loss).sum()

    rows = []
    for start in range(0, x.shape[0], PROBE_CHUNK):
        grads = vmap(grad(one_loss), in_dims=(None, 0, 0))(
            params, x[start : start + PROBE_CHUNK], y[start : start + PROBE_CHUNK]
        )
        rows.append(torch.cat([grads[name].reshape(grads[name].shape[0], -1) for name in names], dim=1))
    if not rows:
        return torch.zeros(0, sum(p.numel() for p in params.values()), dtype=x.dtype, device=x.device)
    return torch.cat(rows)


# ----------------------------------------------------------------------------- neighbour gradient gaps


def remove_one_difference(mean_gradient: torch.Tensor, removed_gradients: torch.Tensor, n: int) -> torch.Tensor:
    """∇L(D) − ∇L(D \\ {z_j}) = (g_j − ḡ)/(n − 1) for each row g_j (mean losses over n and n − 1 records)."""
    if n < 2:
        raise ValueError(f"n = {n}: remove-one needs at least 2 records")
    return (removed_gradients - mean_gradient) / (n - 1)


def add_one_difference(mean_gradient: torch.Tensor, added_gradients: torch.Tensor, n: int) -> torch.Tensor:
    """∇L(D) − ∇L(D ∪ {z'}) = (ḡ − g')/(n + 1) for each row g' (mean losses over n and n + 1 records)."""
    if n < 1:
        raise ValueError(f"n = {n}: must be ≥ 1")
    return (mean_gradient - added_gradients) / (n + 1)


def replace_one_difference(removed_gradient: torch.Tensor, added_gradients: torch.Tensor, n: int) -> torch.Tensor:
    """∇L(D) − ∇L(D \\ {z_j} ∪ {z'}) = (g_j − g')/n for one removed g_j and each row g'."""
    if n < 1:
        raise ValueError(f"n = {n}: must be ≥ 1")
    return (removed_gradient - added_gradients) / n


def squared_norms(rows: torch.Tensor) -> torch.Tensor:
    """‖row‖² for each row, in float64."""
    return rows.double().pow(2).sum(dim=-1)


def estimated_kl(squared_gaps: torch.Tensor | Sequence[float], learning_rate: float, sigma: float) -> torch.Tensor:
    """Eq. 74 for one trajectory: (η/(2σ²)) Σ_k ‖∇L(W_k; D) − ∇L(W_k; D')‖², summed over the last axis.

    ``squared_gaps[..., k]`` = ‖Δ_k‖² at step k; an *estimate* (one run, the paper's conservative
    constant 1/(2σ²)), never a certificate. Averaging it over runs estimates the expectation of Eq. 74.
    """
    _require_positive("learning_rate", learning_rate)
    _require_positive("sigma", sigma)
    gaps = torch.as_tensor(squared_gaps, dtype=torch.float64)
    if bool((gaps < 0).any()):
        raise ValueError("squared_gaps: squared norms must be ≥ 0")
    return gaps.sum(dim=-1) * learning_rate / (2.0 * sigma * sigma)


# -------------------------------------------------------------------------------------- probe records


@dataclass(frozen=True)
class KLPairs:
    """Probe neighbours for the estimated KL of :func:`train_noisy_gd`.

    ``removed``: indices into the training set (remove-one probes D \\ {z_j}; replace-one's removed
    side). ``added_x`` / ``added_y``: records outside D, e.g. held-out (add-one probes D ∪ {z'};
    replace-one's added side). ``relations``: which of remove_one, add_one, replace_one to track;
    replace-one takes every (removed, added) pair.
    """

    removed: torch.Tensor | None = None
    added_x: torch.Tensor | None = None
    added_y: torch.Tensor | None = None
    relations: tuple[str, ...] = RELATIONS

    def __post_init__(self) -> None:
        unknown = [r for r in self.relations if r not in RELATIONS]
        if unknown or not self.relations:
            raise ValueError(f"relations = {self.relations!r}: must be a non-empty subset of {', '.join(RELATIONS)}")
        if (self.added_x is None) != (self.added_y is None):
            raise ValueError("added_x and added_y: give both or neither")
        if self.added_x is not None and self.added_y is not None and self.added_x.shape[0] != self.added_y.shape[0]:
            raise ValueError(f"added_x has {self.added_x.shape[0]} rows but added_y {self.added_y.shape[0]}")
        needs_removed = {"remove_one", "replace_one"} & set(self.relations)
        needs_added = {"add_one", "replace_one"} & set(self.relations)
        if needs_removed and (self.removed is None or self.removed.numel() == 0):
            raise ValueError(f"removed: needed (non-empty) for {', '.join(sorted(needs_removed))}")
        if needs_added and (self.added_x is None or self.added_x.shape[0] == 0):
            raise ValueError(f"added_x / added_y: needed (non-empty) for {', '.join(sorted(needs_added))}")

    def check_against(self, n: int) -> None:
        """Raise ValueError unless the removed indices are distinct positions in a training set of n records."""
        if self.removed is None:
            return
        if self.removed.dtype.is_floating_point or self.removed.dim() != 1:
            raise ValueError("removed: must be a 1-d integer tensor of training-set indices")
        if self.removed.numel() and (int(self.removed.min()) < 0 or int(self.removed.max()) >= n):
            raise ValueError(f"removed: indices must lie in [0, {n})")
        if torch.unique(self.removed).numel() != self.removed.numel():
            raise ValueError("removed: indices must be distinct")


class LinearFactors:
    """Per-example gradients of a network whose parameters all belong to ``nn.Linear`` layers, in factored form.

    For a layer u = W h + b applied once to a batch, the gradient of record i's loss is
    ∇_W ℓ_i = δ_i h_iᵀ and ∇_b ℓ_i = δ_i with δ_i = ∂ℓ_i/∂u_i. So, per layer and summed over layers,

        ‖g_i‖² = Σ_l ‖δ_{l,i}‖² (‖h_{l,i}‖² + [bias]),      ⟨g_i, ḡ⟩ = Σ_l δ_{l,i}ᵀ (Ḡ_l h_{l,i} + [b̄_l]),
        ⟨g_i, g'_j⟩ = Σ_l (δ_{l,i}ᵀ δ'_{l,j}) (h_{l,i}ᵀ h'_{l,j} + [1]),

    exact, without ever forming the b × P matrix of per-example gradients (the "ghost norm" identity).
    Products are formed in the model's dtype and summed in float64.
    Valid when each record's output depends only on its own row (no batch-coupling layer): the
    tests compare it with :func:`per_example_gradients`.
    """

    def __init__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str) -> None:
        layers = linear_layers(model)
        if layers is None:
            raise ValueError(f"model {type(model).__name__}: not every parameter belongs to an nn.Linear layer")
        self.layers = layers
        inputs: dict[int, list[torch.Tensor]] = {}
        outputs: dict[int, list[torch.Tensor]] = {}

        def tap(module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            inputs.setdefault(id(module), []).append(args[0].detach())
            outputs.setdefault(id(module), []).append(output)

        handles = [layer.register_forward_hook(tap) for layer in layers]
        try:
            with torch.enable_grad():
                total = per_example_loss(model(x), y, loss).sum()
        finally:
            for handle in handles:
                handle.remove()
        if any(len(inputs.get(id(layer), [])) != 1 or inputs[id(layer)][0].dim() != 2 for layer in layers):
            raise ValueError("LinearFactors: every nn.Linear must be applied exactly once to a (batch, features) input")
        deltas = torch.autograd.grad(total, [outputs[id(layer)][0] for layer in layers], allow_unused=True)
        self.h = [inputs[id(layer)][0] for layer in layers]
        self.delta = [
            torch.zeros_like(outputs[id(layer)][0]) if d is None else d.detach()
            for layer, d in zip(layers, deltas, strict=True)
        ]

    def squared_norms(self) -> torch.Tensor:
        """‖g_i‖² per record."""
        out = torch.zeros(self.h[0].shape[0], dtype=torch.float64, device=self.h[0].device)
        for layer, h, d in zip(self.layers, self.h, self.delta, strict=True):
            out += d.pow(2).sum(1).double() * (h.pow(2).sum(1).double() + (1.0 if layer.bias is not None else 0.0))
        return out

    def inner_with(self, gradient: dict[int, torch.Tensor]) -> torch.Tensor:
        """⟨g_i, ḡ⟩ per record, ḡ given per parameter (keyed by ``id(parameter)``)."""
        out = torch.zeros(self.h[0].shape[0], dtype=torch.float64, device=self.h[0].device)
        for layer, h, d in zip(self.layers, self.h, self.delta, strict=True):
            out += (d * (h @ gradient[id(layer.weight)].T)).sum(1).double()
            if layer.bias is not None:
                out += (d @ gradient[id(layer.bias)]).double()
        return out

    def gram_with(self, other: "LinearFactors") -> torch.Tensor:
        """⟨g_i, g'_j⟩ for every record i here and j of ``other`` (same network)."""
        out = torch.zeros(self.h[0].shape[0], other.h[0].shape[0], dtype=torch.float64, device=self.h[0].device)
        for layer, h, d, h2, d2 in zip(self.layers, self.h, self.delta, other.h, other.delta, strict=True):
            out += (d @ d2.T).double() * ((h @ h2.T).double() + (1.0 if layer.bias is not None else 0.0))
        return out


def linear_layers(model: nn.Module) -> list[nn.Linear] | None:
    """The model's ``nn.Linear`` layers when they own every parameter, else None."""
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    owned = {id(p) for layer in layers for p in layer.parameters(recurse=False)}
    if not layers or any(id(p) not in owned for p in model.parameters()):
        return None
    return layers


def neighbour_squared_gaps(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss: str,
    mean_gradient: Sequence[torch.Tensor],
    pairs: KLPairs,
    method: str = "auto",
) -> dict[str, torch.Tensor]:
    """‖∇L(W; D) − ∇L(W; D')‖² for every probe neighbour D' of ``pairs``, per tracked relation.

    ``mean_gradient`` is ∇L(W; D) per parameter (the step's gradient). Remove-one and add-one give
    one value per probe record; replace-one one per (removed, added) pair, removed-major. Uses
    :class:`LinearFactors` when every parameter is an ``nn.Linear``'s (cheap at any probe count), else
    per-example gradients by ``torch.func`` (for a few probes: e.g. :class:`LinearisedNetwork`);
    ``method`` = "factored" or "materialised" forces one of the two.
    """
    if method not in ("auto", "factored", "materialised"):
        raise ValueError(f"method = {method!r}: expected 'auto', 'factored' or 'materialised'")
    n = x.shape[0]
    relations = set(pairs.relations)
    removed_x = removed_y = added_x = added_y = None
    if relations & {"remove_one", "replace_one"}:
        assert pairs.removed is not None
        index = pairs.removed.to(x.device)
        removed_x, removed_y = x[index], y[index]
    if relations & {"add_one", "replace_one"}:
        assert pairs.added_x is not None and pairs.added_y is not None
        added_x, added_y = pairs.added_x.to(x.device, x.dtype), pairs.added_y.to(y.device)
    params = list(model.parameters())
    if method == "factored" or (method == "auto" and linear_layers(model) is not None):
        return _factored_gaps(
            model,
            loss,
            dict(zip(map(id, params), mean_gradient, strict=True)),
            n,
            relations,
            removed_x,
            removed_y,
            added_x,
            added_y,
        )
    return _materialised_gaps(model, loss, flatten(mean_gradient), n, relations, removed_x, removed_y, added_x, added_y)


def _factored_gaps(
    model: nn.Module,
    loss: str,
    mean: dict[int, torch.Tensor],
    n: int,
    relations: set[str],
    removed_x: torch.Tensor | None,
    removed_y: torch.Tensor | None,
    added_x: torch.Tensor | None,
    added_y: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    mean_sq = sum(float(g.double().pow(2).sum()) for g in mean.values())
    out: dict[str, torch.Tensor] = {}
    removed = added = None
    if removed_x is not None and removed_y is not None:
        removed = [
            LinearFactors(model, removed_x[i : i + 4 * PROBE_CHUNK], removed_y[i : i + 4 * PROBE_CHUNK], loss)
            for i in range(0, removed_x.shape[0], 4 * PROBE_CHUNK)
        ]
    if added_x is not None and added_y is not None:
        added = [
            LinearFactors(model, added_x[i : i + 4 * PROBE_CHUNK], added_y[i : i + 4 * PROBE_CHUNK], loss)
            for i in range(0, added_x.shape[0], 4 * PROBE_CHUNK)
        ]
    if "remove_one" in relations and removed is not None:  # ‖g_j − ḡ‖²/(n − 1)²
        out["remove_one"] = (
            torch.cat([(f.squared_norms() - 2 * f.inner_with(mean) + mean_sq).clamp_min(0) for f in removed])
            / (n - 1) ** 2
        )
    if "add_one" in relations and added is not None:  # ‖ḡ − g'‖²/(n + 1)²
        out["add_one"] = (
            torch.cat([(f.squared_norms() - 2 * f.inner_with(mean) + mean_sq).clamp_min(0) for f in added])
            / (n + 1) ** 2
        )
    if "replace_one" in relations and removed is not None and added is not None:  # ‖g_j − g'‖²/n²
        added_sq = torch.cat([f.squared_norms() for f in added])
        blocks = []
        for f in removed:
            gram = torch.cat([f.gram_with(a) for a in added], dim=1)
            blocks.append((f.squared_norms()[:, None] + added_sq[None, :] - 2 * gram).clamp_min(0).reshape(-1))
        out["replace_one"] = torch.cat(blocks) / n**2
    return out


def _materialised_gaps(
    model: nn.Module,
    loss: str,
    mean: torch.Tensor,
    n: int,
    relations: set[str],
    removed_x: torch.Tensor | None,
    removed_y: torch.Tensor | None,
    added_x: torch.Tensor | None,
    added_y: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    added = None
    if added_x is not None and added_y is not None:
        added = per_example_gradients(model, added_x, added_y, loss)
        if "add_one" in relations:
            out["add_one"] = squared_norms(add_one_difference(mean, added, n))
    if removed_x is not None and removed_y is not None:
        remove_rows: list[torch.Tensor] = []
        replace_rows: list[torch.Tensor] = []
        for start in range(0, removed_x.shape[0], PROBE_CHUNK):
            chunk = per_example_gradients(
                model, removed_x[start : start + PROBE_CHUNK], removed_y[start : start + PROBE_CHUNK], loss
            )
            if "remove_one" in relations:
                remove_rows.append(squared_norms(remove_one_difference(mean, chunk, n)))
            if "replace_one" in relations and added is not None:
                replace_rows.extend(squared_norms(replace_one_difference(g, added, n)) for g in chunk)
        if remove_rows:
            out["remove_one"] = torch.cat(remove_rows)
        if replace_rows:
            out["replace_one"] = torch.cat(replace_rows)
    return out


@dataclass
class _GapRecorder:
    """Collects ‖Δ_k‖² per probe and per relation along the trajectory."""

    pairs: KLPairs
    x: torch.Tensor
    y: torch.Tensor
    loss: str
    gaps: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def record(self, model: nn.Module, mean_gradient: Sequence[torch.Tensor]) -> None:
        step = neighbour_squared_gaps(model, self.x, self.y, self.loss, mean_gradient, self.pairs)
        for relation, values in step.items():
            self.gaps.setdefault(relation, []).append(values.cpu())

    def summary(self, learning_rate: float, sigma: float) -> dict[str, Any]:
        """Per relation: per-step worst / mean over probes and the cumulative Eq. 74 sums (worst / mean probe)."""
        out: dict[str, Any] = {"label": KL_LABEL, "convention": KL_CONVENTION}
        for relation, per_step in self.gaps.items():
            gaps = torch.stack(per_step, dim=1)  # (probes, K)
            step_kl = gaps * learning_rate / (2.0 * sigma * sigma)
            cumulative = step_kl.cumsum(dim=1)
            out[relation] = {
                "probes": int(gaps.shape[0]),
                "step_worst": step_kl.max(dim=0).values.tolist(),
                "step_mean": step_kl.mean(dim=0).tolist(),
                "cumulative_worst": cumulative.max(dim=0).values.tolist(),
                "cumulative_mean": cumulative.mean(dim=0).tolist(),
                "final_per_probe": estimated_kl(gaps, learning_rate, sigma).tolist(),
            }
        return out
