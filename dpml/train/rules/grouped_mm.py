"""A mixture of experts' grouped product (``F.grouped_mm``, ``torch._grouped_mm``: ``transformers``' default experts):
the routed tokens' rows a (S, n_in), sorted by expert, times W (E, n_in, n_out), expert e's rows a[o_{e−1}:o_e]
against W_e (``offs`` = o, cumulative). Each row belongs to the example whose token it is (the recorder follows the
tokens' gather), so

∇_{W_e} ℓ_i = Σ_{rows r of expert e and example i} a_r δ_rᵀ,

one factored use of the view W_e per expert, like a linear layer's (ragged rows, each example's routed there kept
packed: :mod:`.ragged`); the experts' views are disjoint. The
2-D × 3-D form with offsets, without a bias. The offsets are read on the host (on a GPU: one wait per call).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dpml.train.rules.ragged import kept_rows, form_of_rows
from dpml.train.rules.registry import Call, Pending, Rows, Tracked, Use, rule


@rule(F.grouped_mm, torch._grouped_mm)
def grouped_mm(call: Call) -> Pending | str:
    a, weight = call.args[0], call.args[1]
    offs = call.kwargs.get("offs", call.args[2] if len(call.args) > 2 else None)
    w = call.tracked(weight)
    if w is None or call.tracked(a) is not None:
        return "a parameter as its first matrix"
    if a.dim() != 2 or len(w.shape()) != 3 or offs is None or call.kwargs.get("bias") is not None:
        return "a form other than rows × experts with offsets and no bias"
    examples = call.leading_examples(a)
    if examples is None:
        return f"its rows (shape {tuple(a.shape)}) have no known examples"
    ends = [int(end) for end in offs.tolist()]
    spans = [(e, start, end) for e, (start, end) in enumerate(zip([0, *ends[:-1]], ends, strict=True)) if end > start]
    groups: list[tuple[int, int, int, Rows]] = []
    for e, start, end in spans:
        rows = Rows.of_map(examples[start:end].unsqueeze(1), call.batch)
        if rows is None:
            return "rows that each hold several examples"
        groups.append((e, start, end, rows))
    index, recorded = w.flat_index(), a.detach()

    def finish(d: torch.Tensor) -> list[Use]:
        uses: list[Use] = []
        for e, start, end, rows in groups:
            a_rows, d_rows = kept_rows(rows, recorded[start:end]), kept_rows(rows, d[start:end])
            uses.append((Tracked(w.param, index[e], w.shared), form_of_rows(rows, a_rows, d_rows)))
        return uses

    return Pending(call.output, [w.param], finish)
