"""Where the batch is in the recording forward pass's activations (:mod:`dpml.train.rules.recorder`, whose module
docstring says what an *example map* is): the maps kept per tensor, carried through views, shape-keeping,
broadcasting and batched operations, joins (``torch.stack`` / ``torch.cat``) along the first dimension, functions
that move rows unmixed (``index_select``, ``gather``, ``flip``, ``roll``, …) and the packing of padded sequences and
back; lost by a sort along the first dimension; read back as the rows of each example."""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from dpml.train.rules.operands import (
    ROW_RESHAPES,
    TensorSet,
    apply_view,
    before_last,
    carried,
    core,
    einsum_operands,
    einsum_subscripts,
    first_of_alike,
    leading_carried,
    moved_map,
    on_host,
    outputs,
    reshaped_map,
    rows_kept,
    same_across_rest,
    tensors,
    varying,
)
from dpml.train.rules.registry import IDENTITY_VIEWS, Tracked, example_runs

T = torch.Tensor
JOINS = {torch.stack, torch.cat, torch.concat, torch.concatenate}
"""Functions that join tensors along a dimension: along the first one, they move where a batch-first operand's
examples are even where the output's first dimension happens to be B (:meth:`ExampleMaps._follow_join`)."""


MOVES = {
    *(torch.index_select, T.index_select, torch.gather, T.gather, torch.take_along_dim, T.take_along_dim),
    *(torch.flip, T.flip, torch.fliplr, T.fliplr, torch.flipud, T.flipud, torch.roll, T.roll),
}
"""Functions that move each element of their first operand, unmixed, to another place, chosen by their other
arguments: an output of the input's shape may hold its rows in another order (``x.index_select(0, order)``,
``x.flip(0)``), so its map is the same function of the input's map (:meth:`ExampleMaps._follow_moves`)."""
PACKING = {torch._pack_padded_sequence, torch._pad_packed_sequence}
"""A padded batch of sequences packed into the rows of its steps (time-major, the longest first), and back."""
BATCHED_PRODUCTS = {torch.bmm, T.bmm}
"""Products of matrices index by index along the first dimension, z_n = a_n b_n: where an operand's index n belongs to
one example, so does z's, whichever operand it is (a mixture of experts' ``bmm(W[expert_ids], x)``, the parameter
first); where two operands' examples differ at an index, z's are mixed there, and its map is lost."""
SORTS = {torch.sort, T.sort, torch.msort, T.msort, torch.topk, T.topk}
"""Functions that move elements by their values: along the first dimension no map says where each row went."""


CONSTANTS = {T.new_zeros, T.new_ones, T.new_full, torch.zeros_like, torch.ones_like, torch.full_like}
CONSTANTS |= {torch.zeros, torch.ones, torch.full}
"""Functions whose output holds constants whatever their operands' values (of which they read the shape, dtype and
device only): a tensor made for rows of the batch to be written into (Longformer's zeros of each example's global
tokens). Not ``new_empty`` / ``empty_like``: their places hold whatever the memory held."""
INDEX_WRITES = {torch.index_add, T.index_add, T.index_add_, torch.index_copy, T.index_copy, T.index_copy_}
"""``t.index_add(dim, index, source)`` and ``index_copy``: the k-th slice of ``source`` along ``dim`` added (copied)
into t's slice ``index[k]`` (a mixture of experts' outputs added back into each token's row, JetMoE's
``zeros.index_add(0, batch_index, expert_outputs)``): :meth:`ExampleMaps._follow_index_write`."""
WRITES = {T.__setitem__}
"""``t[key] = value``: each place written takes the example of the value's element written there
(:meth:`ExampleMaps._follow_write`)."""


class ExampleMaps:
    """The example maps of one recording pass: ``batch`` examples, the tensors computed from the batch's ``inputs``
    (``derived``), and per tensor its map or None where its batch was lost (a tensor without an entry that is
    derived and has B rows first is batch-first); a tensor held weakly, so that no activation outlives its last use
    (GPT-2's projections' outputs, rows of B·T, all did to the end of the forward pass)."""

    def __init__(self, batch: int, inputs: torch.Tensor) -> None:
        self._derived = TensorSet()  # the tensors computed from the batch's inputs
        self._derived.add(inputs)
        self.batch = batch
        self._examples: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor | None]] = {}  # id -> (t, its map)
        self._base = torch.arange(batch)  # example maps are views of it, on the CPU (recorder's module docstring)
        self._constants: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}  # CONSTANTS' outputs: their versions

    def tracked(self, value: Any) -> Tracked | None:
        """The parameter view ``value`` is (the recorder's bookkeeping); None here."""
        return None

    def _entry(self, t: torch.Tensor) -> tuple[bool, torch.Tensor | None]:
        """(whether t has an entry, its example map or None when where its batch is was lost)."""
        entry = self._examples.get(id(t))
        return (True, entry[1]) if entry is not None and entry[0]() is t else (False, None)

    def examples(self, t: torch.Tensor) -> torch.Tensor | None:
        return self._entry(t)[1]

    def derived(self, t: torch.Tensor) -> bool:
        """t was computed from the batch's inputs (position ids, masks built from constants and parameters were not)."""
        return t in self._derived

    def _trivial(self, examples: torch.Tensor) -> bool:
        """The example map of a batch-first tensor (arange(B) along dimension 0, broadcast): such a tensor
        needs no entry (a tensor without one is batch-first when its first dimension is B)."""
        if examples.dim() < 1 or examples.shape[0] != self.batch:
            return False
        if (
            examples.stride(0) == 1
            and all(s == 0 for s in examples.stride()[1:])
            and examples.storage_offset() == 0
            and examples.untyped_storage().data_ptr() == self._base.untyped_storage().data_ptr()
        ):
            return True
        values = core(examples)
        if values.shape[0] != self.batch:
            return False
        return torch.equal(values, self._base.view(self.batch, *[1] * (values.dim() - 1)).expand_as(values))

    def _source_examples(self, t: torch.Tensor) -> tuple[bool, torch.Tensor | None]:
        """(whether t's batch is known, its example map): an entry's, or that of a batch-first tensor."""
        known, found = self._entry(t)
        if known:
            return found is not None, found
        if t.dim() >= 1 and t.shape[0] == self.batch and self.derived(t):
            return True, self._base.view(self.batch, *[1] * (t.dim() - 1)).expand(t.shape)
        return False, None

    def _keep_examples(self, t: torch.Tensor, examples: torch.Tensor | None) -> None:
        """Store t's example map (None: its batch dimension is lost, so no rule may assume one), compacted to
        one column when it is the same along the last dimension; a batch-first map is not stored."""
        if examples is not None and examples.shape != t.shape:
            examples = None
        if (
            examples is not None
            and examples.dim() >= 1
            and examples.stride(-1) != 0
            and examples.shape[-1] > 1
            and torch.equal(examples, examples[..., :1].expand_as(examples))
        ):
            examples = examples[..., :1].expand(examples.shape)
        if examples is not None and self._trivial(examples):
            self._examples.pop(id(t), None)
            return
        self._examples[id(t)] = (weakref.ref(t), examples)

    def note_constants(self, out: Any) -> None:
        """Remember the outputs of a call of :data:`CONSTANTS`, each with its version counter (which its views
        share)."""
        for o in outputs(out):
            self._constants[id(o)] = (weakref.ref(o), o._version)

    def unwritten_constant(self, args: tuple[Any, ...]) -> bool:
        """Whether a write's (:data:`WRITES`) target is an output of :data:`CONSTANTS` that nothing has written since
        it was made, through any of its views: asked before the call."""
        if not args or not isinstance(args[0], torch.Tensor):
            return False
        entry = self._constants.get(id(args[0]))
        return entry is not None and entry[0]() is args[0] and args[0]._version == entry[1]

    def _follow_write(self, args: tuple[Any, ...], into_constant: bool) -> None:
        """``t[key] = value`` (:data:`WRITES`) of a value from the batch: t holds the batch's values from now on; each
        place written takes the example of the value's element written there, the others keep theirs. Into a
        constant nothing wrote before (:meth:`unwritten_constant`) the places not written belong to no example: the
        map is then the index along a dimension of size B where that index is every written place's example
        (Longformer's (G, B, d) zeros given each example's global tokens along dimension 1), else lost. A value or a
        target whose batch is lost, or a key the map cannot take, loses t's (the key's indices read on the CPU)."""
        target, key, value = (args + (None, None, None))[:3]
        if not isinstance(target, torch.Tensor) or not isinstance(value, torch.Tensor) or self.batch == 1:
            return
        if not self.derived(value):
            return  # a constant written: each place keeps its example
        self._derived.add(target)
        known, old = (True, None) if into_constant else self._source_examples(target)
        value_known, written = self._source_examples(value)
        if not known or not value_known or written is None:
            self._keep_examples(target, None)
            return
        if old is not None and _places_keep_their_examples(old.expand(target.shape), key, written):
            return  # (a time step's rows written back where they were: no map of the whole target made again)
        full = torch.full(target.shape, -1, dtype=torch.int64) if old is None else old.expand(target.shape).clone()
        try:
            full[on_host(key)] = written
        except (RuntimeError, TypeError, IndexError, ValueError):
            self._keep_examples(target, None)
            return
        self._keep_examples(target, self._along_batch_index(full) if into_constant else full)

    def _follow_index_write(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> bool:
        """:data:`INDEX_WRITES` of a source from the batch (whether this said out's map; a constant source is followed
        as any operation is): each place written takes the example of the source's slices written there, where they
        are one example's (and, where an add keeps the target's values, the target place's too), else out's map is
        lost; for a target not from the batch, the written examples' map where every place was written, else
        :meth:`_along_batch_index`'s."""
        target, dim, index, source = (
            args[k] if len(args) > k else kwargs.get(name) for k, name in enumerate(("input", "dim", "index", "source"))
        )
        if not (isinstance(target, T) and isinstance(index, T) and isinstance(source, T) and isinstance(out, T)):
            return False
        if not isinstance(dim, int) or source.dim() == 0 or not self.derived(source):
            return False
        known, written = self._source_examples(source)
        from_batch = self.derived(target)
        known_target, old = self._source_examples(target) if from_batch else (True, None)
        if not known or written is None or not known_target:
            self._keep_examples(out, None)
            return True
        axis, prior = dim % source.dim(), torch.full((), -1) if old is None else old  # (-1: no example's yet)
        spread, base = first_of_alike([written.expand(source.shape), prior.expand(target.shape)], axis)  # (rows alike)
        try:
            along = on_host(index).view([-1 if k == axis else 1 for k in range(source.dim())])
            low, high = (
                base.scatter_reduce(axis, along.expand(spread.shape), spread, how, include_self=False)
                for how in ("amin", "amax")
            )
        except (RuntimeError, TypeError, IndexError, ValueError):
            self._keep_examples(out, None)
            return True
        adds = func not in (torch.index_copy, T.index_copy, T.index_copy_)
        mixed = not torch.equal(low, high) or (adds and old is not None and not torch.equal(low, base))
        low = low.expand(target.shape)
        self._keep_examples(out, None if mixed else low if from_batch else self._along_batch_index(low))
        return True

    def _along_batch_index(self, full: torch.Tensor) -> torch.Tensor | None:
        """The map of a constant partly written: ``full`` holds the examples of the places written and −1 elsewhere;
        itself where every place was written, else the index along a dimension of size B (the first that fits) that
        is the example of every place written; None where there is none."""
        written = full >= 0
        if bool(written.all()):
            return full
        for k, size in enumerate(full.shape):
            if size == self.batch:
                index = self._base.view([size if j == k else 1 for j in range(full.dim())]).expand(full.shape)
                if torch.equal(full[written], index[written]):
                    return index
        return None

    def _follow_view(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if source is None or self.batch == 1:
            return
        known, examples = self._source_examples(source)
        if not known or examples is None:
            if self._entry(source)[0]:  # lost before: lost after
                for o in outputs(out):
                    self._keep_examples(o, None)
            return
        if not self._entry(source)[0] and all(rows_kept(source, o) for o in outputs(out)):
            return  # (a batch-first source's views that keep its rows: batch-first, no entry, no map formed)
        try:
            if func in IDENTITY_VIEWS:
                mapped: Sequence[torch.Tensor | None] = [examples]
            elif func in ROW_RESHAPES and (found := reshaped_map(examples, out.shape)) is not None:
                mapped = [found]  # (formed over the leading dimensions only, where the last ones are broadcast)
            elif (
                func is T.__getitem__
                and isinstance(out, T)
                and before_last(args[1], examples.dim())
                and not examples.stride(-1)
            ):
                mapped = [examples[..., :1][on_host(args[1])].expand(out.shape)]  # (rows chosen: on one column)
            else:
                mapped = outputs(apply_view(func, examples, args, kwargs))
        except (RuntimeError, TypeError, IndexError, ValueError):
            mapped = []
        for k, o in enumerate(outputs(out)):
            self._keep_examples(o, mapped[k] if k < len(mapped) else None)

    def _follow_rows(self, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, func: Any = None) -> None:
        """An operation on a tensor with an entry: each output takes the example map of the first operand whose shape
        it keeps, keeps but for the last dimension (the map being the same along it) or broadcasts, or of a batched
        operation's input (:func:`leading_carried`); one that takes none is lost (no rule may assume its batch)."""
        if self.batch == 1:
            return
        if func in MOVES or func in SORTS:
            self._follow_moves(func, args, kwargs, out)
            return
        if func in PACKING:
            self._follow_packing(func, args, out)
            return
        if func in JOINS and self._follow_join(func, args, kwargs, out):
            return
        if func in INDEX_WRITES and self._follow_index_write(func, args, kwargs, out):
            return
        if func is torch.einsum:
            self._follow_einsum(args, out)
            return
        entries = [(t, self._entry(t)) for t in tensors(args, kwargs)] if self._examples else []
        if not any(known for _, (known, _) in entries):
            return
        maps: list[tuple[torch.Tensor, torch.Tensor | None]] = [
            (t, e) for t, (known, e) in entries if known and e is not None
        ]
        maps += [
            (t, self._source_examples(t)[1])
            for t, (known, _) in entries
            if not known and t.dim() >= 1 and t.shape[0] == self.batch and self.tracked(t) is None and self.derived(t)
        ]
        for o in outputs(out):
            found = next((m for m in (carried(t, e, o) for t, e in maps) if m is not None), None)
            if found is None and maps and args and maps[0][0] is args[0]:
                found = leading_carried(func, maps[0][0], maps[0][1], o, args, kwargs)
            if found is None and func in BATCHED_PRODUCTS:
                found = self._batched_product_examples(args, kwargs, o)
            self._keep_examples(o, found)

    def _batched_product_examples(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor
    ) -> torch.Tensor | None:
        """:data:`BATCHED_PRODUCTS`: out's map, the example of each index of its first dimension, from the operands
        from the batch, where each of their indices belongs to one example and all of them agree (else None: out's
        examples would be mixed); a parameter's view has none (it is every example's)."""
        leads = [
            self._leading_examples(t)
            for t in tensors(args, kwargs)
            if t.dim() == 3 and self.tracked(t) is None and self.derived(t)
        ]
        first = leads[0] if leads else None
        if first is None or out.dim() != 3 or out.shape[0] != first.shape[0]:
            return None
        if any(lead is None or not torch.equal(lead, first) for lead in leads):
            return None
        return first.reshape(-1, 1, 1).expand(out.shape)

    def _leading_examples(self, t: torch.Tensor) -> torch.Tensor | None:
        """The example of each index of t's first dimension, (N,), when each of its slices belongs to one example
        (a batch-first tensor: 0 … B − 1; Swin's windows, (B·windows, …): each window's example); else None."""
        if t.dim() < 1 or not self.derived(t):
            return None
        known, examples = self._entry(t)
        if not known:
            return self._base if t.shape[0] == self.batch else None
        lead = None if examples is None or examples.shape[0] == 0 else same_across_rest(examples, 1)
        return None if lead is None else lead.to(torch.int64)

    def example_runs(self, t: torch.Tensor) -> int | None:
        """k where t's first dimension holds each example's slices in one run of k, in batch order, (B·k, …) with
        slice j of example ⌊j/k⌋ (Swin's windows); None otherwise."""
        return example_runs(self._leading_examples(t), self.batch)

    def _varying_of(self, t: torch.Tensor) -> tuple[list[int], torch.Tensor] | None:
        """:func:`~.operands.varying` of t's example map; None where t's batch is not known."""
        examples = self._source_examples(t)[1]
        return None if examples is None else varying(examples.expand(t.shape))

    def example_axis(self, t: torch.Tensor) -> tuple[int, torch.Tensor] | None:
        """(k, the example of each index of dimension k) where t's map varies along it alone: batch-first (0 … B − 1,
        k = 0), time-major, or rows moved off the first dimension ((H, B·T, d): each example's T rows in one run
        along k = 1); with one example, t's first dimension of size 1; else None."""
        if t.dim() < 1 or self.tracked(t) is not None or not self.derived(t):
            return None
        if self.batch == 1:  # every element is the one example's: its first dimension of size 1 is the batch
            k = next((k for k, size in enumerate(t.shape) if size == 1), None)
            return None if k is None else (k, torch.zeros(1, dtype=torch.int64))
        varying = self._varying_of(t)
        if varying is None or len(varying[0]) != 1:
            return None
        (k,), values = varying
        return k, values.reshape(-1).to(torch.int64)

    def _follow_einsum(self, args: tuple[Any, ...], out: Any) -> None:
        """``torch.einsum(equation, *operands)``: an operand from the batch whose map varies only along letters the
        output keeps gives the output that map, laid out along the same letters (XLNet's ``ibh,hnd->ibnd`` keeps the
        batch where it was, ``ibnd,jbnd->bnij`` moves it first); lost where a map varies along a letter summed away
        (examples mixed), two operands give different maps, an operand's batch is not known, or for sublists."""
        equation, operands = einsum_operands(args)
        if not isinstance(out, torch.Tensor) or not any(self.derived(t) for t in tensors(tuple(operands), {})):
            return
        parsed = einsum_subscripts(equation, [t.dim() for t in operands]) if isinstance(equation, str) else None
        found: torch.Tensor | None = None
        for k, t in enumerate(operands):
            if not isinstance(t, torch.Tensor) or not self.derived(t):
                continue
            mapped = None if parsed is None else self._einsum_map(t, parsed[0][k], parsed[1], out)
            if mapped is None or (found is not None and not torch.equal(found, mapped)):
                self._keep_examples(out, None)
                return
            found = mapped
        self._keep_examples(out, found)

    def _einsum_map(
        self, t: torch.Tensor, subscripts: str, out_subscripts: str, out: torch.Tensor
    ) -> torch.Tensor | None:
        """The output map an einsum operand t (from the batch) gives its output (:meth:`_follow_einsum`), or None."""
        varying = self._varying_of(t)
        if varying is None or len(set(subscripts)) != len(subscripts):
            return None
        dims, values = varying
        letters = [subscripts[k] for k in dims]
        if any(c not in out_subscripts for c in letters):
            return None
        order = sorted(range(len(letters)), key=lambda j: out_subscripts.index(letters[j]))
        laid_out = values.permute(order) if order else values
        shape = [out.shape[i] if c in letters else 1 for i, c in enumerate(out_subscripts)]
        return laid_out.reshape(shape).expand(out.shape) if laid_out.numel() == math.prod(shape) else None

    def _follow_moves(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """A function of :data:`MOVES` or :data:`SORTS` on an activation (from the batch): each output's map is the same
        function of its input's map (:func:`moved_map`; other tensors read on the CPU, a wait on a GPU), or lost for a
        sort along the first dimension; a move's index gives no row a map of its own."""
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if source is None or source.dim() == 0:
            return
        known, examples = self._source_examples(source)
        if not known and not self._entry(source)[0]:
            return  # not from the batch: where the output's rows are is for its other operands to say, as before
        mapped: Sequence[torch.Tensor | None] = []
        if examples is not None and func in MOVES:
            try:
                mapped = moved_map(func, examples.expand(source.shape), args, kwargs, out)
            except (RuntimeError, TypeError, IndexError, ValueError):
                mapped = []
        elif examples is not None:  # a sort: the map is kept where the sort runs along another dimension
            dim = kwargs.get("dim", args[2] if func in (torch.topk, T.topk) and len(args) > 2 else None)
            if dim is None:
                dim = 0 if func in (torch.msort, T.msort) else (args[1] if len(args) > 1 else -1)
            along_batch = isinstance(dim, int) and dim % source.dim() == 0
            mapped = [] if along_batch else [carried(source, examples, o) for o in outputs(out)]
        for k, o in enumerate(outputs(out)):
            self._keep_examples(o, mapped[k] if k < len(mapped) else None)

    def _follow_join(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> bool:
        """A join along the first dimension (``torch.stack(steps)`` of a recurrent cell's (N, H) outputs in a loop,
        the rows of a packed sequence's steps): the output's map is the same join of the operands' maps, 0 … B − 1
        along the first dimension for a batch-first operand; lost where an operand has none (a constant's rows belong
        to no example). False for a join along another dimension (carried as any shape-keeping operation)."""
        parts = args[0] if args else kwargs.get("tensors", ())
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        if not isinstance(out, torch.Tensor) or not out.dim() or not isinstance(dim, int):
            return False
        if dim % out.dim():
            return self._follow_inner_join(parts, dim % out.dim(), out)
        if not any(self.derived(t) for t in parts):
            return True  # nothing from the batch: no map to carry
        found = [self._source_examples(t)[1] for t in parts]
        maps = [m for m in found if m is not None]
        if len(maps) < len(found):
            self._keep_examples(out, None)
        elif out.dim() > 1 and all(m.stride(-1) == 0 for m in maps):  # the join of one column each, not of copies
            self._keep_examples(out, func([m[..., :1] for m in maps], dim).expand(out.shape))
        else:
            self._keep_examples(out, func(maps, dim))
        return True

    def _follow_inner_join(self, parts: Sequence[torch.Tensor], dim: int, out: torch.Tensor) -> bool:
        """A join along dimension ``dim`` > 0 (``torch.stack((-x2, x1), dim=1)`` of a rotation's halves, RoAd's and
        rotary embeddings'): where every operand from the batch holds one example at each index of its first ``dim``
        dimensions (the same example for all of them), so does the output, whatever the operands without a map add
        beside them (a parameter's or a constant's slices, inside those examples' rows). False otherwise (carried as
        any shape-keeping operation: a join along the last dimension keeps all the others)."""
        leads = []
        for t in parts:
            known, examples = self._source_examples(t)
            if not known:
                if self.derived(t) and t.dim() >= 1:
                    return False  # (a tensor from the batch whose map was lost)
                continue
            if examples is None or t.dim() < dim or t.shape[:dim] != out.shape[:dim]:
                return False
            leads.append(same_across_rest(examples, dim))
        first = leads[0] if leads else None
        if first is None or any(lead is None or not torch.equal(lead, first) for lead in leads):
            return False
        self._keep_examples(out, first.reshape(*out.shape[:dim], *[1] * (out.dim() - dim)).expand(out.shape))
        return True

    def _follow_packing(self, func: Any, args: tuple[Any, ...], out: Any) -> None:
        """``torch._pack_padded_sequence(x, lengths, batch_first)`` and ``torch._pad_packed_sequence(data, batch_sizes,
        batch_first, padding_value, total_length)``: the data's map is packed or padded the same way; a padded place
        belongs to the example of its row (its first step's). The batch sizes and lengths have no map."""
        source, outs = args[0], outputs(out)
        known, examples = self._source_examples(source)
        if not known and not self._entry(source)[0]:
            return
        mapped = None
        if examples is not None:
            full = examples.expand(source.shape).contiguous()
            if func is torch._pack_padded_sequence:
                mapped = func(full, args[1].cpu(), args[2])[0]
            else:
                time = 1 if args[2] else 0
                padded = func(full, args[1].cpu(), args[2], -1, *args[4:])[0]
                mapped = torch.where(padded < 0, padded.narrow(time, 0, 1).expand_as(padded), padded)
        self._keep_examples(outs[0], mapped)
        for o in outs[1:]:
            self._keep_examples(o, None)


def _places_keep_their_examples(examples: torch.Tensor, key: Any, written: torch.Tensor) -> bool:
    """Whether writing a value whose map is ``written`` at ``key`` of a tensor whose map is ``examples`` leaves every
    place's example as it was (RWKV's and other scans' ``out[:, t] = row_t``, a batch-first row into a batch-first
    target): then the target's map stands, read at the written places only."""
    try:
        at = examples[on_host(key)]
        return bool(torch.equal(at, written.expand_as(at)))
    except (RuntimeError, TypeError, IndexError, ValueError):
        return False
