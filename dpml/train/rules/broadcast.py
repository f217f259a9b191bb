"""Functions that broadcast an operand over the batch without a closed form of their own here: a parameter's
view shared by every example (a relative-position bias in ``F.scaled_dot_product_attention``'s ``attn_mask``,
a bias chosen by ``torch.where``, a temperature dividing the scores) meets batch-first operands.

The recorder (:meth:`dpml.train.rules.recorder.Recorder._per_example_copies`) hands the function a copy of the
shared view per row of the batch operand in its place: S padded with leading 1s to the batch operand's rank,
expanded over that operand's first dimension N and cloned, S_b (N, …). N is the batch, or any first dimension
whose slices each belong to one example (Swin's attention windows, (B·windows, …)). The function broadcasts S_b
exactly as it broadcast S (the same values), and the outputs of row r read only S_b[r], so the one backward
pass's gradient at S_b, its rows added up per example, is ∂ℓ_i/∂S — each example's gradient of the view,
summed by autograd over whatever the function broadcast it to (materialised: N × |S| numbers). The probe
checks the result against autograd like every rule's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dpml.train.rules.registry import BROADCASTING

T = torch.Tensor
BROADCASTING.update(
    {
        F.scaled_dot_product_attention,
        torch.where,
        T.where,
        torch.masked_fill,
        T.masked_fill,
        torch.div,
        T.div,
        T.__truediv__,
        T.__rtruediv__,
        torch.true_divide,
        torch.maximum,
        torch.minimum,
    }
)
