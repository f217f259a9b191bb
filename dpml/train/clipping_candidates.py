"""Which fast layers a pass of the clipping engine (:mod:`dpml.train.clipping`) hooks: the layers whose per-example
gradients follow from their own calls' inputs and output gradients (:func:`dpml.train.clipping_layers.is_fast`), with a
trainable parameter, none shared with another module or named for the exact path; and whether a hooked layer's calls
suit its shortcut.

Only which layers get hooks follows from the candidates: the pass itself decides, from what it recorded, which hooked
layers take their shortcut (called, on batch-first inputs, their parameters used in no other call). So the list is
kept per model and walked again only when the trainable parameters or the exact names change: a list gone stale
(a module swapped for another that holds the same parameters) misses a layer, whose parameters then take the
operation rules, or hooks one that is never called; every pass stays exact either way.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection

import torch
from torch import nn

from dpml.train.clipping_layers import batch_first, is_fast, layer_parameters, takes_runs_of_rows
from dpml.train.rules import Recorder
from dpml.train.rules.outputs import Recorded

Call = tuple[torch.Tensor, Recorded]  # (a fast layer's input, its output or what stands for it once let go)

_CANDIDATES: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[int, ...], frozenset[str], list[nn.Module]]] = (
    weakref.WeakKeyDictionary()
)


def shared_parameters(model: nn.Module) -> set[int]:
    """ids of parameters registered on more than one module (tied weights)."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                owners[id(p)] = owners.get(id(p), 0) + 1
    return {key for key, count in owners.items() if count > 1}


def find_fast_candidates(model: nn.Module, names: dict[int, str], exact: Collection[str]) -> list[nn.Module]:
    """Fast layers with a trainable parameter (``names``: the trainable parameters' ids), none of them shared with
    another module or named ``exact``."""
    shared = shared_parameters(model)
    out = []
    for module in model.modules():
        if not is_fast(module):
            continue
        own = [p for p in layer_parameters(module)]
        if any(id(p) in names for p in own) and not any(id(p) in shared or names.get(id(p)) in exact for p in own):
            out.append(module)
    return out


def fast_candidates(model: nn.Module, names: dict[int, str], exact: Collection[str]) -> list[nn.Module]:
    """:func:`find_fast_candidates`, kept per model and found again only when the trainable parameters or the exact
    names changed (module docstring)."""
    key, named = tuple(names), frozenset(exact)
    found = _CANDIDATES.get(model)
    if found is None or found[0] != key or found[1] != named:
        found = (key, named, find_fast_candidates(model, names, exact))
        _CANDIDATES[model] = found
    return found[2]


def usable(module: nn.Module, calls: list[Call], batch: int) -> bool:
    """The shortcut applies to these calls: batch-first inputs (and one call for a layer's own shortcut)."""
    if getattr(module, "ghost_clipping", False) and len(calls) != 1:
        return False
    return all(batch_first(module, inputs, batch) for inputs, _ in calls)


def shortcut_input(module: nn.Module, inputs: torch.Tensor, recorder: Recorder) -> torch.Tensor | None:
    """A hooked layer's input as its shortcut takes it: as it is where it has no example map (batch-first, or its map
    lost: the hooks' convention, B rows from the batch are its examples, which the probe checks); (B, k, …) where it
    holds each example's slices in one run of k, (B·k, …), and the layer takes runs of rows
    (:func:`~dpml.train.clipping_layers.takes_runs_of_rows`: Swin's windows through its attention's projections);
    None where the rules must read where its batch is (position ids, a constant, rows moved or merged otherwise)."""
    if not recorder.derived(inputs):
        return None
    if recorder.examples(inputs) is None:
        return inputs
    runs = recorder.example_runs(inputs) if takes_runs_of_rows(module) else None
    return None if runs is None else inputs.reshape(recorder.batch, runs, *inputs.shape[1:])
