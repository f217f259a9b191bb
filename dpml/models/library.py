"""Models from other libraries (Hugging Face ``transformers``, ``peft``, …) as they come: one adapter.

dpml calls a model as ``model(x)`` with one tensor ``x`` and reads ``(batch, classes)`` logits back:
in training, the clipping probe, the chunk tuner, evaluation, the audit's scoring, the exported
network of the release and ``dpml reproduce``. A library's module may differ in two ways, and
:class:`LibraryModel` wraps it once, where the model is built (:func:`adapt`), so that every caller
sees that plain form:

- **Its output.** A ``ModelOutput``-like object with a ``.logits`` tensor, a dict with ``"logits"`` (or with one
  tensor named ``*logits`` or ``prediction*``), or a tuple/list whose first item is the logits tensor are turned into
  that tensor (:func:`logits_from_output`), in training and in evaluation alike (the output is looked at in both
  modes: torchvision's GoogLeNet returns its auxiliary heads' logits beside its own in training only). Anything
  else is refused before training, naming the type returned.
- **Its inputs.** A forward that takes an ``input_ids`` keyword argument (the Hugging Face convention; detected
  from the signature, or ``inputs="tokens"``) gets *token inputs*:
  dpml carries each example's ids and mask together as one tensor of shape ``(2, T)`` (row 0 the ids,
  row 1 the mask: 1 = a token, 0 = padding), or flat as ``2T`` values (``[ids…, mask…]``, how a table's
  ``tokens`` column is prepared, :mod:`dpml.data.encoding`). The adapter splits them and calls
  ``net(input_ids=ids, attention_mask=mask)`` with integer tensors. An example's ids and mask are one
  record, so chunking, batching and Poisson sampling can never separate them. A forward that names no
  ``attention_mask`` (FNet's, which mixes every position by a Fourier transform and has no mask to take) is
  called with the ids alone: it reads padding as the tokens it is, as it would outside dpml. The clipping
  probe's synthetic token examples follow the special ids the module's ``config`` names (:func:`probe_tokens`).

The adapter holds no parameter of its own: the wrapped module's state dict appears under ``net.``.
This module imports no library: it recognises them by their conventions.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

LOG = logging.getLogger("dpml.models")
INPUT_KINDS = ("auto", "tensor", "tokens")
TOKEN_IDS, TOKEN_MASK = "input_ids", "attention_mask"
ALLOWED_OUTPUTS = (
    "a (batch, classes) logits tensor, an object with a .logits tensor (a transformers ModelOutput), "
    "a dict with a 'logits' tensor (or with one tensor named *logits or prediction*, and no other so named), "
    "or a tuple/list whose first item is the logits tensor"
)


class ModelOutputError(ValueError):
    """The module's forward returned something dpml cannot read logits from (raised before training)."""


def _named_predictions(output: Mapping[Any, Any]) -> list[torch.Tensor]:
    """The tensors of a mapping (a ``ModelOutput``: its fields that are not None) named as a prediction is where a
    model names it otherwise than ``logits``: PatchTST's classifier returns ``prediction_logits``, PatchTSMixer's
    ``prediction_outputs``. Two of them (a question-answering head's ``start_logits`` and ``end_logits``) say
    nothing of which is meant."""
    return [
        value
        for key, value in output.items()
        if isinstance(key, str) and (key.endswith("logits") or key.startswith("prediction"))
        if isinstance(value, torch.Tensor)
    ]


def logits_from_output(output: Any) -> torch.Tensor:
    """The logits tensor inside a module's output (module docstring), or a :class:`ModelOutputError`."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, Mapping) and isinstance(output.get("logits"), torch.Tensor):
        return output["logits"]  # type: ignore[no-any-return]
    if isinstance(output, Mapping) and len(named := _named_predictions(output)) == 1:
        return named[0]
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise ModelOutputError(
        f"model: its forward returned a {type(output).__module__}.{type(output).__qualname__}; "
        f"dpml reads the logits from {ALLOWED_OUTPUTS}"
    )


def eager(net: nn.Module) -> nn.Module:
    """The module ``torch.compile`` compiled where ``net`` is its wrapper (an ``OptimizedModule``, whose parameters
    are the module's own tensors), else ``net``: dpml's clipping engine runs the forward pass eagerly, its layer hooks
    and torch function mode seeing each operation that a compiled graph would fuse away. Its forward's signature
    (``input_ids``, ``attention_mask``) is the module's, not the wrapper's ``*args, **kwargs``."""
    inner = getattr(net, "_orig_mod", None)
    if type(net).__name__ != "OptimizedModule" or not isinstance(inner, nn.Module):
        return net
    LOG.info("model: a torch.compile wrapper; dpml trains the module it compiled, run eagerly (the same parameters)")
    return eager(inner)


def forward_names(net: nn.Module) -> frozenset[str]:
    """The names of ``net``'s forward's parameters (none where its signature cannot be read)."""
    try:
        return frozenset(inspect.signature(net.forward).parameters)
    except (TypeError, ValueError):
        return frozenset()


def takes_token_ids(net: nn.Module) -> bool:
    """Whether ``net``'s forward names ``input_ids`` (the Hugging Face convention for token inputs)."""
    return TOKEN_IDS in forward_names(net)


def input_vocabulary(net: nn.Module) -> int | None:
    """The number of token ids the module's input embedding takes (``get_input_embeddings()``, the Hugging Face
    and peft convention; where that is a wrapper, as peft's ``TrainableTokensLayer`` around the table it adds rows
    to, the one ``nn.Embedding`` inside it), else that of its only ``nn.Embedding``; None when it cannot be known."""
    getter = getattr(net, "get_input_embeddings", None)
    if callable(getter):
        try:
            embedding = getter()
        except Exception:  # a module whose getter is not implemented: fall back to the modules
            embedding = None
        modules = embedding.modules() if isinstance(embedding, nn.Module) else ()
        inside = [m for m in modules if isinstance(m, nn.Embedding)]
        if len(inside) == 1:
            return int(inside[0].num_embeddings)
    embeddings = [m for m in net.modules() if isinstance(m, nn.Embedding)]
    return int(embeddings[0].num_embeddings) if len(embeddings) == 1 else None


def check_input_kind(inputs: str, net: nn.Module, key: str = "inputs") -> bool:
    """Whether ``net`` takes token inputs: ``auto`` reads the forward's signature; ``tokens`` insists on it."""
    if inputs not in INPUT_KINDS:
        raise ValueError(f"{key} = {inputs!r}: must be one of {', '.join(INPUT_KINDS)}")
    if inputs == "tokens" and not takes_token_ids(net):
        raise ValueError(f"{key} = 'tokens': {type(net).__name__}.forward takes no input_ids keyword argument")
    return inputs == "tokens" or (inputs == "auto" and takes_token_ids(net))


def split_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, 2, T)`` or ``(B, 2T)`` token inputs → integer ``input_ids`` and ``attention_mask``, each ``(B, T)``."""
    if x.dim() == 2 and x.shape[1] % 2 == 0:
        x = x.reshape(x.shape[0], 2, x.shape[1] // 2)
    if x.dim() != 3 or x.shape[1] != 2:
        raise ValueError(
            f"token inputs: each example must be (2, T) ids and mask, or 2T values [ids…, mask…]; "
            f"got a batch of shape {tuple(x.shape)}"
        )
    if x.is_floating_point():
        x = x.round()
    x = x.long()
    return x[:, 0], x[:, 1]


SPECIAL_TOKEN_KEYS = (
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "sep_token_id",
    "cls_token_id",
    "mask_token_id",
    "unk_token_id",
    "decoder_start_token_id",
)
"""The ids of special tokens a Hugging Face config names (``PretrainedConfig``'s attributes, some model types')."""


@dataclass(frozen=True)
class TokenConventions:
    """What a library model's config says of its token ids: ``special``, the ids with a role (never drawn as an
    ordinary token), ``pad`` the id of padding, and ``eos`` the id that ends a sequence, if any: a tokenizer ends
    every example with it, and some models need it there (T5's and BART's classifiers read the hidden state of
    each example's last ``<eos>`` and refuse a batch whose examples hold different numbers of them)."""

    special: frozenset[int] = frozenset({0})
    pad: int = 0
    eos: int | None = None


def _token_ids(value: Any) -> list[int]:
    """A config's token ids: an int, or each of a list of them (Llama 3's several ``eos_token_id``)."""
    values = value if isinstance(value, (list, tuple)) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def token_conventions(net: nn.Module) -> TokenConventions:
    """The :class:`TokenConventions` of ``net``'s ``config`` (Hugging Face's, also reached through peft's wrappers);
    the defaults (padding id 0, no ``<eos>``) for a module without one."""
    config = getattr(net, "config", None)
    named = {key: _token_ids(getattr(config, key, None)) for key in SPECIAL_TOKEN_KEYS}
    pad = (named["pad_token_id"] or [0])[0]
    eos = named["eos_token_id"][0] if named["eos_token_id"] else None
    return TokenConventions(frozenset({pad, *(i for ids in named.values() for i in ids)}), pad, eos)


def probe_tokens(
    count: int,
    length: int,
    vocabulary: int,
    generator: torch.Generator,
    conventions: TokenConventions = TokenConventions(),
) -> torch.Tensor:
    """``count`` synthetic token examples ``(count, 2, length)`` laid out as a tokenizer's: ordinary ids (in
    [0, vocabulary), none of ``conventions.special`` where any other is left) where the mask keeps them, the last
    kept one ``<eos>`` where the model names one, and the padding id where the mask does not keep them (ids the
    vocabulary does not hold are not used: no ``<eos>``, padding 0); example i ends in i mod ⌈length/2⌉ padding
    positions (at least one token is kept)."""
    ordinary = torch.ones(max(vocabulary, 1), dtype=torch.bool)
    ordinary[[k for k in conventions.special if k < ordinary.numel()]] = False
    choices = ordinary.nonzero().squeeze(1) if bool(ordinary.any()) else torch.arange(ordinary.numel())
    ids = choices[torch.randint(0, choices.numel(), (count, length), generator=generator)]
    padding = torch.arange(count) % max(1, (length + 1) // 2)
    kept = length - padding
    if conventions.eos is not None and conventions.eos < vocabulary:
        ids[torch.arange(count), kept - 1] = conventions.eos
    mask = (torch.arange(length)[None, :] < kept[:, None]).long()
    pad = conventions.pad if conventions.pad < vocabulary else 0
    return torch.stack([torch.where(mask.bool(), ids, pad), mask], dim=1)


class LibraryModel(nn.Module):
    """The user's module with dpml's calling convention: one tensor in, plain logits out (module docstring)."""

    def __init__(self, net: nn.Module, tokens: bool, vocabulary: int | None = None) -> None:
        super().__init__()
        self.net = net
        self.tokens = tokens
        self.vocabulary = vocabulary
        self.masked = tokens and TOKEN_MASK in forward_names(net)  # (else the ids alone: module docstring)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tokens:
            ids, mask = split_tokens(x)
            keywords = {TOKEN_IDS: ids, TOKEN_MASK: mask} if self.masked else {TOKEN_IDS: ids}
            return logits_from_output(self.net(**keywords))
        return logits_from_output(self.net(x))

    def probe_input(
        self, input_shape: tuple[int, ...], input_dtype: torch.dtype, count: int, generator: torch.Generator
    ) -> torch.Tensor | None:
        """The clipping probe's synthetic batch for token inputs (valid ids and masks, some padding), in the
        shape and dtype the model is fed; None for tensor inputs (the probe's own draw)."""
        if not self.tokens:
            return None
        values = 1
        for size in input_shape:
            values *= int(size)
        if values % 2:
            raise ValueError(
                f"token inputs: an example of shape {list(input_shape)} cannot hold ids and a mask "
                "of one length (2T values)"
            )
        tokens = probe_tokens(count, values // 2, self.vocabulary or 2, generator, token_conventions(self.net))
        dtype = torch.float64 if input_dtype.is_floating_point else input_dtype
        return tokens.reshape(count, *input_shape).to(dtype)


def _example_outputs(net: nn.Module, input_shape: tuple[int, ...], input_dtype: torch.dtype) -> list[Any]:
    """``net``'s outputs on two synthetic inputs in evaluation mode and in training mode (no gradient, random state
    and buffers kept: a training-mode pass may update running statistics); a mode whose pass fails gives none (the
    clipping probe then names the failure). Both, because a module may return its logits in one mode and more in the
    other (torchvision's GoogLeNet and Inception v3 return their auxiliary heads' logits beside them in training)."""
    generator = torch.Generator().manual_seed(0)
    if input_dtype.is_floating_point:
        x = torch.randn((2, *input_shape), generator=generator).to(input_dtype)
    else:
        x = torch.randint(0, 2, (2, *input_shape), generator=generator, dtype=input_dtype)
    was_training, outputs = net.training, []
    try:
        device = next(net.parameters()).device
    except StopIteration:
        device = torch.device("cpu")
    buffers = [(b, b.clone()) for b in net.buffers()]
    for training in (False, True):
        net.train(training)
        try:
            with torch.no_grad(), torch.random.fork_rng():
                outputs.append(net(x.to(device)))
        except Exception:  # a user's module: the clipping probe names its failure
            continue
        finally:
            with torch.no_grad():
                for buffer, value in buffers:
                    buffer.copy_(value)
    net.train(was_training)
    return outputs


def adapt(
    net: nn.Module,
    input_shape: tuple[int, ...],
    input_dtype: torch.dtype = torch.float32,
    inputs: str = "auto",
    key: str = "inputs",
) -> nn.Module:
    """``net`` itself when it already takes one tensor and returns logits; else ``net`` in a
    :class:`LibraryModel`. An output no logits can be read from is refused here (:func:`logits_from_output`)."""
    if isinstance(net, LibraryModel):
        return net
    if check_input_kind(inputs, net, key):
        adapted = LibraryModel(net, tokens=True, vocabulary=input_vocabulary(net))
        if not adapted.masked:
            LOG.info(
                "model: %s.forward takes input_ids and no attention_mask: it is called with the ids alone "
                "(padding read as tokens, as the model reads it outside dpml)",
                type(net).__name__,
            )
        return adapted
    outputs = [output for output in _example_outputs(net, input_shape, input_dtype) if output is not None]
    if all(isinstance(output, torch.Tensor) for output in outputs):
        return net
    for output in outputs:
        logits_from_output(output)
    return LibraryModel(net, tokens=False)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside an adapter (the module itself otherwise)."""
    return model.net if isinstance(model, LibraryModel) else model
