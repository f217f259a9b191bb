"""Custom autograd Functions (``class F(torch.autograd.Function)``, called as ``F.apply(x, …)``) seen by the recording
pass where a parameter is among their operands.

A torch function mode does not see ``F.apply``: it sees only the operations inside ``F.forward``, which run with
autograd off, and the output then carries ``F``'s own backward. So a parameter, or a computation on parameters
alone, passed through such a Function (SEW-D's ``XDropout`` of its relative-position table) left the recording
there: its later uses met an output that came from no parameter the recorder knew, and the probe sent the
parameters to the exact path.

While :func:`custom_functions_seen_by` is active, ``Function.apply`` of every Function called on this thread with a
tracked operand (a parameter, a view of one, or a computation on parameters alone) goes through the recorder as any
torch function does, under the name ``F.apply``:

- on parameters and constants alone, its output is a computation on parameters (:class:`.derived.Derived`): the
  per-example gradients of its uses are pulled back through ``F``'s own backward, run again from the same random
  state (its dropout mask drawn again as it was);
- with an operand from the batch, no rule knows ``F``: it is run again example by example
  (:mod:`.per_example_calls`), through ``F``'s own backward — as one ``torch.func.vmap`` of ``F.forward`` and
  ``F.backward`` where vmap can run their code (:mod:`.function_calls`), else one ``F.apply`` per example; where that
  cannot be done (``F`` draws random numbers, or reads other examples' values), its parameters take the exact path,
  the reason naming ``F``.

A Function with no tracked operand (a custom activation on the batch's activations, a checkpointed block) is
called as before, its inner operations seen one by one.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import _get_current_function_mode, _pop_mode_temporarily

from dpml.train.rules.operands import tensors
from dpml.train.rules.recorder import Recorder

_ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"]  # a classmethod
_active = threading.local()  # .recorder: the recorder recording on this thread, if any
_installed = threading.Lock()
_users = 0  # the custom_functions_seen_by contexts open on any thread (the wrapper is installed while there is one)


@dataclass(frozen=True)
class CustomFunction:
    """``F.apply`` as the recorder calls it and names it (``transformers.models.sew_d.modeling_sew_d.XDropout.apply``:
    its ``__module__`` is the Function's)."""

    function: type[torch.autograd.Function]

    def __post_init__(self) -> None:
        object.__setattr__(self, "__module__", self.function.__module__)

    @property
    def __name__(self) -> str:
        return f"{self.function.__name__}.apply"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _ORIGINAL_APPLY.__get__(None, self.function)(*args, **kwargs)


def _apply(cls: type[torch.autograd.Function], *args: Any, **kwargs: Any) -> Any:
    """``Function.apply`` while some recording is active: through this thread's recorder where the recorder is the
    innermost torch function mode (not while it runs a call itself, as a rule's own Function) and a tracked tensor
    is among the operands, else as torch calls it."""
    recorder: Recorder | None = getattr(_active, "recorder", None)
    function = CustomFunction(cls)
    if (
        recorder is None
        or _get_current_function_mode() is not recorder  # (a rule's own Function, called with the recording off)
        or not any(recorder.tracked(t) is not None for t in tensors(args, kwargs))
    ):
        return function(*args, **kwargs)
    with _pop_mode_temporarily():  # as torch calls a mode's handler: with the mode itself off
        return recorder.__torch_function__(function, (), args, kwargs)


@contextlib.contextmanager
def custom_functions_seen_by(recorder: Recorder) -> Iterator[None]:
    """Custom Functions called on this thread with tracked operands go through ``recorder`` (module docstring)."""
    global _users
    with _installed:
        if _users == 0:
            torch.autograd.Function.apply = classmethod(_apply)  # type: ignore[method-assign,assignment]
        _users += 1
    outer = getattr(_active, "recorder", None)
    _active.recorder = recorder
    try:
        yield
    finally:
        _active.recorder = outer
        with _installed:
            _users -= 1
            if _users == 0:
                torch.autograd.Function.apply = _ORIGINAL_APPLY  # type: ignore[method-assign]
