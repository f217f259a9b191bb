"""torch's own layers and parametrizations, each in a small classifier over a sequence of feature vectors, for
``benchmarks/families.py`` (``--families layers``, or any of them by name): the standard layers a model written by
hand is made of, where the issue's families are the libraries' models. Inputs (B, T, ``LAYER_FEATURES``) of random
numbers, labels of ``LAYER_CLASSES``; widths, depths and heads from ``--size`` (the ``SIZES`` of ``families.py``):

- ``layer-bilinear`` (``nn.Bilinear`` of each position's vector x and tanh(x), K = the size's width),
  ``layer-bilinear-pooled`` (the same on the mean over positions: one position an example, B·K·F² gradient
  numbers that passed the keep limit at the tiny size and batch 64);
- ``layer-decoder`` (``nn.TransformerDecoderLayer`` stacked: self-attention on the first quarter of the positions,
  cross-attention to the rest), ``layer-transformer`` (``nn.Transformer``, a causal target mask),
  ``layer-attention-kv`` (``nn.MultiheadAttention`` with keys and values of another width, ``add_bias_kv``,
  ``add_zero_attn``);
- ``layer-lstm-cell``, ``layer-gru-cell`` (``nn.LSTMCell``, ``nn.GRUCell`` stepped over the positions in Python),
  ``layer-rnn`` (``nn.RNN``, tanh, stacked);
- ``layer-weight-norm``, ``layer-spectral-norm``, ``layer-orthogonal`` (an MLP block whose first weight is
  parametrized by ``torch.nn.utils.parametrizations``: g·v/‖v‖, W/σ(W) by power iteration, exp of a skew-symmetric
  matrix);
- ``layer-conv1d`` (``nn.Conv1d`` over the positions, a grouped and dilated one, ``nn.ConvTranspose1d``),
  ``layer-norms`` (``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GroupNorm`` and an affine ``nn.InstanceNorm1d`` in turn).
"""

from __future__ import annotations

from typing import Any

LAYER_FEATURES = 128
LAYER_CLASSES = 10
LAYER_ZOO = [
    "layer-bilinear",
    "layer-bilinear-pooled",
    "layer-decoder",
    "layer-transformer",
    "layer-attention-kv",
    "layer-lstm-cell",
    "layer-gru-cell",
    "layer-rnn",
    "layer-weight-norm",
    "layer-spectral-norm",
    "layer-orthogonal",
    "layer-conv1d",
    "layer-norms",
]


def build_layer(family: str, size: dict, classes: int) -> tuple[Any, str]:
    """The family's classifier (random weights from the current seed) and a line on what it is."""
    import torch
    from torch import nn
    from torch.nn.utils import parametrizations

    f, h, layers, heads, ffn = LAYER_FEATURES, size["hidden"], size["layers"], size["heads"], size["ffn"]

    class Pooled(nn.Module):
        """x (B, T, F) → body → mean over positions → linear head (``pool=False``: the body pools)."""

        def __init__(self, body: nn.Module, width: int, pool: bool = True) -> None:
            super().__init__()
            self.body, self.head, self.pool = body, nn.Linear(width, classes), pool

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.body(x)
            return self.head(out.mean(1) if self.pool else out)

    class Pair(nn.Module):
        def __init__(self, pooled: bool) -> None:
            super().__init__()
            self.pair, self.pooled = nn.Bilinear(f, f, h), pooled

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x.mean(1) if self.pooled else x
            return torch.tanh(self.pair(x, torch.tanh(x)))

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layer = nn.TransformerDecoderLayer(f, heads, ffn, dropout=0.1, batch_first=True)
            self.decoder = nn.TransformerDecoder(layer, layers)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            cut = x.shape[1] // 4
            return self.decoder(x[:, :cut], x[:, cut:])

    class EncoderDecoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Transformer(f, heads, layers, layers, ffn, dropout=0.1, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            cut = x.shape[1] // 2
            mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1] - cut, device=x.device)
            return self.model(x[:, :cut], x[:, cut:], tgt_mask=mask, tgt_is_causal=True)

    class OtherKeys(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.keys = nn.Linear(f, f // 2)
            self.attention = nn.MultiheadAttention(
                f, heads, kdim=f // 2, vdim=f // 2, add_bias_kv=True, add_zero_attn=True, batch_first=True
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            keys = torch.tanh(self.keys(x))
            return self.attention(x, keys, keys, need_weights=False)[0]

    class Cells(nn.Module):
        def __init__(self, kind: str) -> None:
            super().__init__()
            self.cell, self.kind = getattr(nn, kind)(f, h), kind

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            state = x.new_zeros(x.shape[0], h)
            memory = x.new_zeros(x.shape[0], h)
            for t in range(x.shape[1]):
                if self.kind == "LSTMCell":
                    state, memory = self.cell(x[:, t], (state, memory))
                else:
                    state = self.cell(x[:, t], state)
            return state

    class Recurrent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.RNN(f, h, num_layers=layers, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.rnn(x)[0]

    def parametrized(kind: str) -> nn.Module:
        if kind == "orthogonal":
            first = parametrizations.orthogonal(nn.Linear(f, f))
            return nn.Sequential(first, nn.GELU(), nn.Linear(f, f))
        wrap = parametrizations.weight_norm if kind == "weight-norm" else parametrizations.spectral_norm
        return nn.Sequential(wrap(nn.Linear(f, ffn)), nn.GELU(), nn.Linear(ffn, f))

    class Convolutions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.convs = nn.Sequential(
                nn.Conv1d(f, h, 5, padding=2),
                nn.GELU(),
                nn.Conv1d(h, h, 3, dilation=2, groups=4),
                nn.GELU(),
                nn.ConvTranspose1d(h, h, 4, stride=2),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.convs(x.transpose(1, 2)).transpose(1, 2)

    class Norms(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.into = nn.Linear(f, h)
            self.layer, self.rms = nn.LayerNorm(h), nn.RMSNorm(h)
            self.group, self.instance = nn.GroupNorm(8, h), nn.InstanceNorm1d(h, affine=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.tanh(self.rms(self.layer(self.into(x)) * 2.0))
            channels = torch.tanh(self.group(x.transpose(1, 2)))
            return torch.tanh(self.instance(channels)).transpose(1, 2)

    builders: dict[str, tuple[Any, int, bool, str]] = {  # family: (body, its width, pooled by the head, what it is)
        "layer-bilinear": (lambda: Pair(False), h, True, f"nn.Bilinear({f}, {f}, {h}) at each position"),
        "layer-bilinear-pooled": (lambda: Pair(True), h, False, f"nn.Bilinear({f}, {f}, {h}) of pooled vectors"),
        "layer-decoder": (Decoder, f, True, f"nn.TransformerDecoder, {layers} layers, {heads} heads, cross-attention"),
        "layer-transformer": (EncoderDecoder, f, True, f"nn.Transformer, {layers}+{layers} layers, causal target"),
        "layer-attention-kv": (OtherKeys, f, True, "nn.MultiheadAttention, kdim = vdim = F/2, bias_kv, zero_attn"),
        "layer-lstm-cell": (lambda: Cells("LSTMCell"), h, False, f"nn.LSTMCell({f}, {h}) stepped in Python"),
        "layer-gru-cell": (lambda: Cells("GRUCell"), h, False, f"nn.GRUCell({f}, {h}) stepped in Python"),
        "layer-rnn": (Recurrent, h, True, f"nn.RNN({f}, {h}), tanh, {layers} layers"),
        "layer-weight-norm": (lambda: parametrized("weight-norm"), f, True, f"weight_norm(nn.Linear({f}, {ffn}))"),
        "layer-spectral-norm": (lambda: parametrized("spectral"), f, True, f"spectral_norm(nn.Linear({f}, {ffn}))"),
        "layer-orthogonal": (lambda: parametrized("orthogonal"), f, True, f"orthogonal(nn.Linear({f}, {f})), exp"),
        "layer-conv1d": (Convolutions, h, True, "nn.Conv1d, grouped and dilated Conv1d, ConvTranspose1d"),
        "layer-norms": (Norms, h, True, "nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, affine nn.InstanceNorm1d"),
    }
    body, width, pool, description = builders[family]
    return Pooled(body(), width, pool), description
