"""Ragged rows (the tokens a mixture of experts routes to one expert, each example's padded with zero rows to the most
any example holds): their norms and clipped sums skip the padding, bucket by bucket, and equal a float64 per-example
loop in every branch — Grams, per-example gradients kept, per-example gradients formed in slices and not kept — and
through a mixture of experts from ``transformers`` end to end."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_op_rules import assert_exact_without_the_exact_path
from torch import nn

from dpml.train import ragged_norms as ragged
from dpml.train.clipping_norms import materialise
from dpml.train.clipping_check import plan_clipping
from dpml.train.dpsgd import per_example_cross_entropy
from dpml.train.keep_budget import keep_limit, pass_budget
from dpml.train.rules import combine


def _padded(lengths: list[int], width: int, n: int, seed: int) -> torch.Tensor:
    """(B, W, n) float64 rows, example i's from lengths[i] on zero."""
    t = torch.randn(len(lengths), width, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    for i, length in enumerate(lengths):
        t[i, length:] = 0
    return t


def _loop(u: torch.Tensor, v: torch.Tensor, factors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grads = [u[i].t() @ v[i] for i in range(u.shape[0])]
    norms = torch.stack([g.square().sum() for g in grads])
    return norms, sum((c * g for c, g in zip(factors, grads, strict=True)), torch.zeros_like(grads[0]))


LENGTHS = [0, 3, 40, 7, 39, 1, 0, 33, 12, 80, 2, 25, 9, 31, 16, 5, 70]


def _branches(rows: int, cols: int, limit: int) -> set[str]:
    """Which branch each bucket of ``LENGTHS`` takes at this width of u and v and this many numbers to keep."""
    found = set()
    for examples, top in ragged.buckets(torch.tensor(LENGTHS)):
        count = examples.numel()
        if not materialise(count, top, cols, rows, limit):
            found.add("gram")
        else:
            found.add("kept" if count * rows * cols <= limit else "sliced")
    return found


@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize("keep", [True, False])
def test_ragged_norms_and_clipped_sums_equal_the_per_example_loop_in_every_branch(keep: bool, shuffled: bool) -> None:
    """Rows packed example by example, or lying in another order (the routed tokens' own), given by ``order``."""
    rows, cols, width = 64, 48, 80
    u, v = _padded(LENGTHS, width, rows, 1), _padded(LENGTHS, width, cols, 2)
    factors = torch.rand(len(LENGTHS), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    lengths = torch.tensor(LENGTHS)
    u_rows, v_rows, order = ragged.packed(u, lengths), ragged.packed(v, lengths), None
    if shuffled:  # the k-th row example by example lies at order[k]
        lying = torch.randperm(u_rows.shape[0], generator=torch.Generator().manual_seed(4))
        u_rows, v_rows, order = u_rows[lying], v_rows[lying], torch.argsort(lying)
    held = 10**9 if keep else 0  # a pass that may keep nothing forms per-example gradients in slices, or Grams
    with pass_budget(torch.device("cpu"), held):
        expected = _branches(rows, cols, min(keep_limit(torch.device("cpu")), held))
        squared, clipped_sum = ragged.ragged_norms(u_rows, v_rows, lengths, order)
    assert expected == ({"gram", "kept"} if keep else {"gram", "sliced"})  # both branches of each run exercised
    norms, total = _loop(u, v, factors)
    torch.testing.assert_close(squared, norms, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(clipped_sum(factors), total, rtol=1e-12, atol=1e-12)
    assert float(squared[0]) == 0.0 and float(squared[6]) == 0.0  # examples that routed nothing here


def test_buckets_hold_every_example_with_rows_once_longest_first_within_the_ratio() -> None:
    lengths = torch.tensor([5, 0, 100, 81, 80, 64, 3, 7, 0, 50, 79])
    found = ragged.buckets(lengths)
    chosen = torch.cat([examples for examples, _ in found])
    assert sorted(chosen.tolist()) == [i for i, n in enumerate(lengths.tolist()) if n > 0]
    for examples, top in found:
        assert top == int(lengths[examples].max())
        if top >= ragged.ONE_BUCKET_BELOW:
            assert int(lengths[examples].min()) >= ragged.BUCKET_RATIO * top
    assert [top for _, top in found] == sorted((top for _, top in found), reverse=True)


MIXTURES: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16
    ),
}


class Routed(nn.Module):
    """A causal LM's sequence classifier on token ids alone (every token real, so each example's tokens route
    differently and the padding of ragged rows is what the examples do not share)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=ids).logits  # type: ignore[no-any-return]


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
@pytest.mark.parametrize("family", sorted(MIXTURES))
def test_a_mixture_of_experts_clips_exactly_through_the_ragged_path(
    family: str, implementation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The experts' rows reach :func:`ragged_norms` (grouped products, or one expert at a time by ``F.linear``), and
    every clipped sum and norm equals the float64 per-example loop (grouped products run in float32 only: the plan's
    probe checks them against per-example autograd there)."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test extra; not installed here")
    taken: list[tuple[int, int]] = []
    real = combine.ragged_norms

    def counted(u: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, order: torch.Tensor | None = None) -> Any:
        taken.append((int(lengths.min()), int(lengths.max())))
        return real(u, v, lengths, order)

    monkeypatch.setattr(combine, "ragged_norms", counted)
    torch.manual_seed(0)
    settings = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
    settings |= dict(num_key_value_heads=1, num_labels=3, pad_token_id=0, max_position_embeddings=32)
    settings |= MIXTURES[family] | {"experts_implementation": implementation}
    config = transformers.AutoConfig.for_model(family, **settings)
    model = Routed(transformers.AutoModelForSequenceClassification.from_config(config).eval())
    ids = torch.randint(1, 40, (6, 12), generator=torch.Generator().manual_seed(2))
    labels = torch.randint(0, 3, (6,), generator=torch.Generator().manual_seed(1))
    if implementation == "grouped_mm":  # float32 only: the plan's probe checks it against per-example autograd
        plan = plan_clipping(model, per_example_cross_entropy, (12,), torch.long, probe=(ids, labels))
        assert plan.exact_parameters == (), plan.lines()
    else:
        assert_exact_without_the_exact_path(model, per_example_cross_entropy, ids, labels, tolerance=1e-9)
    assert taken, "no expert's rows took the ragged path"
    assert any(fewest < most for fewest, most in taken), taken  # examples routed unequally: padding skipped
