"""The operands and outputs of a torch call as the recorder (:mod:`dpml.train.rules.recorder`) walks them: the
tensors among the arguments, the tensors of an output, how an example map is carried to an output, the view
operations replayed on index tensors, and Python composites run again under the mode."""

from __future__ import annotations

import math
import string
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

COMPOSITE_MODULES = ("torch.nn.functional", "torch.functional")
_NO_DISPATCH = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")
_REENTERED: dict[Any, types.FunctionType] = {}


def is_composite(func: Any) -> bool:
    """A Python function of ``torch.nn.functional`` (or ``torch.functional``), run again under the mode when
    no rule covers it (:func:`reentered`)."""
    return isinstance(func, types.FunctionType) and func.__module__ in COMPOSITE_MODULES


Applies = Callable[[tuple[Any, ...], dict[str, Any]], bool]
DECOMPOSITIONS: dict[Any, tuple[Applies, Callable[..., Any]]] = {}
"""Fused kernels (an LSTM's) with the same computation written in operations that have rules, and whether it
applies to a call's arguments: run under the mode instead of the kernel where a trainable parameter enters it."""


def decomposition(*functions: Any, applies: Applies) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn`` as the decomposition of the given torch functions where ``applies(args, kwargs)``."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        for f in functions:
            DECOMPOSITIONS[f] = (applies, fn)
        return fn

    return register


def composite_of(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[..., Any] | None:
    """What runs under the mode in place of ``func``, its operations seen one by one: a Python function of
    ``torch.nn.functional`` itself (:func:`reentered`), or a fused kernel's registered decomposition; else None."""
    if is_composite(func):
        return reentered(func)
    found = DECOMPOSITIONS.get(func)
    return found[1] if found is not None and found[0](args, kwargs) else None


def reentered(func: types.FunctionType) -> types.FunctionType:
    """``func`` without its own torch-function dispatch (so its body runs under the mode, whose
    operations are then seen one by one)."""
    if func not in _REENTERED:
        scope = dict(func.__globals__)
        for name in _NO_DISPATCH:
            scope[name] = lambda *args, **kwargs: False
        copy = types.FunctionType(func.__code__, scope, func.__name__, func.__defaults__, func.__closure__)
        copy.__kwdefaults__ = func.__kwdefaults__
        _REENTERED[func] = copy
    return _REENTERED[func]


NUMPY_NAMES = {"axis": "dim", "keepdims": "keepdim"}
"""Argument names torch's parser takes for NumPy's sake in place of its own (``torch.cat(xs, axis=1)``,
``x.sum(axis=-1, keepdims=True)``); the rules and the example maps read torch's names only."""


def torch_names(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with NumPy's argument names (:data:`NUMPY_NAMES`) given torch's: a join or reduction along an
    ``axis`` read as along the first dimension (the default ``dim``) would be followed as one along the batch
    (Funnel Transformer's ``torch.cat(…, axis=axis)`` of its masks crashed the recording, a learned prefix joined
    with ``axis=1`` was sent to the exact path). A call naming both is left to torch to refuse."""
    if not kwargs or NUMPY_NAMES.keys().isdisjoint(kwargs):
        return kwargs
    return {NUMPY_NAMES[k] if k in NUMPY_NAMES and NUMPY_NAMES[k] not in kwargs else k: v for k, v in kwargs.items()}


def tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


class TensorSet:
    """Tensors by identity, not kept alive: id → a weak reference that says it is still that tensor (an id is reused
    once its tensor is freed). torch's ``WeakTensorKeyDictionary`` does the same at several times the cost a lookup,
    but forgets a freed tensor's entry, which this set keeps until it goes itself: one recording pass's set."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[torch.Tensor]] = {}

    def add(self, *members: torch.Tensor) -> None:
        self._refs.update((id(t), weakref.ref(t)) for t in members)

    def __contains__(self, t: torch.Tensor) -> bool:
        found = self._refs.get(id(t))
        return found is not None and found() is t


def outputs(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [o for o in out if isinstance(o, torch.Tensor)]
    return []


def einsum_operands(args: tuple[Any, ...]) -> tuple[Any, list[Any]]:
    """(equation, operands) of a ``torch.einsum`` call: ``(equation, *operands)`` or ``(equation, [operands])``."""
    equation, *operands = args if args else (None,)
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    return equation, operands


def einsum_subscripts(equation: str, dims: Sequence[int]) -> tuple[list[str], str] | None:
    """(each operand's subscripts, the output's) of ``torch.einsum(equation, …)`` on operands of ``dims`` dimensions,
    an ellipsis written out in letters the equation does not use (right-aligned across the operands, as einsum
    broadcasts them) and an implicit output made explicit (the ellipsis, then the letters written once, in ASCII
    order); None where the equation does not fit the operands."""
    equation = equation.replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(dims):
        return None
    widths = [n - len(term.replace("...", "")) for term, n in zip(terms, dims, strict=True)]
    if any(w < 0 or (w > 0 and "..." not in term) for term, w in zip(terms, widths, strict=True)):
        return None
    fresh = [c for c in string.ascii_letters if c not in equation]
    widest = max((w for term, w in zip(terms, widths, strict=True) if "..." in term), default=0)
    if widest > len(fresh):
        return None
    covered = "".join(fresh[:widest])
    written = [term.replace("...", covered[widest - w :]) for term, w in zip(terms, widths, strict=True)]
    if arrow:
        return written, rhs.replace("...", covered)
    explicit = "".join(term.replace("...", "") for term in terms)
    return written, covered + "".join(sorted(c for c in set(explicit) if explicit.count(c) == 1))


def written_at(t: torch.Tensor, key: Any, value: Any) -> torch.Tensor:
    """``t[key] = value`` out of place: a copy of t with ``value`` written at ``key``."""
    out = t.clone()
    out[key] = value
    return out


OUT_OF_PLACE: dict[Any, Any] = {
    torch.Tensor.__setitem__: written_at,
    torch.Tensor.add_: torch.Tensor.add,
    torch.Tensor.sub_: torch.Tensor.sub,
    torch.Tensor.mul_: torch.Tensor.mul,
    torch.Tensor.__iadd__: torch.Tensor.add,
    torch.Tensor.__isub__: torch.Tensor.sub,
    torch.Tensor.__imul__: torch.Tensor.mul,
}


def carried(t: torch.Tensor, examples: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor | None:
    """t's example map carried to ``out``: same shape, all but the last dimension kept (the map being the
    same along it), a row for each element (a lookup of ids not batch-first: XLNet's (T, B)), or broadcast."""
    if examples is None:
        return None
    if out.shape == t.shape:
        return examples
    if out.dim() == t.dim() and out.shape[:-1] == t.shape[:-1] and examples.stride(-1) == 0:
        return examples[..., :1].expand(out.shape)
    if out.dim() == t.dim() + 1 and out.shape[:-1] == t.shape:  # a row per element: an embedding lookup, one_hot
        return examples.unsqueeze(-1).expand(out.shape)
    # broadcast: only t's trailing dimensions are compared, out may have more leading ones (strict=False)
    if out.dim() >= t.dim() and all(a == b or a == 1 for a, b in zip(t.shape[::-1], out.shape[::-1], strict=False)):
        return examples.expand(out.shape)
    return None


F = torch.nn.functional
_POOLS = (F.max_pool1d, F.avg_pool1d, F.lp_pool1d, F.adaptive_avg_pool1d, F.adaptive_max_pool1d, F.interpolate)
_POOLS_2D = (F.max_pool2d, F.avg_pool2d, F.lp_pool2d, F.adaptive_avg_pool2d, F.adaptive_max_pool2d)
_POOLS_3D = (F.max_pool3d, F.avg_pool3d, F.adaptive_avg_pool3d, F.adaptive_max_pool3d)
KEEPS_LEADING: dict[Any, tuple[int, int]] = {
    **{f: (3, 1) for f in (F.conv1d, F.conv_transpose1d)},
    **{f: (4, 1) for f in (F.conv2d, F.conv_transpose2d, F.unfold, F.pixel_shuffle, F.pixel_unshuffle)},
    **{f: (5, 1) for f in (F.conv3d, F.conv_transpose3d)},
    **{f: (3, 2) for f in _POOLS},
    **{f: (4, 2) for f in _POOLS_2D},
    **{f: (5, 2) for f in _POOLS_3D},
}
"""Batched operations: (the least rank of an input with a batch dimension, how many leading dimensions they keep).
Each output element at an index of those leading dimensions is computed from the input's elements at the same index
alone: the first dimension for convolutions, ``F.unfold`` and pixel shuffles (they mix channels), the first two for
pooling and interpolation (per channel). Below that rank the input is one unbatched example (``F.conv2d`` on
(C, H, W)), whose first dimension the operation mixes."""


def leading_carried(
    func: Any,
    t: torch.Tensor,
    examples: torch.Tensor | None,
    out: torch.Tensor,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> torch.Tensor | None:
    """t's example map carried to ``out`` by a batched operation (:data:`KEEPS_LEADING`) where each index of the
    dimensions it keeps belongs to one example (a batch-first t; a windowed or per-head t, (B·k, …), as Swin and MViT
    pool; a channel-major (C, B, T) t pooled per channel): out's elements at that index belong to the same example;
    or by a reduction over dimensions along which the map is alike (:func:`reduced_map`)."""
    if func in REDUCTIONS and examples is not None:
        return reduced_map(examples, args, kwargs, out)
    rank, kept = KEEPS_LEADING.get(func, (0, 0))
    if not kept or examples is None or t.dim() < rank or out.dim() < kept or out.shape[:kept] != t.shape[:kept]:
        return None
    lead = same_across_rest(examples, kept)
    return None if lead is None else lead.reshape(*out.shape[:kept], *[1] * (out.dim() - kept)).expand(out.shape)


REDUCTIONS = {
    getattr(owner, name)
    for owner in (torch, torch.Tensor)
    for name in ("sum", "mean", "nansum", "nanmean", "prod", "amax", "amin", "max", "min", "logsumexp", "std", "var")
    + ("median", "nanmedian", "any", "all")
}
"""Functions that reduce their first operand over the dimensions ``dim`` (their second argument or keyword) names."""


def reduced_map(
    examples: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor
) -> torch.Tensor | None:
    """The map of a reduction (:data:`REDUCTIONS`) over ``dim``: its input's, the reduced dimensions dropped (or kept
    with size 1, as out has them), where the input's map is alike along them, so that each output place reads places of
    one example (a time-major (T, B, H) activation averaged over time: (B, H)); None where the reduction mixes
    examples, names no dimension (a reduction of everything, or ``torch.max(a, b)``), or out is of another shape."""
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    dims = [dim] if isinstance(dim, int) else list(dim) if isinstance(dim, (tuple, list)) else []
    if not dims or not examples.dim() or not all(isinstance(d, int) for d in dims):
        return None
    reduced = {d % examples.dim() for d in dims}
    kept = [1 if k in reduced else size for k, size in enumerate(examples.shape)]
    squeezed = [size for k, size in enumerate(examples.shape) if k not in reduced]
    if list(out.shape) not in (kept, squeezed):
        return None
    first = examples[tuple(slice(0, 1) if k in reduced else slice(None) for k in range(examples.dim()))]
    alike = all(examples.shape[k] == 1 or examples.stride(k) == 0 for k in reduced)
    if not alike and not torch.equal(examples, first.expand_as(examples)):
        return None
    return first.reshape(out.shape)


def same_across_rest(examples: torch.Tensor, kept: int) -> torch.Tensor | None:
    """An example map's values at each index of its first ``kept`` dimensions, where they are the same across the
    other dimensions (each such index belongs to one example); else None."""
    trimmed = examples[
        (slice(None),) * kept + tuple(slice(0, 1) if s == 0 else slice(None) for s in examples.stride()[kept:])
    ]
    rows = trimmed.reshape(*examples.shape[:kept], -1)  # (a map broadcast over the rest: one column, not a copy of it)
    if rows.shape[-1] == 0 or not torch.equal(rows, rows[..., :1].expand_as(rows)):
        return None
    return rows[..., 0]


def core(t: torch.Tensor) -> torch.Tensor:
    """t without its broadcast dimensions (stride 0, kept with size 1): what its values are."""
    return t[tuple(slice(0, 1) if stride == 0 else slice(None) for stride in t.stride())]


def first_of_alike(maps: Sequence[torch.Tensor], keep: int) -> list[torch.Tensor]:
    """Example maps of one shape, each cut to its first index along every dimension other than ``keep`` where all of
    them are broadcast (stride 0, or size 1): alike at every index there, so that an operation that moves places
    along ``keep`` alone may run on the cut maps and its result be broadcast back (views)."""
    flat = [k for k in range(maps[0].dim()) if k != keep and all(m.shape[k] == 1 or m.stride(k) == 0 for m in maps)]
    return [m[tuple(slice(0, 1) if k in flat else slice(None) for k in range(m.dim()))] for m in maps]


def reshaped_map(examples: torch.Tensor, shape: Sequence[int]) -> torch.Tensor | None:
    """An example map reshaped to ``shape`` (the same places in the same flat order) without copying it whole: where
    its last dimensions are broadcast, its values are constant over runs of m places in flat order, so the place F of
    the result reads run F // m; with q the product of the widest trailing dimensions of ``shape`` that divides m,
    each run of q places of the result is one value: the map is formed over the leading dimensions alone and
    broadcast over the last (a time-major map (T, B, H) as (T, B·heads, H/heads): T·B·heads numbers, not T·B·H).
    None where that saves nothing (no broadcast last dimension, or no such q above 1)."""
    if examples.numel() == 0 or math.prod(shape) != examples.numel():
        return None
    trailing = 0
    while trailing < examples.dim() and (examples.shape[-1 - trailing] == 1 or examples.stride(-1 - trailing) == 0):
        trailing += 1
    run = math.prod(examples.shape[examples.dim() - trailing :])
    kept, q = len(shape), 1
    while kept > 0 and run % (q * shape[kept - 1]) == 0:
        kept, q = kept - 1, q * shape[kept - 1]
    if q == 1:
        return None
    values = examples[(...,) + (0,) * trailing].reshape(-1)
    lead = list(shape[:kept])
    chosen = values[torch.arange(math.prod(lead), device=values.device) * q // run]
    return chosen.view(*lead, *[1] * (len(shape) - kept)).expand(*shape)


def repeats_first_row(t: torch.Tensor, batch: int, by_value: bool = True) -> bool:
    """Every row of t along its first dimension is its first: by its layout (stride 0, a row expanded), or, with
    ``by_value``, where it has one row per example (``batch`` of them: a constant built in the forward pass,
    ``zeros(B, T)``) by its values (on a GPU, a wait for the device)."""
    if t.dim() < 1:
        return False
    if t.stride(0) == 0:
        return True
    return by_value and t.shape[0] == batch and torch.equal(t, t[:1].expand_as(t))


def rows_kept(source: torch.Tensor, view: torch.Tensor) -> bool:
    """Each row ``view[i]`` of a view of ``source`` reads ``source[i]``'s memory alone, told from the strides without
    reading a value: the same storage and first dimension (size and stride), and every row's other elements within the
    span of ``source``'s row, where the rows' spans do not overlap (``x.view(B, T, H, D)``, ``x.transpose(1, 2)``,
    ``x[:, 0]``, ``x.chunk(3, -1)``, but not ``x.view(B * T, D)`` or, where T = B, ``x.transpose(0, 1)``). A view
    reads only its source's elements, so row i of the view holds row i's numbers: a batch-first source's view is
    batch-first."""
    if view.dim() < 1 or view.shape[0] != source.shape[0] or view.stride(0) != source.stride(0) or not view.numel():
        return False
    span = sum((n - 1) * s for n, s in zip(source.shape[1:], source.stride()[1:], strict=True))
    reach = sum((n - 1) * s for n, s in zip(view.shape[1:], view.stride()[1:], strict=True))
    start, offset = source.storage_offset(), view.storage_offset()
    return (
        span < source.stride(0)
        and start <= offset
        and offset + reach <= start + span
        and view.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
    )


def moved_map(func: Any, examples: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> list[Any]:
    """The map of a move along named dimensions (``index_select``'s, ``flip``'s, ``roll``'s with ``dims``) formed on
    the map's values alone (:func:`core`: a move along a broadcast dimension changes nothing there) and broadcast to
    the output's shape (XLNet's relative shift, ``index_select`` along the last of (B, H, T, 2T): B numbers, not
    B·H·T²); for another function or form (``gather``, ``take_along_dim``, ``roll`` without ``dims``), the function
    of the whole map."""
    values, rest = core(examples), on_host(args[1:])
    if func in (torch.index_select, torch.Tensor.index_select):
        dim = rest[0] if rest else kwargs.get("dim")
        index = rest[1] if len(rest) > 1 else on_host(kwargs.get("index"))
        if not isinstance(dim, int) or not isinstance(index, torch.Tensor):
            return outputs(func(examples, *rest, **kwargs))
        moved = values if values.shape[dim] == 1 else values.index_select(dim, index)
    elif func in (torch.gather, torch.Tensor.gather) and (read := _gathered_alike(values, rest, kwargs)) is not None:
        moved = read
    elif func in (torch.flip, torch.Tensor.flip, torch.fliplr, torch.Tensor.fliplr, torch.flipud, torch.Tensor.flipud):
        moved = func(values, *rest, **kwargs)
    elif func in (torch.roll, torch.Tensor.roll) and (len(rest) > 1 or kwargs.get("dims") is not None):
        moved = func(values, *rest, **kwargs)
    else:
        return outputs(func(examples, *rest, **kwargs))
    return [moved.expand(out.shape)]


def _gathered_alike(values: torch.Tensor, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The map of ``gather(input, dim, index)`` from the values of the input's map (:func:`core`) where they are alike
    along ``dim`` (DeBERTa's c2p and p2c scores, (B·H, T, 2k), gathered along the last): out[…, j, …] reads the
    input at index[…, j, …] along ``dim`` and at its own place along every other dimension, so its map is the
    values' first ``index.shape[k]`` along each other dimension k, broadcast (B·H numbers, not B·H·T²); None
    otherwise (the gather of the whole map)."""
    dim = rest[0] if rest else kwargs.get("dim")
    index = rest[1] if len(rest) > 1 else kwargs.get("index")
    if not isinstance(dim, int) or not isinstance(index, torch.Tensor) or index.dim() != values.dim():
        return None
    if values.dim() == 0 or values.shape[dim] != 1:
        return None
    return values[tuple(slice(0, min(n, v)) for n, v in zip(index.shape, values.shape, strict=True))]


def before_last(key: Any, dims: int) -> bool:
    """Whether the indexing key ``t[key]`` of a tensor of ``dims`` dimensions reads only the dimensions before its last
    (that one kept whole, as the output's last): a tensor, an integer or a slice, or a tuple of them and ``None``
    (a boolean mask reading as many dimensions as it has) with fewer than ``dims`` read; no ``...``, no list."""
    entries = key if isinstance(key, tuple) else (key,)
    if any(k is Ellipsis or isinstance(k, list) for k in entries):
        return False
    read = sum(
        0 if k is None else k.dim() if isinstance(k, torch.Tensor) and k.dtype == torch.bool else 1 for k in entries
    )
    return read < dims


ROW_RESHAPES = {
    torch.Tensor.view,
    torch.Tensor.reshape,
    torch.reshape,
    torch.Tensor.flatten,
    torch.flatten,
    torch.Tensor.unflatten,
    torch.Tensor.view_as,
    torch.Tensor.reshape_as,
}


def _counts(sizes: tuple[Any, ...]) -> list[int]:
    """The repeat counts of ``t.repeat(2, 1)`` or ``t.repeat((2, 1))`` (``tile`` likewise)."""
    return [int(c) for c in (sizes[0] if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)) else sizes)]


def _repeated_index(index: torch.Tensor, *sizes: Any) -> torch.Tensor:
    """``index.repeat(*sizes)``, as an expansion (stride 0, the same values) where it repeats only dimensions of size
    1 (a DETR's ``queries.unsqueeze(0).repeat(B, 1, 1)``): its rows then show as alike, as ``expand``'s do, and a
    chain on them is carried on one row (:func:`.derived.first_rows`). (Fewer counts than dimensions never get here:
    the call itself raised.)"""
    counts = _counts(sizes)
    shape = [1] * (len(counts) - index.dim()) + list(index.shape)
    if any(c != 1 and s != 1 for c, s in zip(counts, shape, strict=True)):
        return index.repeat(counts)
    return index.reshape(shape).expand([c * s for c, s in zip(counts, shape, strict=True)])


def _tiled_index(index: torch.Tensor, *sizes: Any) -> torch.Tensor:
    """``index.tile(*sizes)``: ``repeat`` with the sizes padded by ones in front to the index's dimensions."""
    counts = _counts(sizes)
    return _repeated_index(index, [1] * (index.dim() - len(counts)) + counts)


_RESHAPE_FOR_INDEX = {
    torch.Tensor.view: torch.Tensor.reshape,
    torch.Tensor.repeat: _repeated_index,
    torch.Tensor.tile: _tiled_index,
    torch.tile: _tiled_index,
}


def apply_view(func: Any, index: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The view operation ``func`` applied to an index tensor in place of its first operand (``view``
    as ``reshape``: an index tensor need not be contiguous where the viewed tensor was; integer and boolean tensors
    among the other operands, the indices of ``x[rows, positions]``, are taken to the index tensor's device; a
    floating one, as in ``view_as(other)``, gives only its shape, whatever its device)."""
    rest, kwargs = _on_device(args[1:], kwargs, index.device)
    return _RESHAPE_FOR_INDEX.get(func, func)(index, *rest, **kwargs)


def _on_device(
    args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    def moved(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.device != device and not value.is_floating_point():
            return value.to(device)
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            return type(value)(moved(v) for v in value)
        return value

    return tuple(moved(a) for a in args), {k: moved(v) for k, v in kwargs.items()}


def substituted(
    args: tuple[Any, ...], kwargs: dict[str, Any], replacements: dict[int, tuple[torch.Tensor, torch.Tensor]]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's operands with each tensor t (found by ``id``, checked by identity) replaced by
    ``replacements[id(t)][1]``, inside lists and tuples too."""

    def swap(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and id(value) in replacements and replacements[id(value)][0] is value:
            return replacements[id(value)][1]
        if isinstance(value, (list, tuple)):
            return type(value)(swap(v) for v in value)
        return value

    return tuple(swap(a) for a in args), {k: swap(v) for k, v in kwargs.items()}


def on_host(key: Any) -> Any:
    """An indexing key with its index tensors on the CPU, where the example maps are."""
    if isinstance(key, torch.Tensor):
        return key.cpu()
    if isinstance(key, (tuple, list)):
        return type(key)(on_host(k) for k in key)
    return key


def varying(examples: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """(the dimensions along which an example map's values change, its values over them alone, in their order), from
    its values without broadcast dimensions (:func:`core`)."""
    values = core(examples)
    dims = []
    for k in range(values.dim()):
        first = values.narrow(k, 0, 1)
        if values.shape[k] > 1 and not torch.equal(values, first.expand_as(values)):
            dims.append(k)
        else:
            values = first
    return dims, values.reshape([values.shape[k] for k in dims])
