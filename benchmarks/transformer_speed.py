"""DP-SGD step against the non-private step on small transformers, on this machine's CPU.

For a tiny BERT (sequence classification), a tiny GPT-2 (language model, tied embeddings) and an
``nn.TransformerEncoder``, batch 16 of 32 tokens: the median time of the non-private step (forward, mean
loss, backward) and of the private step (the engine's clipped sum under the probe's plan, plus noise),
interleaved, and their throughput ratio. Usage: ``python benchmarks/transformer_speed.py [rounds]``.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dpml.train.clipping_check import plan_clipping
from dpml.train.dpsgd import clipped_sum_and_noise, per_example_cross_entropy

BATCH, LENGTH, VOCABULARY = 16, 32, 1000


class HuggingFace(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x[:, 0], attention_mask=x[:, 1]).logits


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, 128)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(128, 4, 512, batch_first=True), 2, enable_nested_tensor=False
        )
        self.out = nn.Linear(128, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        padding = x[:, 1] == 0
        return self.out(self.encoder(self.embed(x[:, 0]), src_key_padding_mask=padding).mean(1))


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    batch, length, vocabulary = logits.shape
    return (
        F.cross_entropy(logits.reshape(-1, vocabulary), targets.reshape(-1), reduction="none")
        .view(batch, length)
        .mean(1)
    )


def models() -> dict[str, tuple[nn.Module, Callable, torch.Tensor]]:
    import transformers

    bert = transformers.BertConfig(
        vocab_size=VOCABULARY,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=512,
        max_position_embeddings=64,
        num_labels=2,
    )
    gpt2 = transformers.GPT2Config(
        vocab_size=VOCABULARY,
        n_embd=128,
        n_layer=2,
        n_head=2,
        n_positions=64,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
    )
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 2, (BATCH,), generator=generator)
    tokens = torch.randint(0, VOCABULARY, (BATCH, LENGTH), generator=generator)
    return {
        "tiny BERT (classification)": (
            HuggingFace(transformers.BertForSequenceClassification(bert)),
            per_example_cross_entropy,
            labels,
        ),
        "tiny GPT-2 (LM, tied)": (HuggingFace(transformers.GPT2LMHeadModel(gpt2)), token_loss, tokens),
        "nn.TransformerEncoder": (Encoder(), per_example_cross_entropy, labels),
    }


def batch() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCABULARY, (BATCH, LENGTH), generator=generator)
    mask = torch.ones_like(ids)
    mask[: BATCH // 2, LENGTH - 5 :] = 0
    return torch.stack([ids.masked_fill(mask == 0, 0), mask], 1)


def seconds(step: Callable[[], None]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def main(rounds: int) -> None:
    torch.manual_seed(0)
    x = batch()
    for name, (model, loss_fn, y) in models().items():
        model.train()
        plan = plan_clipping(model, loss_fn, tuple(x.shape[1:]), x.dtype, probe=(x[:7], y[:7]))
        generator = torch.Generator().manual_seed(2)

        def nonprivate() -> None:
            model.zero_grad()
            loss_fn(model(x), y).mean().backward()

        def private() -> None:
            clipped_sum_and_noise(model, x, y, 1.0, 1.0, BATCH, generator, loss_fn, exact=plan.exact)

        nonprivate(), private()
        times: dict[str, list[float]] = {"non-private": [], "private": []}
        for _ in range(rounds):
            times["non-private"].append(seconds(nonprivate))
            times["private"].append(seconds(private))
        base, dp = statistics.median(times["non-private"]), statistics.median(times["private"])
        print(
            f"{name}: non-private {base * 1e3:.1f} ms, DP {dp * 1e3:.1f} ms, throughput ratio {base / dp:.3f} "
            f"({len(plan.exact_parameters)} parameter(s) exact)",
            flush=True,
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
