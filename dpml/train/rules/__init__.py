"""Per-operation clipping rules: where a trainable parameter enters the computation through an operation
with a rule (a linear map, an index equation (einsum), an embedding lookup, a convolution (1-, 2- or 3-D, or
transposed), a normalisation's affine, an elementwise affine or a shift and scale in one ``addcmul``, a learned
slope, a bilinear form, a concatenation, a value written into chosen places, a mixture of experts' grouped product,
a recurrent layer's scan over its steps, in place of its fused kernel), the engine forms its per-example gradient
norm and clipped sum from that operation's operands and output gradient, however the module around it is written.

An operation with no rule is run again example by example (:mod:`.per_example_calls`), each example's gradient
through that operation alone, where its calls give the batch call's values.

One rule per file, registered for the torch functions it covers (:func:`registry.rule`); a new operation
is one file (imported below) plus a test. :mod:`.recorder` sees the operations, :mod:`.combine` adds up a
parameter's uses (cross terms included).
"""

from dpml.train.rules import (  # noqa: F401 (each module registers its rules when imported)
    addcmul,
    bilinear,
    broadcast,
    concat,
    convolution,
    convolution_nd,
    einsum,
    elementwise,
    embedding,
    grouped_mm,
    linear,
    matmul,
    matrix_exp,
    norm,
    prelu,
    recurrent,
    setitem,
    views,
)
from dpml.train.rules.combine import cast_form, parameter_piece, per_example_gradients_of
from dpml.train.rules.custom_functions import custom_functions_seen_by
from dpml.train.rules.recorder import Recorder
from dpml.train.rules.registry import RULES, Pending, Tracked, Use, function_name, rule

__all__ = [
    "RULES",
    "Pending",
    "Recorder",
    "Tracked",
    "Use",
    "cast_form",
    "custom_functions_seen_by",
    "function_name",
    "parameter_piece",
    "per_example_gradients_of",
    "rule",
]
