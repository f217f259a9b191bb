"""The recording forward pass: a ``TorchFunctionMode`` that sees every torch function call and hands those with a
trainable parameter among their operands to the registered rule of that function.

Besides the rules' pending calls it keeps track of

- **views of parameters** (``w.t()``, ``w.chunk(3)[1]``, ``w[:k]``, ``w.view(…)``, casts): each is a :class:`Tracked`
  whose index tensor (the same view of ``arange(w.numel()).view(w.shape)``; the arange is one per device, shared by
  the pass's parameters: :meth:`.registry.Tracked.flat_index`) maps its elements to the parameter's;
- **where the batch is** in activations whose batch dimension was moved or merged by transposes and reshapes
  (``x.transpose(0, 1)`` in ``nn.MultiheadAttention``, ``x.view(-1, n)`` before GPT-2's ``torch.addmm``): the same
  views of ``arange(B)`` broadcast over the batch-first tensor give the example of every element (an *example map*),
  carried on through operations that keep the shape, keep all but the last dimension (``F.linear``) or broadcast
  (the maps are bookkeeping kept on the CPU whatever the batch's device, so reading them never waits for a GPU; a
  row order or the owners of rows go to an activation's device where they meet it), and through writes
  ``t[key] = value`` of the batch's rows (into zeros made for them: Longformer's global tokens); an output none of
  these describes is marked *lost*, and no rule assumes where its batch is. A tensor without an example map is
  batch-first when it was computed from the batch's inputs (position ids and constants were not) and its first
  dimension is B, as for the layer hooks;
- **why** a parameter cannot be covered: a rule that refused the call (``F.linear: its input (shape (3, 5)) is not
  batch-first``), or an operation with no rule that cannot be run example by example either (every such call is
  handed to :func:`.per_example_calls.per_example_calls`: ``torch.atan2: no rule, and an operand from the batch …
  not laid out example by example along one axis``);
- whether a parameter of a hooked layer (:mod:`dpml.train.clipping`) is used outside that layer's call.

A hooked layer the pass is told to *trust* (its shortcut taken on the model's last pass) has the calls on its own
parameters inside its own call run without their rules: the shortcut covers those parameters, and a rule's pending
use of them would be dropped after the pass (a convolution's or a norm's call costs the recording tens of µs in
Python, the bulk of it for a small network of many such layers). Their outputs' rows are followed as any call's,
and every use of the parameters elsewhere is still seen. Should a trusted layer's shortcut not apply after all
(:attr:`Recorder.unrecorded`: the engine checks), the pass is recorded again trusting none
(:func:`dpml.train.clipping.engine_pass`). The calls a rule is handed are numbered in the order they come, the
untrusted and trusted ones alike, so that the outputs passed on as copies (``copy``) are the same calls whichever
layers are trusted.

An in-place operation with a rule (``h += pos``) is applied out of place to a copy of h, the result copied into h: no
later in-place operation overwrites the recorded result. Composite functions of ``torch.nn.functional`` with no rule
(``F.multi_head_attention_forward``) run with the recording active, so the operations inside meet their rules; so
does a fused kernel's registered decomposition (an LSTM's layers as scans: :mod:`dpml.train.rules.recurrent`).
The example maps' bookkeeping is :mod:`dpml.train.rules.example_maps`.
"""

from __future__ import annotations

import weakref
import functools
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from dpml.train.rules.derived import DerivedNodes
from dpml.train.rules.dropout import mask_of_repeated_rows
from dpml.train.rules.per_example_calls import per_example_calls
from dpml.train.rules.rerun import RandomState, random_state, through_view, writes_first_operand
from dpml.train.rules.outputs import RecordedOutputs
from dpml.train.rules.example_maps import CONSTANTS, WRITES, ExampleMaps
from dpml.train.rules.operands import (
    OUT_OF_PLACE,
    apply_view,
    composite_of,
    outputs,
    substituted,
    tensors,
    torch_names,
)
from dpml.train.rules.registry import (
    BROADCASTING,
    IDENTITY_VIEWS,
    INDEX_VIEWS,
    METADATA,
    RULES,
    SHAPE_ONLY,
    VALUE_OF_FIRST,
    Call,
    Decomposed,
    Dense,
    Pending,
    Rows,
    Shared,
    Tracked,
    function_name,
    per_example,
    view_per_example,
)


class Recorder(ExampleMaps, TorchFunctionMode):
    """The mode active during the recording forward pass (module docstring)."""

    def __init__(
        self,
        params: list[nn.Parameter],
        batch: int,
        copy: Collection[int] | None,
        owners: dict[int, nn.Module],
        device: torch.device,
        inputs: torch.Tensor,
        constant_reads: Mapping[int, int] | None = None,
        trusted: Collection[nn.Module] = (),
    ) -> None:
        TorchFunctionMode.__init__(self)
        ExampleMaps.__init__(self, batch, inputs)
        self.constant_reads = constant_reads  # id(parameter) -> the constant's dimension read as the batch's; None: any
        self.constants_read: dict[int, int] = {}  # what this pass read (id(parameter) -> dimension)
        self.owners = owners
        self.copy = copy  # the ruled calls (by their number, :attr:`calls_ruled`) whose output is passed on as a copy
        self.trusted = trusted  # hooked layers whose calls on their own parameters run without rules
        self.unrecorded: set[nn.Module] = set()  # the trusted layers whose calls ran without rules in this pass
        self.calls_ruled = 0  # the calls handed to a rule (or left unrecorded in a trusted layer) so far
        self._call_of_place: dict[int, int] = {}  # a ruled call's kept output's place in ``kept`` -> the call's number
        self.pending: list[Pending] = []
        self.computations = DerivedNodes(batch)  # computations on parameters alone
        self.refused: dict[int, str] = {}  # id(parameter) -> the first reason it cannot be covered
        self.outside: set[int] = set()  # ids of hooked layers' parameters used outside their layer's call
        self.stack: list[nn.Module] = []  # the hooked layers whose call is under way
        self.unbatched: set[nn.Module] = set()  # hooked layers called on an input not computed from the batch
        self.kept = RecordedOutputs()  # the pending calls' outputs (:mod:`dpml.train.rules.outputs`)
        self._tracked: dict[int, tuple[torch.Tensor, Tracked]] = {id(p): (p, Tracked(p)) for p in params}

    def place_key(self, place: int) -> tuple[str, int]:
        """What the kept output at ``place`` is passed on as a copy by: ``("rule", n)``, the n-th ruled call's (the
        same call on every pass whichever layers are trusted); ``("use", place)`` for a use kept otherwise (an in-place
        call's, a broadcast copy's), which no copy replaces."""
        number = self._call_of_place.get(place)
        return ("rule", number) if number is not None else ("use", place)

    def let_go(self) -> None:
        """After the forward pass: drop the pending calls, the outputs and the example maps (:mod:`..released`)."""
        self.pending, self.kept = [], RecordedOutputs()
        self._examples.clear()

    # --- what the rules ask -------------------------------------------------------------------------
    def tracked(self, value: Any) -> Tracked | None:
        if not isinstance(value, torch.Tensor):
            return None
        entry = self._tracked.get(id(value))
        return entry[1] if entry is not None and entry[0] is value else None

    def batch_first(self, t: torch.Tensor) -> bool:
        if self.tracked(t) is not None or t.dim() < 1 or not self.derived(t):
            return False
        if self.batch == 1:
            return t.shape[0] == 1
        known, examples = self._entry(t)
        return not known and t.shape[0] == self.batch

    def rows(self, t: torch.Tensor) -> Rows | None:
        if t.dim() < 2 or self.tracked(t) is not None:
            return None
        if self.batch == 1:
            return Rows(1, None)
        if not self.derived(t):
            return None
        known, examples = self._entry(t)
        if not known:
            return Rows(self.batch, None) if t.shape[0] == self.batch else None
        return None if examples is None else Rows.of_map(examples, self.batch)

    def why_exact(self, p: nn.Parameter, name: str, planned: Collection[str]) -> str:
        """Why the parameter ``p`` (named ``name``) takes the exact path: the plan named it (``planned``), or what the
        recording found."""
        if name in planned:
            return "named by the clipping plan (its rules are off autograd on the probe batch)"
        if id(p) in self.refused:
            return self.refused[id(p)]
        return "no recorded operation uses it through a rule (a custom autograd Function, or not used)"

    # --- bookkeeping --------------------------------------------------------------------------------
    def _refuse(self, hits: list[Tracked], reason: str) -> None:
        for hit in hits:
            node = self.computations.of(hit.param)
            if node is not None:  # a computation on parameters: the parameters it came from are not covered
                self._refuse([tracked for _, tracked in node.sources], reason)
            else:
                self.refused.setdefault(id(hit.param), reason)

    def _parameter_only(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Every tensor operand is a (view of a) parameter or a constant: nothing from the batch."""
        return all(
            self.tracked(t) is not None or (not self.derived(t) and not t.requires_grad) for t in tensors(args, kwargs)
        )

    def _on_parameters(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call on parameters and constants alone: the view its rule makes of it where there is one (an embedding
        looked up with position ids), the calls it decomposes into where its rule narrows it (:class:`Decomposed`),
        else its outputs tracked as :class:`Derived`."""
        if writes_first_operand(func, kwargs):
            return self._written_on_parameters(func, args, kwargs)
        masked = mask_of_repeated_rows(func, args, kwargs, self.tracked, self.batch)
        if masked is not None:  # dropout on rows alike: S ⊙ M, M one row per example (:mod:`.dropout`)
            self._derived.add(masked[1])
            with self:
                return torch.mul(*masked)
        state = random_state(list(tensors(args, kwargs)))
        out = func(*args, **kwargs)
        if not any(o.requires_grad for o in outputs(out)):
            return out
        if any(o is t for o in outputs(out) for t in tensors(args, kwargs)):
            return out  # an operand itself (``F.dropout`` in evaluation): tracked as it was
        handler = RULES.get(func)
        if handler is not None:
            result = handler(self._call(func, args, kwargs, out))
            if isinstance(result, Shared):
                for o, tracked in result.outputs:
                    self._track(o, tracked)
                return out
            if isinstance(result, Decomposed):
                for view, tracked in result.views:
                    self._track(view, tracked)
                with self:
                    return result.run()
            if isinstance(result, Pending) and result.taken_as_batch is not None:
                self._constant_as_batch(func, args, kwargs, out, result)
                return out
        self._derive(func, args, kwargs, out, state)
        return out

    def _constant_as_batch(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, result: Pending
    ) -> None:
        """A product of a parameter and a constant whose rule read one dimension of the constant as the batch's
        (:func:`dpml.train.rules.einsum._constant_batch_axis`: XLNet's position table, expanded over the batch):
        the constant is from here on an activation whose example varies along that dimension, the product's output
        one too (its map followed as any einsum's), and the use is kept; the plan's probe judges the reading."""
        constant, dim = result.taken_as_batch  # type: ignore[misc]
        self.constants_read.update({id(p): dim for p in result.params})
        along = [1] * constant.dim()
        along[dim] = self.batch
        self._derived.add(constant)
        self._keep_examples(constant, self._base.view(along).expand(constant.shape))
        self._follow_rows(args, kwargs, out, func)
        self._derived.add(*outputs(out))
        result.operation = function_name(func)
        self._pend(result)

    def _pend(self, result: Pending) -> None:
        """Keep a rule's pending use, its output let go where it is no view (:mod:`.outputs`)."""
        assert isinstance(result.output, torch.Tensor)  # (as its rule made it)
        self.pending.append(result)
        result.output = self.kept.recorded(self.kept.keep(result.output, let_go=True))

    def _written_on_parameters(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``w /= s``, ``b.add_(w)``, ``z[:, :k] = w``, ``b[k:2k].zero_()`` on parameters and constants alone: run once,
        as written; the written tensor's new values (through a view: its base's, :class:`ThroughView`) recorded as a
        computation on a copy of the old ones, under a node of their own; what showed the old values is stale from
        here on (a view taken before shows the new ones). A parameter's own values change in place only where
        autograd does not see it (under ``torch.no_grad()``): nothing to record; a copy of them (``p.clone()``) is
        written as a computation's output is."""
        target = args[0]
        if not isinstance(target, torch.Tensor) or not torch.is_grad_enabled():
            return func(*args, **kwargs)
        if self.computations.own_values(target, self.tracked(target)):
            return func(*args, **kwargs)
        through = through_view(func, target)
        written = target if through is None else through[1]
        before, state, was = written.clone(), random_state(list(tensors(args, kwargs))), self.tracked(written)
        if was is not None:
            self.computations.written(written, was, self._tracked.values())
            self._track(before, was)
        out = func(*args, **kwargs)
        if written.requires_grad:
            self._derive(func if through is None else through[0], (before, *args[1:]), kwargs, written, state)
            now = self.tracked(written)
            if through is not None and now is not None:
                self._track(target, Tracked(now.param, through[0].view_of(now.flat_index()), now.shared))
        return out

    def _derive(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, state: RandomState) -> None:
        """Track each output of a computation on parameters alone (run from the random ``state``) as a
        :class:`Derived`."""
        for o, tracked in self.computations.record(func, args, kwargs, out, self.tracked, state):
            self._track(o, tracked)

    def _note_owners(self, hits: list[Tracked]) -> None:
        for hit in hits:  # (a shared lookup's output is the layer's output: using it is not using the layer's weight)
            if hit.shared:
                continue
            owner = self.owners.get(id(hit.param))
            if owner is not None and not any(m is owner for m in self.stack):
                self.outside.add(id(hit.param))

    def _track(self, t: torch.Tensor, tracked: Tracked) -> None:
        self._tracked[id(t)] = (t, tracked)

    def __torch_function__(self, func: Any, types_: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = torch_names(kwargs or {})
        if func in METADATA:  # (``w.dtype``: no use of w's values)
            return func(*args, **kwargs)
        operands = list(tensors(args, kwargs))
        out = self._dispatch(func, args, kwargs, operands)
        if any(self.derived(t) for t in (operands[:1] if func in VALUE_OF_FIRST else operands)):
            self._derived.add(*outputs(out))
        return out

    def _dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], operands: list[torch.Tensor]) -> Any:
        if self.computations.awaiting_runs():  # (a recorded computation that read what a call writes runs first)
            for target in _written_operands(func, args, kwargs):
                self.computations.before_write(target)
        hits = [t for t in map(self.tracked, operands) if t is not None]
        if not hits:
            into_constant = func in WRITES and self.unwritten_constant(args)
            out = func(*args, **kwargs)
            if func in INDEX_VIEWS or func in IDENTITY_VIEWS:
                self._follow_view(func, args, kwargs, out)
            elif func in WRITES:
                self._follow_write(args, into_constant)
            else:
                self._follow_rows(args, kwargs, out, func)
            if func in CONSTANTS:
                self.note_constants(out)
            return out
        self._note_owners(hits)
        if stale := self.computations.stale_among(operands, self.tracked):
            self._refuse(stale, f"{function_name(func)}: an operand whose values an in-place operation changed since")
        if func in INDEX_VIEWS or func in IDENTITY_VIEWS:
            return self._view(func, args, kwargs, hits)
        if self._parameter_only(args, kwargs):
            return self._on_parameters(func, args, kwargs)
        if func in OUT_OF_PLACE:
            return self._in_place(func, args, kwargs, hits)
        if func in BROADCASTING:
            return self._per_example_copies(func, args, kwargs, hits)
        handler = RULES.get(func)
        if handler is None and (composite := composite_of(func, args, kwargs)) is not None:
            with self:
                return composite(*args, **kwargs)
        return self._ruled(func, handler or per_example_calls, args, kwargs, hits)

    def _in_trusted_layer(self, hits: list[Tracked]) -> bool:
        """Every parameter the call reads is a trusted hooked layer's own (not a computation's output, nor a shared
        lookup's), read inside that layer's call (module docstring)."""
        if not self.trusted:
            return False
        owners = [self.owners.get(id(hit.param)) for hit in hits]
        if any(hit.shared for hit in hits) or any(owner not in self.trusted for owner in owners):
            return False
        if not all(any(m is owner for m in self.stack) for owner in owners):
            return False
        self.unrecorded.update(owners)  # type: ignore[arg-type]
        return True

    def _view(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], hits: list[Tracked]) -> Any:
        out = func(*args, **kwargs)
        source = self.tracked(args[0]) if args else None
        hits = ([source] if source is not None else []) if func in SHAPE_ONLY else hits  # (w.view_as(v): v's shape)
        if source is None or len(hits) != 1:
            if any(o.requires_grad for o in outputs(out)):
                self._refuse(hits, f"{function_name(func)} of a parameter with another operand has no rule")
            return out
        if func in IDENTITY_VIEWS:
            for o in outputs(out):
                if o.shape == source.shape():
                    self._track(o, source)
            return out
        mapped = apply_view(func, source.flat_index(), args, kwargs)
        for o, index in zip(outputs(out), outputs(mapped), strict=True):
            if o.shape == index.shape:
                self._track(o, Tracked(source.param, index, source.shared))
        return out

    def _ruled(
        self, func: Any, handler: Any, args: tuple[Any, ...], kwargs: dict[str, Any], hits: list[Tracked]
    ) -> Any:
        number, self.calls_ruled = self.calls_ruled, self.calls_ruled + 1
        out = func(*args, **kwargs)
        if not any(o.requires_grad for o in outputs(out)):
            return out
        self._follow_rows(args, kwargs, out, func)
        if any(self.derived(t) for t in tensors(args, kwargs)):  # (known to its rule: the rows of a lookup's output)
            self._derived.add(*outputs(out))
        if self._in_trusted_layer(hits):  # (the layer's shortcut covers the call: no rule asked)
            return out
        if handler is not per_example_calls and any(t.is_complex() for t in (*tensors(args, kwargs), *outputs(out))):
            handler = _COMPLEX  # (the rules' products do not conjugate complex operands; autograd does)
        first = len(self.kept.versions)
        result = self._apply(func, handler, args, kwargs, out, hits)
        self._call_of_place.update(dict.fromkeys(range(first, len(self.kept.versions)), number))
        if result is not None and isinstance(out, torch.Tensor) and (self.copy is None or number in self.copy):
            copied = out.clone()
            self._follow_rows((out,), {}, copied)
            return copied
        return out

    def _per_example_copies(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], hits: list[Tracked]) -> Any:
        """A broadcasting function (:mod:`dpml.train.rules.broadcast`) called with each parameter view that every
        example shares replaced by its copy per index of the batch operand's first dimension, S_b (recorded: the
        rows of its gradient, added up per example, are the examples' gradients)."""
        batch_operand, owners = next(
            (
                (t, o)
                for t in tensors(args, kwargs)
                if self.tracked(t) is None
                for o in [self._leading_examples(t)]
                if o is not None
            ),
            (None, self._base),
        )
        copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(t) -> (t, its per-row copy)
        views: dict[int, Tracked] = {}
        for t in tensors(args, kwargs):
            tracked = self.tracked(t)
            if tracked is None or batch_operand is None or t.dim() > batch_operand.dim() or id(t) in copies:
                continue
            padded = (1,) * (batch_operand.dim() - t.dim()) + tuple(t.shape)
            view = view_per_example(tracked, padded, batch_operand.shape[0])
            if view is not None:
                copies[id(t)] = (t, t.reshape(padded).expand(batch_operand.shape[0], *padded[1:]).clone())
                views[id(t)] = view
        args, kwargs = substituted(args, kwargs, copies)
        out = func(*args, **kwargs)
        self._follow_rows(args, kwargs, out)
        if not any(o.requires_grad for o in outputs(out)):
            return out
        name = function_name(func)
        for key, (_, copy) in copies.items():
            view = views[key]

            def finish(d: torch.Tensor, view: Tracked = view) -> list[tuple[Tracked, Dense]]:
                return [(view, Dense(per_example(d.reshape(d.shape[0], *view.shape()), owners, self.batch)))]

            self._pend(Pending(copy, [view.param], finish, name))  # type: ignore[arg-type]
        covered = {id(v.param) for v in views.values()}
        reason = "no batch-first operand" if batch_operand is None else "an operand not broadcast over the batch"
        self._refuse([h for h in hits if id(h.param) not in covered], f"{name}: {reason}")
        return out

    def _in_place(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], hits: list[Tracked]) -> Any:
        """``h += pos``, ``h.mul_(scale)``: the out-of-place operation on a copy of h, whose result (recorded: no
        later in-place operation reaches it) is then copied into h, so h is modified in place as written."""
        plain = OUT_OF_PLACE[func]
        target = args[0]
        if not isinstance(target, torch.Tensor) or self.tracked(target) is not None:
            out = func(*args, **kwargs)
            self._refuse(hits, f"{function_name(func)}: a parameter modified in place")
            return out
        source = target.clone()
        if self.derived(target):
            self._derived.add(source)
        known, examples = self._entry(target)
        if known:
            self._examples[id(source)] = (weakref.ref(source), examples)
        result = plain(source, *args[1:], **kwargs)
        if result.requires_grad:
            self._apply(plain, RULES[plain], (source, *args[1:]), kwargs, result, hits)
        target.copy_(result)
        return target

    def _call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Call:
        """The call as its rule sees it, with the recorder's views of where the batch is."""
        views = (
            self.tracked,
            self.rows,
            self.batch_first,
            self._leading_examples,
            self.derived,
            self.example_axis,
            self._may_read_constant,
        )
        return Call(func, args, kwargs, out, self.batch, *views)

    def _may_read_constant(self, param: nn.Parameter, dim: int) -> bool:
        return self.constant_reads is None or self.constant_reads.get(id(param)) == dim

    def _apply(
        self, func: Any, handler: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, hits: list[Tracked]
    ) -> Pending | None:
        """Hand the call to its rule and keep what it returns (a pending use, shared views, or a refusal)."""
        result = handler(self._call(func, args, kwargs, out))
        if isinstance(result, Decomposed):  # (rules narrow computations on parameters alone: none has a batch operand)
            result = "a narrowing of a computation on parameters, called with an operand from the batch"
        if isinstance(result, str):
            self._refuse(hits, f"{function_name(func)}: {result}")
            return None
        if isinstance(result, Shared):
            for o, tracked in result.outputs:
                self._track(o, tracked)
            return None
        uses = result if isinstance(result, list) else [result]  # (one for each output of the call)
        covered = {id(p) for use in uses for p in use.params}
        self._refuse(
            [h for h in hits if id(h.param) not in covered], f"{function_name(func)}: no rule for this operand"
        )
        for use in uses:
            use.operation = function_name(func)
            self._pend(use)
        return uses[0] if uses else None


_COMPLEX = functools.partial(per_example_calls, because="complex values, which no rule conjugates")


def _written_operands(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors a call writes in place: its first operand (:func:`.rerun.writes_first_operand`), and ``out=``."""
    written = [args[0]] if args and isinstance(args[0], torch.Tensor) and writes_first_operand(func, kwargs) else []
    out = kwargs.get("out")
    return written + [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]
