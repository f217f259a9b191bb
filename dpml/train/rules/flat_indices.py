"""Index tensors that map a view's elements to its parameter's (:meth:`.registry.Tracked.flat_index`), and what
they say about those elements: in order, the same along a dimension, within rows, one-to-one, disjoint. A view of a
count (an arange this module made) answers from its geometry alone, reading no value; any other index by its values.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary


# The aranges flat_index made (in a view of one, an element's value is its storage offset); an entry goes with its
# tensor, so a run of any length holds only the live ones.
_FLAT_INDICES: WeakIdKeyDictionary = WeakIdKeyDictionary()


_COUNTING: dict[torch.device, weakref.ref[torch.Tensor]] = {}


@dataclass
class _Asked:
    first: int  # how long the pass's first count is made: the longest its model's last pass asked for
    longest: int = 0  # the longest count this pass asked for


_PASS: contextvars.ContextVar[_Asked | None] = contextvars.ContextVar("dpml_pass_counts", default=None)
_LONGEST_ASKED: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def counting_for(model: nn.Module) -> Iterator[None]:
    """Within the block (a recording forward pass of ``model``) the first count :func:`counting` makes is as long as
    the longest the model's last pass asked for: one arange then serves the pass, where one made each time a longer
    count is asked for stays alive with the views indexed into it (BiT-50's 53 standardised weights held nine, 45 MiB
    of int64, at batch 64). Learnt from the last pass, not read off the parameters: a count as long as a parameter
    no view indexes (a vocabulary's embedding) would be memory spent for nothing."""
    asked = _Asked(_LONGEST_ASKED.get(model, 0))
    token = _PASS.set(asked)
    try:
        yield
    finally:
        _PASS.reset(token)
        _LONGEST_ASKED[model] = asked.longest


def counting(count: int, device: torch.device) -> torch.Tensor:
    """0, 1, …, count − 1 (int64) on ``device``: the first ``count`` elements of one arange per device, shared by
    every index made while it lives (in a recording pass, the first one as long as the longest its model's last pass
    asked for: :func:`counting_for`), let go with the last index that views it. Index tensors are read, not written; one
    written in place (its version moved) is no longer counted as a flat index, and the next index gets a fresh
    count."""
    asked, found = _PASS.get(), _COUNTING.get(device)
    if asked is not None:
        asked.longest = max(asked.longest, count)
    base = None if found is None else found()
    if base is None or base.numel() < count or base._version:
        with torch.inference_mode(False):
            base = torch.arange(max(count, 0 if asked is None else asked.first), device=device)
        _FLAT_INDICES[base] = True
        _COUNTING[device] = weakref.ref(base)
    return base[:count]


def offsets_are_values(index: torch.Tensor) -> bool:
    """``index`` is a view of an arange :meth:`Tracked.flat_index` made (views of views keep the first base), so its
    values follow from its geometry: element (i_k) holds storage_offset + Σ_k i_k·stride_k. The checks below then
    read no value (on a GPU, no wait for the device); on any other index tensor they compare values."""
    base = index if index._base is None else index._base
    return base in _FLAT_INDICES and base._version == 0


def in_order(index: torch.Tensor, count: int) -> bool:
    """``index`` holds 0, 1, …, count − 1 in order: a view of a whole parameter with its elements where they are."""
    if index.numel() != count:
        return False
    if offsets_are_values(index):
        return index.is_contiguous() and index.storage_offset() == 0
    return torch.equal(index.reshape(-1), torch.arange(count, device=index.device))


def same_along(index: torch.Tensor, dim: int) -> bool:
    """``index`` equals its first slice along ``dim`` broadcast over that dimension."""
    if index.shape[dim] <= 1 or index.stride(dim) == 0 or index.numel() == 0:
        return True  # (a broadcast dimension holds one slice's values whatever they are)
    if offsets_are_values(index):
        return False  # neighbours along dim differ by stride(dim) ≠ 0 in offset, so in value
    return torch.equal(index, index.narrow(dim, 0, 1).expand_as(index))


def rows_within(index: torch.Tensor, width: int) -> bool:
    """Each slice r of ``index`` along its first dimension holds values in [r·width, (r + 1)·width) only (a view
    that reads each row of a base of ``index.shape[0]`` rows of ``width`` elements from that row alone). For a view
    of a flat index, from its geometry: slice r spans [o + r·s₀, o + r·s₀ + Σ_{k>0} (size_k − 1)·stride_k], linear in
    r, so the first and last slices decide; else by each slice's least and greatest value."""
    rows = index.shape[0]
    if index.numel() == 0:
        return True
    if offsets_are_values(index):
        offset, step = index.storage_offset(), index.stride(0) if rows > 1 else 0
        reach = sum((n - 1) * st for n, st in zip(index.shape[1:], index.stride()[1:], strict=True))
        return all(
            offset + r * step >= r * width and offset + r * step + reach < (r + 1) * width for r in (0, rows - 1)
        )
    low, high = index.reshape(rows, -1).aminmax(dim=1)
    starts = torch.arange(rows, device=index.device) * width
    return bool(((low >= starts) & (high < starts + width)).all())


def injective(index: torch.Tensor) -> bool:
    """No two elements of ``index`` are equal. For a view of a flat index: its dimensions (of size > 1) sorted by
    stride, each stride beyond the largest offset the smaller ones reach (a mixed radix: distinct offsets)."""
    if offsets_are_values(index):
        reach = 0
        for stride, size in sorted((index.stride(k), index.shape[k]) for k in range(index.dim()) if index.shape[k] > 1):
            if stride == 0:
                return False  # a broadcast dimension repeats its values
            if stride <= reach:
                break  # overlapping strides (as_strided): compare values
            reach += (size - 1) * stride
        else:
            return True
    return bool(torch.unique(index).numel() == index.numel())


def disjoint(indices: list[torch.Tensor]) -> bool:
    """No value is in two of the (each injective) ``indices``: for views of flat indices, their offset spans
    [storage_offset, storage_offset + Σ (size_k − 1)·stride_k] do not overlap; else, or where spans overlap, by
    comparing values."""
    if all(offsets_are_values(index) for index in indices):
        spans = sorted(
            (
                i.storage_offset(),
                i.storage_offset() + sum((n - 1) * st for n, st in zip(i.shape, i.stride(), strict=True)),
            )
            for i in indices
            if i.numel()
        )
        if all(high < low for (_, high), (low, _) in zip(spans, spans[1:], strict=False)):
            return True
    everything = torch.cat([index.reshape(-1) for index in indices])
    return bool(torch.unique(everything).numel() == everything.numel())
