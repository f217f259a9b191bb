"""Noisy full-batch gradient descent without clipping, and its *estimated* KL privacy loss (seed 000).

**The algorithm** (Ye et al., *Initialization Matters*, App. E, Thm E.1): for K steps,

    W_{k+1} = W_k − η ∇L(W_k; D) + sqrt(2ησ²) · Z_k,      Z_k ~ N(0, I),

full batch, no clipping, L(W; D) = (1/n) Σ_i ℓ(f_W(x_i), y_i) the *mean* loss over the n records.
It is the Euler discretisation of the Langevin diffusion dW = −∇L dt + sqrt(2σ²) dB (Eq. 4).
Z_k is drawn from the caller's generator (which must be secret-seeded), parameter by parameter in
``model.parameters()`` order, after the step's gradient is computed.

**Estimated KL** (Thm 3.1 / E.1, Eq. 74). For neighbouring D, D', the KL divergence between the
trajectories of noisy GD on D and on D' is

    KL(W_{1:K} ‖ W'_{1:K}) = (1/(2σ²)) Σ_{k=0}^{K−1} η · E‖∇L(W_k; D) − ∇L(W_k; D')‖²,

the expectation over the trajectory on D. :func:`train_noisy_gd` evaluates the sum along the one
trajectory it trains (one sample of the expectation; the paper averages over runs) for a few probe
neighbours, with the paper's constant 1/(2σ²). (For the update as written the exact per-step KL of
two Gaussians N(μ, 2ησ²I), N(μ', 2ησ²I) with μ − μ' = −ηΔ is η‖Δ‖²/(4σ²): the paper's constant is
conservative by a factor 2; it is kept, so numbers compare with the paper's.) Such numbers are
**estimates** of the privacy loss at the probes, not certificates: they hold for neither the worst
neighbour nor the expectation. The only closed-form certificate is Cor. 4.2 for the *linearised*
network, :func:`dpml.privacy.kl.kl_bound`.

**Neighbour gradient differences** Δ = ∇L(D) − ∇L(D') from the step's ∇L(D) = ḡ and per-example
gradients g of the probe records, with mean losses over n and |D'| records:

    remove-one  D' = D \\ {z_j}:          L(D') = (n L(D) − ℓ_j)/(n − 1)  ⇒  Δ = (g_j − ḡ)/(n − 1)
    add-one     D' = D ∪ {z'}:            L(D') = (n L(D) + ℓ')/(n + 1)   ⇒  Δ = (ḡ − g')/(n + 1)
    replace-one D' = D \\ {z_j} ∪ {z'}:    L(D') = L(D) + (ℓ' − ℓ_j)/n      ⇒  Δ = (g_j − g')/n

**The linearised network** (Eq. 3): f_lin(W) = f(W0) + J(W0)(W − W0), evaluated with one forward-mode
Jacobian-vector product at W0 (``torch.func.jvp``); Cor. 4.2's certificate is for training it.

The history's losses and KL estimates are computed from the data: they are diagnostics that no
certificate covers.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, jvp, vmap

from dpml.train.dpsgd import progress_range

LOSSES = ("cross_entropy", "logistic")
RELATIONS = ("remove_one", "add_one", "replace_one")
KL_LABEL = ("estimated KL privacy loss (Ye et al. Thm 3.1/E.1, Eq. 74) along the one trajectory trained on D, "
            "at the probe neighbours only: an estimate, not a certificate")
KL_CONVENTION = ("cumulative[k] = Σ_{j≤k} η‖∇L(W_j;D) − ∇L(W_j;D')‖²/(2σ²) (after k + 1 steps): the paper's "
                 "constant 1/(2σ²), a factor 2 above the exact per-step Gaussian KL η‖Δ‖²/(4σ²) of the update "
                 "W − η∇L + sqrt(2ησ²)Z")
PROBE_CHUNK = 64  # per-example gradients are formed this many at a time


# ------------------------------------------------------------------------------------------------ noise


def noisy_gd_step_noise_std(learning_rate: float, sigma: float) -> float:
    """Per-coordinate standard deviation sqrt(2ησ²) of the noise added by one noisy GD step (App. E)."""
    _require_positive("learning_rate", learning_rate)
    _require_positive("sigma", sigma)
    return math.sqrt(2.0 * learning_rate * sigma * sigma)


def _require_positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} = {value!r}: must be a finite number > 0")


# ------------------------------------------------------------------------------------ linearised network


class LinearisedNetwork(nn.Module):
    """f_lin(W; x) = f(W0; x) + J(W0; x)(W − W0): the first-order expansion of ``network`` at W0 (Eq. 3).

    W0 is a snapshot of the network's parameters when wrapped, kept as buffers (``anchor_i``); the
    trainable parameters (``weights.i``, in the network's parameter order) start at W0. The forward
    pass is one Jacobian-vector product ``torch.func.jvp`` at W0 along W − W0, so f_lin is exactly
    affine in W and ∇_W ℓ(f_lin(W; x)) = J(W0; x)ᵀ ∂ℓ/∂f — the model of Thm 4.1 / Cor. 4.2. The
    wrapped network is a private copy (later changes to ``network`` do not affect it); its own
    buffers, if any, are registered here too (``state_i``) so that ``.to()`` moves them.
    """

    def __init__(self, network: nn.Module) -> None:
        super().__init__()
        template = copy.deepcopy(network)
        self._names = [name for name, _ in template.named_parameters()]
        self._buffer_names = [name for name, _ in template.named_buffers()]
        if not self._names:
            raise ValueError(f"network {type(network).__name__}: has no parameters to linearise")
        self.weights = nn.ParameterList([nn.Parameter(p.detach().clone()) for p in template.parameters()])
        for index, p in enumerate(template.parameters()):
            self.register_buffer(f"anchor_{index}", p.detach().clone())
        for index, b in enumerate(template.buffers()):
            self.register_buffer(f"state_{index}", b.detach().clone())
        self._template = (template,)  # a tuple: not registered as a submodule, so its parameters stay out

    def anchor(self) -> list[torch.Tensor]:
        """W0, in the network's parameter order."""
        return [getattr(self, f"anchor_{i}") for i in range(len(self._names))]

    def network_at(self, values: Sequence[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """The wrapped network f(W; x) with its parameters set to ``values`` (no copy of the module)."""
        state = dict(zip(self._names, values))
        state |= {name: getattr(self, f"state_{i}") for i, name in enumerate(self._buffer_names)}
        return functional_call(self._template[0], state, (x,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        anchor = tuple(self.anchor())
        direction = tuple(w - w0 for w, w0 in zip(self.weights, anchor))
        value, derivative = jvp(lambda *values: self.network_at(values, x), anchor, direction)
        return value + derivative


# ------------------------------------------------------------------------------------------------- loss


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


def mean_loss_and_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                           loss: str) -> tuple[float, list[torch.Tensor]]:
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
        grads = vmap(grad(one_loss), in_dims=(None, 0, 0))(params, x[start:start + PROBE_CHUNK],
                                                            y[start:start + PROBE_CHUNK])
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
        if self.removed.unique().numel() != self.removed.numel():
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
        self.delta = [torch.zeros_like(outputs[id(layer)][0]) if d is None else d.detach()
                      for layer, d in zip(layers, deltas)]

    def squared_norms(self) -> torch.Tensor:
        """‖g_i‖² per record."""
        out = torch.zeros(self.h[0].shape[0], dtype=torch.float64, device=self.h[0].device)
        for layer, h, d in zip(self.layers, self.h, self.delta):
            out += d.pow(2).sum(1).double() * (h.pow(2).sum(1).double() + (1.0 if layer.bias is not None else 0.0))
        return out

    def inner_with(self, gradient: dict[int, torch.Tensor]) -> torch.Tensor:
        """⟨g_i, ḡ⟩ per record, ḡ given per parameter (keyed by ``id(parameter)``)."""
        out = torch.zeros(self.h[0].shape[0], dtype=torch.float64, device=self.h[0].device)
        for layer, h, d in zip(self.layers, self.h, self.delta):
            out += (d * (h @ gradient[id(layer.weight)].T)).sum(1).double()
            if layer.bias is not None:
                out += (d @ gradient[id(layer.bias)]).double()
        return out

    def gram_with(self, other: "LinearFactors") -> torch.Tensor:
        """⟨g_i, g'_j⟩ for every record i here and j of ``other`` (same network)."""
        out = torch.zeros(self.h[0].shape[0], other.h[0].shape[0], dtype=torch.float64, device=self.h[0].device)
        for layer, h, d, h2, d2 in zip(self.layers, self.h, self.delta, other.h, other.delta):
            out += (d @ d2.T).double() * ((h @ h2.T).double() + (1.0 if layer.bias is not None else 0.0))
        return out


def linear_layers(model: nn.Module) -> list[nn.Linear] | None:
    """The model's ``nn.Linear`` layers when they own every parameter, else None."""
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    owned = {id(p) for layer in layers for p in layer.parameters(recurse=False)}
    if not layers or any(id(p) not in owned for p in model.parameters()):
        return None
    return layers


def neighbour_squared_gaps(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str,
                           mean_gradient: Sequence[torch.Tensor], pairs: KLPairs,
                           method: str = "auto") -> dict[str, torch.Tensor]:
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
        return _factored_gaps(model, loss, dict(zip(map(id, params), mean_gradient)), n, relations,
                              removed_x, removed_y, added_x, added_y)
    return _materialised_gaps(model, loss, flatten(mean_gradient), n, relations, removed_x, removed_y, added_x, added_y)


def _factored_gaps(model: nn.Module, loss: str, mean: dict[int, torch.Tensor], n: int, relations: set[str],
                   removed_x: torch.Tensor | None, removed_y: torch.Tensor | None,
                   added_x: torch.Tensor | None, added_y: torch.Tensor | None) -> dict[str, torch.Tensor]:
    mean_sq = sum(float(g.double().pow(2).sum()) for g in mean.values())
    out: dict[str, torch.Tensor] = {}
    removed = added = None
    if removed_x is not None and removed_y is not None:
        removed = [LinearFactors(model, removed_x[i:i + 4 * PROBE_CHUNK], removed_y[i:i + 4 * PROBE_CHUNK], loss)
                   for i in range(0, removed_x.shape[0], 4 * PROBE_CHUNK)]
    if added_x is not None and added_y is not None:
        added = [LinearFactors(model, added_x[i:i + 4 * PROBE_CHUNK], added_y[i:i + 4 * PROBE_CHUNK], loss)
                 for i in range(0, added_x.shape[0], 4 * PROBE_CHUNK)]
    if "remove_one" in relations and removed is not None:  # ‖g_j − ḡ‖²/(n − 1)²
        out["remove_one"] = torch.cat([(f.squared_norms() - 2 * f.inner_with(mean) + mean_sq).clamp_min(0)
                                       for f in removed]) / (n - 1) ** 2
    if "add_one" in relations and added is not None:  # ‖ḡ − g'‖²/(n + 1)²
        out["add_one"] = torch.cat([(f.squared_norms() - 2 * f.inner_with(mean) + mean_sq).clamp_min(0)
                                    for f in added]) / (n + 1) ** 2
    if "replace_one" in relations and removed is not None and added is not None:  # ‖g_j − g'‖²/n²
        added_sq = torch.cat([f.squared_norms() for f in added])
        blocks = []
        for f in removed:
            gram = torch.cat([f.gram_with(a) for a in added], dim=1)
            blocks.append((f.squared_norms()[:, None] + added_sq[None, :] - 2 * gram).clamp_min(0).reshape(-1))
        out["replace_one"] = torch.cat(blocks) / n ** 2
    return out


def _materialised_gaps(model: nn.Module, loss: str, mean: torch.Tensor, n: int, relations: set[str],
                       removed_x: torch.Tensor | None, removed_y: torch.Tensor | None,
                       added_x: torch.Tensor | None, added_y: torch.Tensor | None) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    added = None
    if added_x is not None and added_y is not None:
        added = per_example_gradients(model, added_x, added_y, loss)
        if "add_one" in relations:
            out["add_one"] = squared_norms(add_one_difference(mean, added, n))
    if removed_x is not None and removed_y is not None:
        remove_rows, replace_rows = [], []
        for start in range(0, removed_x.shape[0], PROBE_CHUNK):
            chunk = per_example_gradients(model, removed_x[start:start + PROBE_CHUNK],
                                          removed_y[start:start + PROBE_CHUNK], loss)
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


# --------------------------------------------------------------------------------------------- trainer


@dataclass
class NoisyGdResult:
    """The trained model (trained in place) and its history.

    history keys: ``steps``, ``seconds``, ``n``, ``learning_rate``, ``sigma``, ``noise_std``, ``loss_function``,
    ``initial_loss`` (L(W_0; D)), ``final_loss`` (L(W_K; D)), and with probes ``kl_estimate``:
    {``label``, ``convention``, and per tracked relation {``probes``, ``step_worst``, ``step_mean``,
    ``cumulative_worst``, ``cumulative_mean`` (lists of K floats; entry k covers steps 0..k),
    ``final_per_probe``}}.
    """

    model: nn.Module
    history: dict[str, Any] = field(default_factory=dict)


def train_noisy_gd(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, learning_rate: float, sigma: float,
                   steps: int, loss: str, generator: torch.Generator, kl_pairs: KLPairs | None = None,
                   progress: bool = False) -> NoisyGdResult:
    """Train ``model`` in place by K = ``steps`` noisy GD steps W ← W − η∇L(W; D) + sqrt(2ησ²)·Z (App. E).

    Full batch, no clipping, L the mean of ``loss`` over the n records. Z comes from ``generator``
    (secret-seeded by the caller). With ``kl_pairs``, each step also records the Eq. 74 terms
    η‖∇L(W_k; D) − ∇L(W_k; D')‖²/(2σ²) for the probe neighbours, evaluated at W_k before the update
    (labelled *estimated* in the history).
    """
    _require_positive("learning_rate", learning_rate)
    _require_positive("sigma", sigma)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"steps = {steps!r}: must be an integer ≥ 0")
    if loss not in LOSSES:
        raise ValueError(f"loss = {loss!r}: expected one of {', '.join(LOSSES)}")
    if x.dim() < 2 or x.shape[0] != y.shape[0] or x.shape[0] == 0:
        raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)}: need n ≥ 1 matching rows")
    params = list(model.parameters())
    if not params:
        raise ValueError(f"model {type(model).__name__}: has no parameters")
    x = x.to(device=params[0].device, dtype=params[0].dtype)
    y = y.to(params[0].device)
    with torch.no_grad():
        outputs = model(x[:1]).shape[-1]
    check_loss_targets(loss, outputs, y)
    recorder = None
    if kl_pairs is not None:
        kl_pairs.check_against(x.shape[0])
        recorder = _GapRecorder(kl_pairs, x, y, loss)
    noise_std = noisy_gd_step_noise_std(learning_rate, sigma)
    start = time.perf_counter()
    losses = []
    for _ in progress_range(steps, "noisy GD", "step", progress):
        value, grads = mean_loss_and_gradient(model, x, y, loss)
        losses.append(value)
        if recorder is not None:
            recorder.record(model, [g.detach() for g in grads])
        noisy_gd_update(params, grads, learning_rate, noise_std, generator)
    with torch.no_grad():
        final = float(per_example_loss(model(x), y, loss).mean())
    history: dict[str, Any] = {
        "steps": steps, "n": int(x.shape[0]), "learning_rate": learning_rate, "sigma": sigma,
        "noise_std": noise_std, "loss_function": loss, "initial_loss": losses[0] if losses else final, "final_loss": final,
        "seconds": time.perf_counter() - start,
    }
    if recorder is not None:
        history["kl_estimate"] = recorder.summary(learning_rate, sigma)
    return NoisyGdResult(model, history)


def noisy_gd_update(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], learning_rate: float,
                    noise_std: float, generator: torch.Generator) -> None:
    """In place: W ← W − η g + noise_std · Z, Z ~ N(0, I) from ``generator`` (drawn on its device, per parameter)."""
    with torch.no_grad():
        for p, g in zip(params, grads):
            noise = torch.randn(p.shape, generator=generator, device=generator.device, dtype=p.dtype)
            p.add_(g, alpha=-learning_rate)
            p.add_(noise.to(p.device), alpha=noise_std)
