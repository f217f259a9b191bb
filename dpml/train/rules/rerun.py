"""A computation on parameters run again on copies of its operands (:class:`LocalRun`), for its local Jacobian: the
random state it started from (:func:`replayed`), the precision it ran at, and the in-place writes it may be (a call
that writes its first operand, :func:`writes_first_operand`; through a view, :class:`ThroughView`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from dpml.devices import RngState, rng_state, set_rng_state
from dpml.train.rules.operands import outputs, substituted, tensors
from dpml.train.rules.registry import function_name


IN_PLACE_METHODS = frozenset(
    {"__iadd__", "__isub__", "__imul__", "__imatmul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__"}
    | {"__ilshift__", "__irshift__", "__iand__", "__ixor__", "__ior__", "__setitem__"}
)


def writes_first_operand(func: Any, kwargs: dict[str, Any]) -> bool:
    """``func`` changes the values of its first operand (torch's naming: ``div_``, ``x /= s``, ``x[i] = v``; or
    ``inplace=True``, as ``F.dropout`` takes it; or a write through a view, :class:`ThroughView`)."""
    name = getattr(func, "__name__", "")
    trailing = name.endswith("_") and not name.startswith("_") and name != "requires_grad_"
    return name in IN_PLACE_METHODS or trailing or kwargs.get("inplace") is True or isinstance(func, ThroughView)


@dataclass(frozen=True)
class ThroughView:
    """A write through a view (``b[k:2k].zero_()``, ``z[:, :2].copy_(p)``: ``func`` on the view) as a write of the
    view's whole base: called on a tensor laid out as the base (contiguous), it applies ``func`` to the same view of
    it (``size``, ``stride``, ``offset``, by :func:`through_view`) and returns it, written in place."""

    func: Any
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @property
    def __name__(self) -> str:
        return f"{function_name(self.func)} through a view"

    def __call__(self, base: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.func(self.view_of(base), *args, **kwargs)
        return base

    def view_of(self, base: torch.Tensor) -> torch.Tensor:
        """The same view of ``base`` (or of an index tensor of its shape, as :class:`Tracked` keeps them)."""
        return base.as_strided(self.size, self.stride, base.storage_offset() + self.offset)


def through_view(func: Any, target: torch.Tensor) -> tuple[ThroughView, torch.Tensor] | None:
    """``func`` writing ``target``, a view of another tensor, as a write of that base (and the base); None where
    target is no view, or its base is not contiguous (a copy laid out as it, on which the view is taken again)."""
    base = target._base
    if base is None or not base.is_contiguous():
        return None
    offset = int(target.storage_offset() - base.storage_offset())
    return ThroughView(func, tuple(target.shape), tuple(target.stride()), offset), base


STAND_INS: list[tuple[Any, Any]] = []
"""(function, stand-in): a function whose run on parameters is run again, for its pull-back, as a stand-in that
gives the same outputs through a backward the pull-back batches over examples more cheaply
(:mod:`.matrix_exp`)."""


F = TypeVar("F", bound=Callable[..., Any])


def stand_in(*functions: Any) -> Callable[[F], F]:  # noqa: ANN401 (torch's functions, any kind)
    """Registers the decorated function as the stand-in of ``functions`` (:data:`STAND_INS`)."""

    def register(replacement: F) -> F:
        STAND_INS.extend((function, replacement) for function in functions)
        return replacement

    return register


def run_as(func: Any) -> Any:  # noqa: ANN401
    """``func``'s stand-in where one is registered, else ``func``."""
    return next((replacement for function, replacement in STAND_INS if function is func), func)


RandomState = tuple[RngState, torch.device]
"""torch's random state for work on a device (:func:`dpml.devices.rng_state`), and the device."""


def random_state(operands: list[torch.Tensor]) -> RandomState:
    """The random state a call on ``operands`` starts from (that of the first one's device)."""
    device = operands[0].device if operands else torch.device("cpu")
    return rng_state(device), device


@contextlib.contextmanager
def replayed(state: RandomState) -> Iterator[None]:
    """The generators set to ``state`` (a call run again draws what it drew), and afterwards as they were, so that
    running it again leaves the model's later draws (dropout) as they would be without the recording."""
    before, device = state
    now = rng_state(device)
    set_rng_state(before, device)
    try:
        yield
    finally:
        set_rng_state(now, device)


def moved_from(state: RandomState) -> bool:
    """The generators are no longer at ``state``: a call run from it (:func:`replayed`) drew random numbers."""
    before, device = state
    now = rng_state(device)
    return any(a is not None and b is not None and not torch.equal(a, b) for a, b in zip(now, before, strict=True))


class NotRunAgain(RuntimeError):
    """A recorded call could not be run again to the same numbers (:meth:`LocalRun.failure` says why)."""


@dataclass(eq=False)
class LocalRun:
    """A recorded call — ``func`` on ``args`` and ``kwargs``, which gave ``out``, its parameter operands ``sources``
    (by id), from the random ``state`` — run again once, when its local Jacobian is first needed: the generic
    pull-back needs it, a closed form read off the operations (:mod:`.row_affine`, :mod:`.standardised`) does not,
    and the run costs what the operation cost (a ``std`` over a weight, twice a step otherwise). It runs under the
    autocast and matrix-product precision the call ran under; where an in-place write is about to change an operand
    or an output, it runs first (:meth:`.derived.DerivedNodes.before_write`). Any other change since shows as other
    numbers: the call is then refused, its parameters taken exactly."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out: Any
    sources: dict[int, torch.Tensor]
    state: RandomState

    def __post_init__(self) -> None:
        self.precision = _precision_now(self.state[1])
        self.versions = [(t, _version(t)) for t in tensors(self.args, self.kwargs)]
        self.output_versions = [(t, _version(t)) for t in outputs(self.out)]
        self._found: tuple[list[torch.Tensor], list[torch.Tensor]] | str | None = None

    def unwritten(self, besides: Collection[int] = ()) -> bool:
        """No operand (but those whose ``id`` is in ``besides``) has been written in place since the call (each
        tensor's version counter is where it was): the call run again now reads the numbers it read
        (:mod:`.stitched` runs it after the whole forward pass)."""
        return all(seen is not None and _version(t) == seen for t, seen in self.versions if id(t) not in besides)

    def as_recorded(self) -> list[torch.Tensor] | None:
        """The call's outputs with the numbers it gave: the recorded outputs where nothing has written them since;
        else, where the call ran again before they were written (:meth:`.derived.DerivedNodes.before_write`), that
        run's; None otherwise."""
        if all(seen is not None and _version(t) == seen for t, seen in self.output_versions):
            return self.recorded
        if isinstance(self._found, tuple):
            return self._found[0]
        return None

    @property
    def recorded(self) -> list[torch.Tensor]:
        """The call's recorded outputs (its tensors)."""
        return outputs(self.out)

    def failure(self) -> str | None:
        """Why the call cannot be run again to the same numbers (after running it, once); None where it can."""
        if self._found is None:
            self._found = self._on_leaves()
        return self._found if isinstance(self._found, str) else None

    def result(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The call's outputs from the copies, and the copies (:exc:`NotRunAgain` where it cannot be run)."""
        reason = self.failure()
        if reason is not None or not isinstance(self._found, tuple):
            raise NotRunAgain(reason)
        return self._found

    def _on_leaves(self) -> tuple[list[torch.Tensor], list[torch.Tensor]] | str:
        """The call run again with each source operand replaced by a detached copy that requires gradient: its
        outputs, now functions of those copies alone (the operation's *local* Jacobian, so that a source computed
        from another source of the same call is not counted twice), and the copies; or why not: the outputs differ
        from the recorded ``out``, or it cannot run on the copies. It runs from the random state the call started
        from (:func:`replayed`: a dropout on a weight draws the same mask again). A call that writes its first
        operand (:func:`writes_first_operand`) writes a copy of it, and its output is that copy."""
        leaves = {key: t.detach().requires_grad_(True) for key, t in self.sources.items()}
        try:
            local = self.run_on({key: (self.sources[key], leaf) for key, leaf in leaves.items()})
        except RuntimeError as error:
            return f"it cannot be run again on copies of the parameters ({error})"
        recorded = self.recorded
        sparse = next((t.layout for t in (*local, *recorded) if t.layout != torch.strided), None)
        if sparse is not None:
            return f"its output is a {sparse} tensor, whose Jacobian the pull-back does not form"
        if len(local) != len(recorded) or not all(
            torch.equal(a.detach(), b.detach()) for a, b in zip(local, recorded, strict=True)
        ):
            return "it gives other numbers when run again from the same random state"
        return local, list(leaves.values())

    def run_on(self, swapped: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """The call's outputs run again with operands swapped (``id`` → (the operand, its stand-in)), at the
        precision and from the random state it ran at and from (a call that writes its first operand writes a copy
        of it, its output). Raises what the call raises."""
        args, kwargs = substituted(self.args, self.kwargs, swapped)
        writes = writes_first_operand(self.func, kwargs)
        if writes:
            args = (args[0].clone(), *args[1:])
        with _precision_as(self.precision, self.state[1]), torch.enable_grad(), replayed(self.state):
            result = run_as(self.func)(*args, **kwargs)
        return [args[0]] if writes else outputs(result)


def _version(t: torch.Tensor) -> int | None:
    """The version counter of ``t`` (None for an inference tensor, which keeps none)."""
    try:
        return int(t._version)
    except RuntimeError:
        return None


Precision = tuple[bool, torch.dtype, str, bool]


def _precision_now(device: torch.device) -> Precision:
    """The autocast (on, dtype) for the device's type and the matrix-product and cuDNN TF32 settings now."""
    kind = device.type
    enabled = torch.is_autocast_enabled(kind) if torch.amp.is_autocast_available(kind) else False
    dtype = torch.get_autocast_dtype(kind) if enabled else torch.float32
    return enabled, dtype, torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32


@contextlib.contextmanager
def _precision_as(precision: Precision, device: torch.device) -> Iterator[None]:
    """The block runs at ``precision`` (:func:`_precision_now`), restored after (nothing set where it already is)."""
    if _precision_now(device) == precision:
        yield
        return
    enabled, dtype, matmul, cudnn = precision
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.allow_tf32 = cudnn
    cast = (
        torch.autocast(device.type, dtype=dtype, enabled=enabled)
        if torch.amp.is_autocast_available(device.type)
        else contextlib.nullcontext()
    )
    try:
        with cast:
            yield
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]
