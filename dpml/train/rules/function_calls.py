"""A custom autograd Function ``F`` (``class F(torch.autograd.Function)``, called as ``F.apply``) run example by example
as one ``torch.func.vmap`` of its own ``forward`` and ``backward``, for :mod:`.per_example_calls`.

``torch.func.vmap`` refuses ``F.apply`` itself unless ``F`` is written for it (``setup_context`` and a vmap rule):
peft's C3A kernels and most Functions in the wild are not. Their ``forward`` and ``backward`` are plain torch code,
though, and the chain rule through ``F`` alone is ``backward``: example i's gradient of a parameter operand w is

    ∇_w ℓ_i = F.backward(ctx_i, δ_i)[w's position],   ctx_i from F.forward(ctx_i, x_i, w)                      (1)

(δ_i example i's slice of the output's gradient), exactly what autograd computes when it runs ``F`` on example i alone.
:func:`forward_with_context` and :func:`backward_from` call ``F``'s methods with a context object of our own
(:class:`Context`: the tensors saved for backward, the attributes ``forward`` sets, ``needs_input_grad``), so that
vmap can batch them over the examples as it batches any torch code. Where vmap cannot (``F`` calls a kernel of its
own, draws random numbers, branches on values), the caller runs ``F.apply`` once per example instead.
"""

from __future__ import annotations

from typing import Any

import torch

from dpml.train.rules.operands import outputs


class Context:
    """What ``F.forward`` (or ``F.setup_context``) writes on its ``ctx`` and ``F.backward`` reads back: the tensors
    saved for backward, any attribute, ``needs_input_grad``; the marks autograd keeps (non-differentiable outputs,
    materialised gradients) are accepted and have no effect here (every output's gradient is given, zeros where
    none). A Function that marks an input dirty (written in place) is refused: it runs one ``F.apply`` per example
    instead."""

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad
        self.saved_tensors: tuple[Any, ...] = ()

    def save_for_backward(self, *saved: Any) -> None:
        self.saved_tensors = saved

    @property
    def saved_variables(self) -> tuple[Any, ...]:  # (the old name)
        return self.saved_tensors

    def save_for_forward(self, *saved: Any) -> None:
        pass

    def mark_dirty(self, *written: Any) -> None:
        raise RuntimeError("a Function that writes its inputs in place is not run batched")

    def mark_non_differentiable(self, *constant: Any) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


def autograd_function(func: Any) -> type[torch.autograd.Function] | None:
    """The Function class behind a recorded ``F.apply`` (:class:`.custom_functions.CustomFunction`), else None."""
    function = getattr(func, "function", None)
    return function if isinstance(function, type) and issubclass(function, torch.autograd.Function) else None


def forward_with_context(
    function: type[torch.autograd.Function], args: tuple[Any, ...], needs_input_grad: tuple[bool, ...]
) -> tuple[Any, Context]:
    """``F``'s outputs on ``args`` and the context its backward reads, as ``F.apply`` would leave them (old style:
    ``forward(ctx, *args)``; new style: ``forward(*args)`` then ``setup_context(ctx, args, output)``).
    ``needs_input_grad``: that of the call as recorded (its operands' ``requires_grad``), not of ``args`` (detached
    slices and copies), since a backward may skip the gradients it is told no input needs."""
    ctx = Context(needs_input_grad)
    if function.setup_context is torch.autograd.Function.setup_context:  # (not overridden: the old style)
        return function.forward(ctx, *args), ctx
    output = function.forward(*args)
    function.setup_context(ctx, args, output)
    return output, ctx


def backward_from(
    function: type[torch.autograd.Function], ctx: Context, output: Any, cotangents: dict[int, torch.Tensor]
) -> tuple[Any, ...]:
    """``F.backward`` from ``ctx`` with the gradient ``cotangents[k]`` for output k (zeros for the others): one
    gradient (or None) for each of ``forward``'s inputs."""
    found = function.backward(ctx, *(cotangents.get(k, torch.zeros_like(o)) for k, o in enumerate(outputs(output))))
    return found if isinstance(found, tuple) else (found,)
