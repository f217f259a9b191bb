"""Products written as index equations, a parameter S against one activation x: ``torch.einsum`` with two
operands, ``torch.bmm`` with a parameter expanded over the batch (``w.expand(B, n, m)``), a matrix chosen per row
(a mixture of experts' ``W[expert_ids]``: :func:`_matrix_per_row`) or one matrix per head
(the heads first, (H, B·T, n), each example's rows in one run), ``torch.baddbmm`` and ``torch.addbmm`` (decomposed
into the product and a sum), and a matrix product with a parameter of more than two dimensions (per-head weights,
``x @ w`` with x (B, H, T, d) and w (H, d, e)).

z = einsum(x, S) with subscripts X, S, Z, and b = x's batch dimension's subscript (its first, or where the
recorder's example map puts the batch: XLNet's time-major ``ibh,hnd->ibnd``, x read as (b, i, h); or, for a constant x,
the one dimension of the batch's size the plan's probe confirmed: :func:`_constant_batch_axis`). Each example's
z_i depends on x_i and S only, so ∇_S ℓ_i = einsum(x_i, δ_i → S): the same contraction with δ = ∂ℓ/∂z in
place of the other operand, and b kept (Goodfellow 2015, written for any contraction):

- when S is 2-D with one index (p) only in x and the other (q) only in z, every other index of x either b, a
  *position* shared by x and z, or summed in x alone, and every other index of z either b, a position or
  broadcast from x: ∇_S ℓ_i = Σ_t u_{i,t} v_{i,t}ᵀ over the positions t, with u = x summed to (b, t, p) and
  v = δ summed to (b, t, q) — factored, so its norm is a ghost norm or a materialised one, as a linear layer's
  (:mod:`dpml.train.rules.combine`);
- otherwise materialised: einsum(x, δ → b S), B × |S| numbers, refused beyond the device's keep limit.

b indexes S only where S is the same along it (learned queries expanded over the batch, ``q.expand(B, n, d)``:
S_0 is then the parameter every example shares, and b is dropped from S; a parameter indexed by the example is not
shared by the batch), every index of S must appear in x or z, and no operand may repeat an index (a diagonal). An
ellipsis may stand in x and z, not in S.
"""

from __future__ import annotations

import string
from collections.abc import Callable
from typing import Any

import torch

from dpml.train.rules.operands import decomposition, einsum_operands, einsum_subscripts
from dpml.train.rules.ragged import form_of_rows, kept_rows
from dpml.train.rules.flat_indices import same_along
from dpml.train.rules.registry import (
    Call,
    Dense,
    Factored,
    Pending,
    Rows,
    Tracked,
    Use,
    beyond_keep_limit,
    example_runs,
    rule,
)


def _expanded(equation: str, x_dims: int, s_dims: int) -> tuple[str, str, str] | str:
    """('x subscripts', 'S subscripts', 'z subscripts') of a two-operand equation whose first operand is x, with
    x's ellipsis written out in unused letters; or why it cannot be."""
    x_term, _, s_term = equation.replace(" ", "").partition("->")[0].partition(",")
    if "..." in s_term:
        return "a parameter under '...'"
    parsed = einsum_subscripts(equation, (x_dims, s_dims))
    if parsed is None:
        return "subscripts that do not match the operands"
    (x_subs, s_subs), z_subs = parsed
    return x_subs, s_subs, z_subs


def product(
    call: Call, x: torch.Tensor, s: Tracked, subscripts: tuple[str, str, str], merged: int = 1
) -> Pending | str:
    """The use of S in z = einsum(X, S → Z) (module docstring), x the activation; with ``merged`` = H > 1, x's first
    dimension holds the B·H matrices of a batched product example by example (:func:`_shared_by_examples`), and the
    subscripts are those of x and z seen as (B, H, …)."""
    x_subs, s_subs, z_subs = subscripts
    a = x.detach() if merged == 1 else x.detach().unflatten(0, (-1, merged))
    out_shape = call.output.shape if merged == 1 else call.output.unflatten(0, (-1, merged)).shape
    if any(len(set(t)) != len(t) for t in subscripts):
        return "a repeated index (a diagonal)"
    if len(x_subs) != a.dim() or len(s_subs) != len(s.shape()):
        return "subscripts that do not match the operands"
    taken: tuple[torch.Tensor, int] | None = None
    if merged == 1 and not call.batch_first(x):
        axis = call.example_axis(x)
        if axis is None and (axis := _constant_batch_axis(call, x, subscripts, s)) is not None:
            taken = (x, axis[0])
        found = _batch_axis(call, x, a, subscripts, out_shape, axis)
        if isinstance(found, str):
            return found
        a, (x_subs, s_subs, z_subs), out_shape = found
    b = x_subs[0]
    if b in s_subs and (shared := _shared_over(s, s_subs.index(b))) is not None:  # S expanded over the batch
        s, s_subs = shared, s_subs.replace(b, "")
    if b in s_subs or b not in z_subs:
        return "the batch index on the parameter or summed away"
    if any(c not in x_subs and c not in z_subs for c in s_subs):
        return "a parameter index summed alone"
    batch = a.shape[0]
    same_sizes = all(a.shape[x_subs.index(c)] == out_shape[z_subs.index(c)] for c in x_subs if c in z_subs)
    factored = _factored_layout(x_subs, s_subs, z_subs) if same_sizes else None  # (no size-1 broadcast)
    grouped = _per_group(a, s, (x_subs, s_subs, z_subs), out_shape) if same_sizes and factored is None else None
    if grouped is not None:
        return Pending(call.output, [s.param], grouped, taken_as_batch=taken)
    if factored is not None:
        u_subs, v_subs, swapped = factored

        def finish_factored(d: torch.Tensor) -> list[Use]:
            return [(s, _factored(a, d.view(out_shape), (x_subs, z_subs), factored))]

        return Pending(call.output, [s.param], finish_factored, taken_as_batch=taken)
    beyond = beyond_keep_limit(batch, s.shape(), x.device)
    if beyond is not None:
        return beyond

    def finish_dense(d: torch.Tensor) -> list[Use]:
        return [(s, Dense(torch.einsum(f"{x_subs},{z_subs}->{b}{s_subs}", a, d.view(out_shape))))]

    return Pending(call.output, [s.param], finish_dense, taken_as_batch=taken)


def _batch_axis(
    call: Call,
    x: torch.Tensor,
    a: torch.Tensor,
    subscripts: tuple[str, str, str],
    out_shape: torch.Size,
    axis: tuple[int, torch.Tensor] | None,
) -> tuple[torch.Tensor, tuple[str, str, str], torch.Size] | str:
    """x read batch-first: its batch dimension moved first (time-major: XLNet's ``i b h``), or a dimension holding each
    example's rows in one run of k ((H, B·T, d), a per-head product written heads first) split into (B, k) first, the
    run's new letter kept by z too; with the subscripts and z's shape to match. ``axis``: x's example axis
    (:meth:`Call.example_axis`, or a constant's read as the batch's: :func:`_constant_batch_axis`)."""
    x_subs, s_subs, z_subs = subscripts
    runs = None if axis is None else example_runs(axis[1], call.batch)
    if axis is None or runs is None:
        return f"its activation (shape {tuple(x.shape)}) has no batch dimension"
    at, letter = axis[0], x_subs[axis[0]]
    if runs > 1:
        if letter not in z_subs:
            return "the batch index on the parameter or summed away"
        fresh = next(c for c in string.ascii_letters if c not in x_subs + s_subs + z_subs)
        z_at = z_subs.index(letter)
        a = a.unflatten(at, (call.batch, runs))
        x_subs = x_subs[: at + 1] + fresh + x_subs[at + 1 :]
        z_subs = z_subs[: z_at + 1] + fresh + z_subs[z_at + 1 :]
        out_shape = torch.Size((*out_shape[:z_at], call.batch, runs, *out_shape[z_at + 1 :]))
    return a.movedim(at, 0), (letter + x_subs[:at] + x_subs[at + 1 :], s_subs, z_subs), out_shape


def _constant_batch_axis(
    call: Call, x: torch.Tensor, subscripts: tuple[str, str, str], s: Tracked
) -> tuple[int, torch.Tensor] | None:
    """(k, 0 … B − 1) for a constant x (not computed from the batch) whose one dimension of the batch's size, k, z keeps
    and S lacks: XLNet's position table expanded over the batch and dropped out row by row before
    ``ibh,hnd->ibnd``. Its slices are taken as the examples', which holds where each slice of z along k meets only
    that example's rows downstream (XLNet pairs them with the example's queries) — what no forward map says, so the
    plan's float64 probe is the judge: where the slices reach other examples (a table broadcast to every example
    whose rows happen to number B, a product mixed along k) it finds other per-example gradients and drops the
    reading (:func:`dpml.train.clipping_check.plan_clipping`). None where x came from the batch, or where no
    dimension of x has the batch's size, or, on the probe (which may read any), more than one does (a table of T rows
    when T = B); in training, only the reading the probe confirmed for S's parameter is made
    (:meth:`Call.may_read_constant_as_batch`), along its dimension even where another one has the batch's size too
    (XLNet's table of 2T positions at a batch of 2T, or of width d at a batch of d: the same code expands the same
    dimension at every batch size, and without the reading every step would take the exact path)."""
    x_subs, s_subs, z_subs = subscripts
    if call.from_batch(x):
        return None
    allowed = [
        k for k, size in enumerate(x.shape) if size == call.batch and call.may_read_constant_as_batch(s.param, k)
    ]
    if len(allowed) != 1:
        return None
    at = allowed[0]
    if x_subs[at] not in z_subs or x_subs[at] in s_subs:
        return None
    return at, torch.arange(call.batch)


def _per_group(
    a: torch.Tensor, s: Tracked, subscripts: tuple[str, str, str], out_shape: torch.Size
) -> Callable[[torch.Tensor], list[Use]] | None:
    """The uses of a 3-D S one of whose indices g is kept by x and z alike (a head: ``b h t j, h j k → b h t k``) and
    whose other two map an index of x to one of z: S_g for each g, factored as a 2-D S (``_factored_layout``), over
    x's and δ's slices at g; None for any other S."""
    x_subs, s_subs, z_subs = subscripts
    groups = [c for c in s_subs if c in x_subs and c in z_subs and c != x_subs[0]]
    if len(s_subs) != 3 or len(groups) != 1:
        return None
    g = groups[0]
    inner = tuple(t.replace(g, "") for t in subscripts)
    layout = _factored_layout(*inner)
    if layout is None:
        return None
    index = s.flat_index()
    views = [Tracked(s.param, index.select(s_subs.index(g), h), s.shared) for h in range(index.shape[s_subs.index(g)])]

    def finish(d: torch.Tensor) -> list[Use]:
        d = d.view(out_shape)
        uses: list[Use] = []
        for h, view in enumerate(views):
            a_h, d_h = a.select(x_subs.index(g), h), d.select(z_subs.index(g), h)
            uses.append((view, _factored(a_h, d_h, (inner[0], inner[2]), layout)))
        return uses

    return finish


def _factored(a: torch.Tensor, d: torch.Tensor, subscripts: tuple[str, str], layout: tuple[str, str, bool]) -> Factored:
    """Σ_t u_t v_tᵀ from the activation ``a`` and δ ``d`` (subscripts x's, z's) in a :func:`_factored_layout`."""
    (x_subs, z_subs), (u_subs, v_subs, swapped), batch = subscripts, layout, a.shape[0]
    u = torch.einsum(f"{x_subs}->{u_subs}", a).reshape(batch, -1, a.shape[x_subs.index(u_subs[-1])])
    v = torch.einsum(f"{z_subs}->{v_subs}", d).reshape(batch, -1, d.shape[z_subs.index(v_subs[-1])])
    form = Factored(u, v, u.shape[2], v.shape[2])
    return form.transposed() if swapped else form


def _factored_layout(x_subs: str, s_subs: str, z_subs: str) -> tuple[str, str, bool] | None:
    """(u's subscripts b·t·p, v's b·t·q, whether S is (q, p)) when S is a 2-D map from an index of x to one of z."""
    if len(s_subs) != 2:
        return None
    first, second = s_subs[0], s_subs[1]
    if first in x_subs and first not in z_subs and second in z_subs and second not in x_subs:
        p, q, swapped = first, second, False
    elif second in x_subs and second not in z_subs and first in z_subs and first not in x_subs:
        p, q, swapped = second, first, True
    else:
        return None
    b = x_subs[0]
    positions = "".join(c for c in x_subs if c in z_subs and c != b)
    return f"{b}{positions}{p}", f"{b}{positions}{q}", swapped


@rule(torch.einsum)
def einsum(call: Call) -> Pending | str:
    """torch.einsum(equation, x, S) or (equation, S, x), or with the two operands in one list."""
    equation, operands = einsum_operands(call.args)
    if not isinstance(equation, str) or len(operands) != 2:
        return "an equation of other than two operands"
    first, second = operands
    s_first = call.tracked(first) is not None
    s, x = (first, second) if s_first else (second, first)
    tracked = call.tracked(s)
    if tracked is None or call.tracked(x) is not None or not isinstance(x, torch.Tensor):
        return "a product of two parameters"
    if s_first:  # the equation with x's operand first
        lhs, arrow, rhs = equation.replace(" ", "").partition("->")
        left, _, right = lhs.partition(",")
        equation = f"{right},{left}{arrow}{rhs}"
    subscripts = _expanded(equation, x.dim(), s.dim())
    if isinstance(subscripts, str):
        return subscripts
    return product(call, x, tracked, subscripts)


def _shared_over(s: Tracked, dim: int) -> Tracked | None:
    """S without dimension ``dim`` when S is the same along it (expanded, or of size 1), else None."""
    index = s.flat_index()
    if not same_along(index, dim):
        return None
    return Tracked(s.param, index.select(dim, 0), s.shared)


@rule(torch.bmm, torch.Tensor.bmm)
def bmm(call: Call) -> Pending | str:
    """torch.bmm(x, S) or (S, x) with S (B, n, m) a parameter expanded over the batch (``w.expand(B, n, m)``):
    z_i = x_i S_0 or S_0 x_i — ``b i j, j k → b i k`` with S_0 the shared matrix; or with x's B·H matrices example
    by example and S the same H matrices S_h for every example (DeBERTa's relative positions: ``w.repeat(B, 1, 1)``
    against the heads' queries), ``b h i j, h j k → b h i k``; or with the product's batch the heads, S (H, n, m)
    and x (H, B·T, n) every example's rows of each head (RecurrentGemma's block-diagonal gates), ``g i j, g j k →
    g i k`` with i the examples' rows (:func:`_batch_axis`)."""
    left, right = call.arg(0, "input"), call.arg(1, "mat2")
    s_left = call.tracked(left) is not None
    s, x = (left, right) if s_left else (right, left)
    tracked = call.tracked(s)
    if tracked is None or call.tracked(x) is not None:
        return "a product of two parameters"
    shared = _shared_over(tracked, 0)
    if shared is not None:
        return product(call, x, shared, ("bjk", "ij", "bik") if s_left else ("bij", "jk", "bik"))
    per_head = _shared_by_examples(call, x, tracked)
    if per_head is not None:
        heads, each = per_head
        return product(call, x, each, ("bhjk", "hij", "bhik") if s_left else ("bhij", "hjk", "bhik"), merged=heads)
    if call.leading_examples(x) is not None:
        chosen = _matrix_per_row(call, x, tracked, s_left)
        return chosen if chosen is not None else "a parameter batch whose matrices differ from one example to another"
    return product(call, x, tracked, ("gjk", "gij", "gik") if s_left else ("gij", "gjk", "gik"))  # (heads first)


def _matrix_per_row(call: Call, x: torch.Tensor, s: Tracked, s_left: bool) -> Pending | str | None:
    """torch.bmm(S, x) or (x, S) with S (N, n, m) one of a parameter's matrices chosen for each row (a mixture of
    experts' ``W[expert_ids]``, transformers' ``batched_mm`` experts) and each of x's N rows one example's: the rows
    that read matrix M form its use, as ``F.grouped_mm``'s experts do (:mod:`.grouped_mm`) —
    ∇_M ℓ_i = Σ_{rows r of M and i} Σ_j δ_{r,j} x_{r,j}ᵀ (S x: the columns j of x_r and δ_r) or x_{r,j} δ_{r,j}ᵀ
    (x S: their rows), factored over each example's positions; None where rows with one matrix's first element read
    different views."""
    examples = call.leading_examples(x)
    if examples is None or x.dim() != 3 or examples.dim() != 1:
        return None
    index = s.flat_index()
    keys, inverse = torch.unique(index.reshape(index.shape[0], -1)[:, 0], return_inverse=True)
    rows = torch.arange(index.shape[0], device=index.device)
    first = torch.full_like(keys, index.shape[0]).scatter_reduce(0, inverse, rows, "amin")
    if not torch.equal(index, index[first[inverse]]):
        return None
    positions = x.shape[2] if s_left else x.shape[1]
    groups = []
    for g in range(keys.shape[0]):
        chosen = (inverse == g).nonzero().squeeze(1)
        owners = examples[chosen.to(examples.device)]  # (example maps are on the CPU, the index on S's device)
        layout = Rows.of_map(owners.repeat_interleave(positions).unsqueeze(1), call.batch)
        if layout is None:
            return "rows that each hold several examples"
        groups.append((chosen, layout, Tracked(s.param, index[first[g]], s.shared)))
    recorded = x.detach()

    def finish(d: torch.Tensor) -> list[Use]:
        uses: list[Use] = []
        for chosen, layout, view in groups:
            xs, ds = recorded[chosen], d[chosen]
            if s_left:  # z_r = M x_r: M's rows from δ_r's, its columns from x_r's
                u, v = ds.transpose(1, 2).reshape(-1, ds.shape[1]), xs.transpose(1, 2).reshape(-1, xs.shape[1])
            else:  # z_r = x_r M
                u, v = xs.reshape(-1, xs.shape[2]), ds.reshape(-1, ds.shape[2])
            uses.append((view, form_of_rows(layout, kept_rows(layout, u), kept_rows(layout, v))))
        return uses

    return Pending(call.output, [s.param], finish)


def _shared_by_examples(call: Call, x: torch.Tensor, s: Tracked) -> tuple[int, Tracked] | None:
    """(H, S as (H, n, m)) when x (B·H, …) holds H matrices of each example in turn (its rows h·… of example k at
    k·H + h) and S (B·H, n, m) the same H matrices for every example; else None."""
    batch = call.batch
    heads = example_runs(call.leading_examples(x), batch)
    if heads is None or heads == 1:
        return None
    grouped = s.flat_index().unflatten(0, (batch, heads))
    if not same_along(grouped, 0):
        return None
    return heads, Tracked(s.param, grouped.select(0, 0), s.shared)


def matmul_batched(call: Call, x: torch.Tensor, s: Tracked, s_left: bool) -> Pending | str:
    """x @ S or S @ x with S of 3 or more dimensions, its leading ones broadcast against x's (``torch.matmul``'s
    rule): S's dimensions of size 1 are dropped, and the rest lettered right-aligned with x's."""
    shape = s.shape()
    if x.dim() < len(shape) or x.dim() > 20:
        return f"an activation (shape {tuple(x.shape)}) with fewer batch dimensions than the parameter"
    letters = string.ascii_letters[: x.dim() + 1]
    batch_letters = letters[: x.dim() - 2]
    x_subs = batch_letters + ("xy" if not s_left else "yz")
    s_subs = batch_letters[len(batch_letters) - (len(shape) - 2) :] + ("yz" if not s_left else "xy")
    z_subs = batch_letters + "xz"
    for dim in reversed(range(len(shape) - 2)):
        if shape[dim] == 1:
            squeezed = _shared_over(s, dim)
            assert squeezed is not None
            s, s_subs = squeezed, s_subs[:dim] + s_subs[dim + 1 :]
    return product(call, x, s, (x_subs, s_subs, z_subs))


def _without_out(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return kwargs.get("out") is None and len(args) == 3


@decomposition(torch.baddbmm, torch.Tensor.baddbmm, applies=_without_out)
def baddbmm(input: torch.Tensor, batch1: torch.Tensor, batch2: torch.Tensor, *, beta: Any = 1, alpha: Any = 1) -> Any:
    """β·input + α·(batch1 @ batch2) as its product (:func:`bmm`) and a sum with input (the elementwise rule: a bias
    per head, (H, 1, m)); with β = 0, input is ignored, as torch ignores it."""
    z = torch.bmm(batch1, batch2)
    z = z if alpha == 1 else z * alpha
    return z if beta == 0 else torch.add(z, input, alpha=beta)


@decomposition(torch.addbmm, torch.Tensor.addbmm, applies=_without_out)
def addbmm(input: torch.Tensor, batch1: torch.Tensor, batch2: torch.Tensor, *, beta: Any = 1, alpha: Any = 1) -> Any:
    """β·input + α·Σ_g batch1_g @ batch2_g: the product summed over its batch as one index equation (:func:`einsum`:
    refused where that batch is the examples', whom the sum mixes), and a sum with input."""
    z = torch.einsum("gij,gjk->ik", batch1, batch2)
    z = z if alpha == 1 else z * alpha
    return z if beta == 0 else torch.add(z, input, alpha=beta)
