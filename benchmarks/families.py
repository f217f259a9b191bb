"""The model families people bring: dpml's DP-SGD step against the non-private step and Opacus (hooks,
ghost), time and peak memory side by side, measured interleaved.

Families, each built from a config with random weights (nothing is downloaded: ``HF_HUB_OFFLINE=1``):

- ``bert``: transformers' ``BertForSequenceClassification`` (2 classes);
- ``gpt2``: transformers' ``GPT2ForSequenceClassification`` (2 classes, pad token 0);
- ``encoder``: torch's ``nn.TransformerEncoder`` as a text classifier: token embedding plus a learned
  position embedding (``nn.Embedding`` called on ``arange(T)``, as user code often writes it), the encoder
  (``batch_first``, GELU, key padding mask), a final LayerNorm, the mean over the real tokens, a linear head;
- ``bert-lora``: peft's LoRA (r = 8, α = 16, on ``query`` and ``value``; the classifier trained, as peft's
  ``SEQ_CLS`` task does) on the BERT above, its body frozen;
- ``vit``: timm's ViT with ViT-Tiny's widths (192, 3 heads), 32×32 images, patch 4, 10 classes;
- ``resnet18-gn``: torchvision's ResNet-18 with ``GroupNorm(32, C)`` in place of BatchNorm, 32×32 images,
  10 classes (timm's ``resnet18`` with the same norm where torchvision is absent and timm imports);
- ``lstm`` (not in the default list: not among the issue's families): torch's ``nn.LSTM`` as a text classifier,
  token embedding (BERT's vocabulary), a stacked batch-first LSTM as wide as the size's hidden width with as many
  layers, the mean over the real tokens, a linear head (dpml runs its recurrence itself, a layer as its input
  product and one scan: :mod:`dpml.train.rules.recurrent`); ``lstm-packed``: the same LSTM on the real tokens only,
  packed (``pack_padded_sequence``, unsorted), its last layer's final state to the head; ``gru``, ``gru-packed``:
  the same with ``nn.GRU``; ``lstm-proj``: the padded LSTM with projections to half its width (``proj_size``);
- ``convnext`` (not in the default list either): timm's ConvNeXt-atto (depthwise 7×7 convolutions, LayerNorm over
  the channels, layer scale; the same at every size), 32×32 images, 10 classes;
- ``layers`` (by name, or ``--families layers`` for all): torch's own layers and parametrizations in small
  classifiers over sequences of feature vectors (``nn.Bilinear``, ``nn.TransformerDecoder``, ``nn.Transformer``,
  cells stepped in Python, ``weight_norm``, ``spectral_norm``, ``orthogonal``, …: ``benchmarks/layer_zoo.py``);
- ``timm`` (by name, or ``--families timm`` for all): one model of each of 60 more timm architectures (vision
  transformers and their variants, hierarchical and windowed transformers, MLPs and metaformers, convolutional
  networks), small, 32×32 images, BatchNorm2d as GroupNorm (``benchmarks/timm_zoo.py``).

Where a family's library cannot be imported, its row says so and why, rather than disappearing.
PyPI's torchvision wheel (which timm imports) is built against CUDA torch: beside a CPU-only torch its
compiled operators do not load, and its import fails on two detection operators it registers fake kernels
for. The script declares those two schemas first (:func:`_declare_torchvision_schemas`), so that its
pure-Python models import; no family calls a torchvision operator, and the page's versions line says so.

Sizes (``--size``): ``base`` is the honest shape (BERT-base / GPT-2 small: 768 wide, 12 layers, 12 heads;
ViT-Tiny's 12 blocks), ``small`` 256 wide, 4 layers, 4 heads (ViT: 6 blocks), ``tiny`` 128 wide, 2 layers,
2 heads (ViT: 2 blocks). The vocabularies are the real ones at every size (BERT's 30,522, GPT-2's 50,257;
the encoder BERT's), and ResNet-18 is ResNet-18 at every size. The default, ``tiny`` at batch 64, is what a
2-core CPU measures in minutes; ``base`` is the table to quote, on a GPU.

Inputs: token families take one integer tensor (B, 2, T), row 0 the ids and row 1 the attention mask;
each example has between T/2 and T real tokens, the rest padding (id 0, mask 0). A small wrapper hands the
rows to the model as ``input_ids`` / ``attention_mask`` and returns ``.logits`` (dpml's engine calls
``model(x)`` with one tensor). Images: (B, 3, 32, 32); the zoo's clips (B, 3, 8, 32, 32), its waveforms (B, 16000);
the layers' sequences of vectors (B, T, 128).
Random inputs and labels from seed 0, a fixed batch (the sampling is not what is timed).

Methods, each with its own copy of the model (seed 0, the same weights), all in one process per family
(by default each family runs in a child process of its own, under ``--family-timeout``, and all of them
under ``--total-timeout`` where it is given: one family's crash, exhausted memory or slowness does not take
the others with it, and its row says what happened):

- ``nonprivate``: forward, mean cross-entropy, backward, ``optimizer.step()`` (SGD);
- ``dpml``: the trainer's own step: :func:`dpml.train.clipping_check.plan_clipping` first (which parameters
  must take the exact per-example path), the chunk the trainer would clip in (``fastest_chunk``, tuned, at
  most the batch, its timings on the page; ``--dpml-chunk whole`` for one chunk), then per step
  :func:`clipped_sum_and_noise` (C = 1, σ = 1; on the CPU the trainer's noise stream), the noise added in place,
  divided by the batch, SGD;
- ``opacus-hooks``, ``opacus-ghost``: Opacus' ``PrivacyEngine.make_private`` with ``grad_sample_mode``
  ``"hooks"`` (``GradSampleModule``) or ``"ghost"`` (fast gradient clipping), the model as brought
  (``ModuleValidator.fix`` is not applied). A method that raises while it is set up is reported as
  ``refuses: <reason>``; one that raises in a step as ``crashes: <exception>``. On the CPU, Opacus' hooks are
  not run where their per-example gradients alone (batch × trainable parameters × 4 bytes) would need more
  than half the memory the machine has available (the kernel would kill the process): ``not run: …``.

Timing as ``benchmarks/speed.py``: warm-up steps each (below), then rounds that alternate the methods (Opacus
in ``--peer-rounds`` evenly spaced rounds only); where dpml's CPU noise is drawn in a background thread
(``PrefetchedNoise``, a core left idle by torch's threads) each dpml turn is an untimed lead-in step and a
timed step, its background draw waited for, untimed, before the next method (where the draw is in the
step, ``SynchronousNoise``, or on a GPU, one timed step). On the CPU each family's process runs under the
malloc settings dpml's trainer sets there (:func:`dpml.devices.keep_freed_cpu_memory`: freed memory kept
for the next step), so every method, non-private included, steps without faulting its pages in anew.
Median step time per method; the throughput ratio is the non-private median over the method's median, from
the same rounds. A family run in its own process
stops its rounds early once three quarters of its ``--family-timeout`` are spent (the page says after how
many), so that a slow family still gives a row.

Peak memory, on the untimed warm-up steps before the rounds (a first step, and a second one, whose
measurement replaces the first's, unless the first took 10 s or more; gradients set to ``None`` first, so
that no method carries a step's gradients into the measured one): on a GPU, ``torch.cuda.max_memory_allocated``
during the step minus what was allocated before it (the step's own working memory: activations,
gradients, per-example state; the models of the other methods stay resident and are not counted), plus for dpml
what its CUDA graphs hold (:func:`dpml.train.captured.graph_memory`: their pool, never counted as allocated), and the
absolute peak in the JSON; on the CPU, the process's peak resident set size during the step minus its
resident set size before it (``VmHWM`` after resetting it through ``/proc/self/clear_refs``, after
``gc.collect()`` and glibc's ``malloc_trim(0)``, so that memory freed by an earlier step is not silently
reused). dpml's memory is measured twice where its chunk is smaller than the batch: in its chunk, and in
one chunk of the whole batch (the same physical batch as the non-private step; the table's ratio).

Output: ``<out>/<stem>.md`` and ``.json`` (stem ``families``, ``families_cuda`` on a GPU, or ``--stem``) with the
command, the machine (CPU model, cores, GPU, library versions), the git commit and the load average.

    pip install -r benchmarks/requirements-families.txt   # Opacus, transformers, peft (timm, torchvision: see there)
    python benchmarks/families.py [--size tiny|small|base] [--batch 64] [--length 128] [--rounds 10]
                                  [--peer-rounds 3] [--families bert gpt2 ...] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_common import CpuPeak, cpu_name, current_commit  # noqa: E402  (benchmarks/ is the script's folder)
from family_zoo import (  # noqa: E402
    AUDIO_SAMPLES,
    AUDIO_ZOO,
    CLIP_FRAMES,
    END_OF_SEQUENCE,
    IMAGE_ZOO,
    NEWER_TEXT,
    PEFT_FAMILIES,
    PEFT_ON_BERT,
    TEXT_ZOO,
    TIMM_IMAGES,
    VIDEO_ZOO,
    ZOO,
    build_audio,
    build_image,
    build_text,
    build_video,
)
from layer_zoo import LAYER_CLASSES, LAYER_FEATURES, LAYER_ZOO, build_layer  # noqa: E402
from timm_zoo import TIMM_ZOO, build_timm  # noqa: E402

FAMILIES = ["bert", "gpt2", "encoder", "bert-lora", "vit", "resnet18-gn"]
# asked for by name only (``zoo``: all of ZOO)
MORE_FAMILIES = ["lstm", "lstm-packed", "gru", "gru-packed", "lstm-proj", "convnext", *ZOO, *LAYER_ZOO, *TIMM_ZOO]
TEXT = {"bert", "gpt2", "encoder", "bert-lora", "lstm", "lstm-packed", "gru", "gru-packed", "lstm-proj", *TEXT_ZOO}
METHODS = ["nonprivate", "dpml", "opacus-hooks", "opacus-ghost"]
PEERS = ("opacus-hooks", "opacus-ghost")
SIZES = {
    "tiny": {"hidden": 128, "layers": 2, "heads": 2, "ffn": 512, "vit_depth": 2},
    "small": {"hidden": 256, "layers": 4, "heads": 4, "ffn": 1024, "vit_depth": 6},
    "base": {"hidden": 768, "layers": 12, "heads": 12, "ffn": 3072, "vit_depth": 12},
}
BERT_VOCAB, GPT2_VOCAB = 30522, 50257
TEXT_CLASSES, IMAGE_CLASSES = 2, 10
SPEED_TARGET, MEMORY_TARGET = 0.7, 1.5


class NotImportable(RuntimeError):
    """The family's library does not import here."""


# ----------------------------------------------------------------------------------------------- the models


def _torch():  # noqa: ANN202
    import torch

    return torch


def _token_wrapper():  # noqa: ANN202
    from torch import nn

    class TokenModel(nn.Module):
        """One integer tensor (B, 2, T) → the wrapped model's logits: row 0 the ids, row 1 the attention mask."""

        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, x):  # noqa: ANN001, ANN201
            # contiguous, as a tokenizer's tensors are (Opacus' ghost embedding norms .view() the ids)
            return self.model(input_ids=x[:, 0].contiguous(), attention_mask=x[:, 1].contiguous()).logits

        def probe_input(self, shape, dtype, count, generator):  # noqa: ANN001, ANN201
            """dpml's clipping probe: valid ids and masks with padding, as for a model through ``dpml.train_private``
            (OPT's positions count the mask: a mask of random ids would index past its position table), each ending in
            the model's ``<eos>`` where it names one (BART's and T5's classifiers read the last one)."""
            from dpml.models.library import input_vocabulary, probe_tokens, token_conventions

            vocabulary = input_vocabulary(self.model)
            return probe_tokens(count, shape[-1], vocabulary, generator, token_conventions(self.model)).to(dtype)

    return TokenModel


def _encoder_classifier():  # noqa: ANN202
    import torch
    from torch import nn

    class EncoderClassifier(nn.Module):
        """Token + learned position embeddings, ``nn.TransformerEncoder``, LayerNorm, mean over real tokens, head."""

        def __init__(self, vocab: int, length: int, hidden: int, layers: int, heads: int, ffn: int) -> None:
            super().__init__()
            self.tokens = nn.Embedding(vocab, hidden)
            self.positions = nn.Embedding(length, hidden)
            layer = nn.TransformerEncoderLayer(hidden, heads, ffn, dropout=0.1, activation="gelu", batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(hidden)
            self.head = nn.Linear(hidden, TEXT_CLASSES)

        def forward(self, x):  # noqa: ANN001, ANN201
            ids, mask = x[:, 0], x[:, 1]
            h = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
            h = self.norm(self.encoder(h, src_key_padding_mask=mask == 0))
            keep = mask.unsqueeze(-1).to(h.dtype)
            return self.head((h * keep).sum(1) / keep.sum(1).clamp(min=1))

    return EncoderClassifier


def _lstm_classifier():  # noqa: ANN202
    from torch import nn

    from torch.nn.utils.rnn import pack_padded_sequence

    class LstmClassifier(nn.Module):
        """Token embedding, a stacked batch-first ``nn.LSTM`` (or ``nn.GRU``), the mean over the real tokens, a
        linear head; or (``packed``) the recurrence on the real tokens only, its last layer's final state to the
        head."""

        def __init__(
            self, vocab: int, hidden: int, layers: int, packed: bool = False, cell: str = "lstm", proj: int = 0
        ) -> None:
            super().__init__()
            self.tokens = nn.Embedding(vocab, hidden)
            if cell == "gru":
                self.lstm = nn.GRU(hidden, hidden, num_layers=layers, batch_first=True)
            else:
                self.lstm = nn.LSTM(hidden, hidden, num_layers=layers, batch_first=True, proj_size=proj)
            self.head = nn.Linear(proj or hidden, TEXT_CLASSES)
            self.packed = packed

        def forward(self, x):  # noqa: ANN001, ANN201
            ids, mask = x[:, 0], x[:, 1]
            if self.packed:
                lengths = (mask != 0).sum(1).clamp(min=1).cpu()  # (the plan's synthetic probe has masks of any ints)
                _, final = self.lstm(pack_padded_sequence(self.tokens(ids), lengths, True, enforce_sorted=False))
                return self.head((final[0] if isinstance(final, tuple) else final)[-1])
            h, _ = self.lstm(self.tokens(ids))
            keep = mask.unsqueeze(-1).to(h.dtype)
            return self.head((h * keep).sum(1) / keep.sum(1).clamp(min=1))

    return LstmClassifier


def _import(what: str):  # noqa: ANN202
    """Import ``what``, or raise :class:`NotImportable` saying why (any error: a wheel built for another torch
    fails with RuntimeError, not ImportError). torchvision first gets what :func:`_declare_torchvision_schemas`
    gives it (timm, and transformers' vision code, import it)."""
    import importlib

    _declare_torchvision_schemas()
    try:
        return importlib.import_module(what)
    except Exception as error:  # noqa: BLE001
        reason = f"{type(error).__name__}: {error}".splitlines()[0]
        raise NotImportable(
            f"{what} not importable beside this torch build ({_torch().__version__}): {reason}"
        ) from error


def _torchvision_ops_load() -> bool | None:
    """Whether torchvision's compiled operators load beside this torch (None: torchvision is absent). PyPI's
    torchvision wheel is built against CUDA torch; beside a CPU-only torch its ``_C`` library cannot load."""
    import importlib.util

    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return None
    library = next(Path(spec.origin).parent.glob("_C*.so"), None)
    if library is None:
        return False
    try:
        _torch().ops.load_library(str(library))
    except (OSError, RuntimeError):
        return False
    return True


_VISION_SCHEMAS: list[Any] = []  # the torch.library that declares them, kept alive for the process


def _declare_torchvision_schemas() -> None:
    """Where torchvision's compiled operators cannot load (see :func:`_torchvision_ops_load`), its import
    still registers fake kernels for two detection operators, ``nms`` and ``qnms``, and fails because they do
    not exist: their schemas are declared here first (no kernel), which lets its pure-Python models import.
    No family calls a torchvision operator (ResNet-18 and the ViT are convolutions, norms, linear maps and
    attention), so nothing measured runs through them; the page's versions line says when this was done."""
    if _VISION_SCHEMAS or _torchvision_ops_load() is not False:
        return
    library = _torch().library.Library("torchvision", "DEF")
    for name in ("nms", "qnms"):
        library.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _VISION_SCHEMAS.append(library)


def _bert(size: dict, length: int):  # noqa: ANN202
    transformers = _import("transformers")
    config = transformers.BertConfig(
        vocab_size=BERT_VOCAB,
        hidden_size=size["hidden"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        intermediate_size=size["ffn"],
        max_position_embeddings=max(512, length),
        num_labels=TEXT_CLASSES,
    )
    return transformers.BertForSequenceClassification(config)


def build(family: str, size_name: str, length: int):  # noqa: ANN201
    """The family's model (random weights from the current seed), and a line on what it is."""
    size = SIZES[size_name]
    if family == "bert":
        model = _bert(size, length)
        return _token_wrapper()(model), f"BertForSequenceClassification, attention {model.config._attn_implementation}"
    if family == "gpt2":
        transformers = _import("transformers")
        config = transformers.GPT2Config(
            vocab_size=GPT2_VOCAB,
            n_embd=size["hidden"],
            n_layer=size["layers"],
            n_head=size["heads"],
            n_inner=size["ffn"],
            n_positions=max(1024, length),
            num_labels=TEXT_CLASSES,
            pad_token_id=0,
        )
        model = transformers.GPT2ForSequenceClassification(config)
        return _token_wrapper()(model), f"GPT2ForSequenceClassification, attention {model.config._attn_implementation}"
    if family == "encoder":
        model = _encoder_classifier()(BERT_VOCAB, length, size["hidden"], size["layers"], size["heads"], size["ffn"])
        return model, "nn.TransformerEncoder classifier"
    if family in ("lstm", "lstm-packed", "gru", "gru-packed", "lstm-proj"):
        packed, cell, proj = family.endswith("-packed"), family.split("-")[0], size["hidden"] // 2
        projected = family == "lstm-proj"
        model = _lstm_classifier()(BERT_VOCAB, size["hidden"], size["layers"], packed, cell, proj if projected else 0)
        shape = "packed real tokens" if packed else f"batch-first, projected to {proj}" if projected else "batch-first"
        return model, f"nn.{cell.upper()} classifier ({size['layers']} layers, {size['hidden']} wide, {shape})"
    if family == "bert-lora":
        peft = _import("peft")
        bert = _bert(size, length)
        config = peft.LoraConfig(
            task_type=peft.TaskType.SEQ_CLS, r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["query", "value"]
        )
        model = peft.get_peft_model(bert, config)
        return _token_wrapper()(model), "peft LoRA r=8 on BERT's query and value, the body frozen"
    if family == "vit":
        timm = _import("timm")
        model = timm.create_model(
            "vit_tiny_patch16_224",
            pretrained=False,
            img_size=32,
            patch_size=4,
            num_classes=IMAGE_CLASSES,
            depth=size["vit_depth"],
        )
        return model, f"timm {timm.__version__} ViT (192 wide, 3 heads, {size['vit_depth']} blocks, patch 4)"
    if family == "convnext":
        timm = _import("timm")
        model = timm.create_model("convnext_atto", pretrained=False, num_classes=IMAGE_CLASSES)
        return model, f"timm {timm.__version__} ConvNeXt-atto (depthwise 7×7, LayerNorm over channels, layer scale)"
    if family == "resnet18-gn":
        from torch import nn

        def group_norm(channels: int) -> nn.Module:
            return nn.GroupNorm(32, channels)

        try:
            models = _import("torchvision.models")
            return models.resnet18(
                num_classes=IMAGE_CLASSES, norm_layer=group_norm
            ), "torchvision ResNet-18, GroupNorm(32, C)"
        except NotImportable as missing:
            try:
                timm = _import("timm")
            except NotImportable as also:
                raise NotImportable(f"{missing}; {also}") from also
            return (
                timm.create_model("resnet18", pretrained=False, num_classes=IMAGE_CLASSES, norm_layer=group_norm),
                "timm ResNet-18, GroupNorm(32, C)",
            )
    if family in TEXT_ZOO:
        _import("peft" if family in PEFT_FAMILIES else "transformers")  # NotImportable, else imported as the zoo's
        model, description = build_text(family, size, length, BERT_VOCAB, TEXT_CLASSES)
        return _token_wrapper()(model), description
    if family in IMAGE_ZOO:
        _import("timm" if family in TIMM_IMAGES else "torchvision.models")
        return build_image(family, size, IMAGE_CLASSES)
    if family in VIDEO_ZOO:
        _import("transformers" if family == "videomae" else "torchvision.models")
        return build_video(family, size, IMAGE_CLASSES)
    if family in AUDIO_ZOO:
        _import("transformers")
        return build_audio(family, size, IMAGE_CLASSES)
    if family in LAYER_ZOO:
        return build_layer(family, size, LAYER_CLASSES)
    if family in TIMM_ZOO:
        _import("timm")
        return build_timm(family, IMAGE_CLASSES)
    raise ValueError(f"unknown family {family!r}")


def example_batch(family: str, batch: int, length: int, device: str):  # noqa: ANN201
    """Random inputs and labels (seed 0): token ids with a mask and some padding, 32×32 images, clips of them, or
    waveforms."""
    torch = _torch()
    generator = torch.Generator().manual_seed(0)
    if family in TEXT:
        vocab = GPT2_VOCAB if family == "gpt2" else BERT_VOCAB
        lengths = torch.randint(length // 2, length + 1, (batch,), generator=generator)
        mask = (torch.arange(length) < lengths[:, None]).long()
        ids = torch.randint(1, vocab, (batch, length), generator=generator) * mask
        if family in END_OF_SEQUENCE:  # a tokenizer's layout: one <eos>, the last kept token
            eos = END_OF_SEQUENCE[family]
            ids = torch.where(ids == eos, eos + 1, ids)
            ids[torch.arange(batch), lengths - 1] = eos
        x, classes = torch.stack([ids, mask], 1), TEXT_CLASSES
    elif family in VIDEO_ZOO:
        x, classes = torch.randn(batch, 3, CLIP_FRAMES, 32, 32, generator=generator), IMAGE_CLASSES
    elif family in AUDIO_ZOO:
        x, classes = torch.randn(batch, AUDIO_SAMPLES, generator=generator), IMAGE_CLASSES
    elif family in LAYER_ZOO:
        x, classes = torch.randn(batch, length, LAYER_FEATURES, generator=generator), LAYER_CLASSES
    else:
        x, classes = torch.randn(batch, 3, 32, 32, generator=generator), IMAGE_CLASSES
    y = torch.randint(0, classes, (batch,), generator=generator)
    return x.to(device), y.to(device)


# ------------------------------------------------------------------------------------------- the steps


class MethodError(Exception):
    """A method that could not be set up (``refuses``) or not be run (``not run``)."""

    def __init__(self, verdict: str, reason: str) -> None:
        super().__init__(f"{verdict}: {reason}")
        self.verdict = verdict


def _one_line(error: BaseException, limit: int = 400) -> str:
    text = f"{type(error).__name__}: {error}".replace("\n", " ").strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def step_function(family: str, method: str, args: argparse.Namespace, x, y) -> Callable[[], None]:  # noqa: ANN001, C901
    """One training step of ``method`` with its own copy of the model (seed 0); attributes: ``model``,
    ``chunk``, ``settle`` / ``close`` (dpml's CPU noise stream), ``info`` (plan, chunk choice)."""
    torch = _torch()
    import torch.nn.functional as F

    torch.manual_seed(0)
    model, _ = build(family, args.size, args.length)
    model = model.to(x.device).train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=0.01)
    if method == "nonprivate":

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()

        step.model = model  # type: ignore[attr-defined]
        return step
    if method == "dpml":
        return _dpml_step(model, optimizer, args, x, y)
    return _opacus_step(model, optimizer, method, x, y)


def _dpml_step(model, optimizer, args: argparse.Namespace, x, y) -> Callable[[], None]:  # noqa: ANN001
    torch = _torch()
    from dpml.train.captured import capture_report, graph_memory
    from dpml.train.chunking import fastest_chunk
    from dpml.train.clipping_check import ClippingUnsupported, plan_clipping
    from dpml.train.dpsgd import clipped_sum_and_noise, per_example_cross_entropy, trainable_parameters
    from dpml.train.noise import PrefetchedNoise, cpu_noise_stream

    batch, shape = x.shape[0], tuple(x.shape[1:])
    start = time.perf_counter()
    try:
        plan = plan_clipping(model, per_example_cross_entropy, shape, x.dtype)
    except (ClippingUnsupported, ValueError) as error:  # (ValueError: a layer dpml refuses, as batch norm)
        raise MethodError("refuses", _one_line(error)) from error
    plan_seconds = time.perf_counter() - start
    exact_set = getattr(plan, "exact", frozenset())
    exact_names = list(getattr(plan, "exact_parameters", None) or sorted(exact_set))
    start = time.perf_counter()
    choice = (
        None
        if args.dpml_chunk == "whole"
        else fastest_chunk(model, per_example_cross_entropy, shape, x.dtype, batch, batch, exact_set)
    )
    chunk = batch if choice is None else choice.chunk
    tune_seconds = time.perf_counter() - start
    params = trainable_parameters(model)
    generator: Any = torch.Generator(device=x.device).manual_seed(0)
    if x.device.type == "cpu":  # as the trainer: a step ahead where a core is idle, else in the step
        generator = cpu_noise_stream(generator, params, 1.0)
    state = {"chunk": chunk}
    info: dict[str, Any] = {
        "chunk": chunk,
        "exact_parameters": exact_names,
        "trainable_parameters": len(params),
        "plan_seconds": plan_seconds,
        "tune_seconds": tune_seconds,
        **({"tuner": choice.line()} if choice is not None else {}),  # (the time per example of each chunk it timed)
        "plan_notes": list(getattr(plan, "notes", ())),
    }

    def dp_step() -> None:  # as run_dpsgd_steps: the noise added to the step's own sums, in place
        sums, noises, _ = clipped_sum_and_noise(model, x, y, 1.0, 1.0, state["chunk"], generator, exact=exact_set)
        for name, p in params.items():
            p.grad = sums[name].add_(noises[name]).div_(batch)
        optimizer.step()

    dp_step.model = model  # type: ignore[attr-defined]
    dp_step.held = lambda: graph_memory(model)  # type: ignore[attr-defined]
    dp_step.state = state  # type: ignore[attr-defined]
    stop_noise = getattr(generator, "close", lambda: None)

    def close() -> None:  # (the step let go: what its chunks did on a GPU noted first, outside the timed steps)
        if x.device.type == "cuda":  # from CUDA graphs, or eagerly and why (dpml.train.captured)
            info["cuda_graphs"] = capture_report(model)
        stop_noise()

    dp_step.close = close  # type: ignore[attr-defined]
    # a lead-in step and a wait only where the draw runs in the background (PrefetchedNoise): a synchronous
    # stream draws inside the timed step
    dp_step.settle = generator.wait if isinstance(generator, PrefetchedNoise) else None  # type: ignore[attr-defined]
    dp_step.info = info  # type: ignore[attr-defined]
    return dp_step


def _opacus_step(model, optimizer, method: str, x, y) -> Callable[[], None]:  # noqa: ANN001
    torch = _torch()
    batch = x.shape[0]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    available = _available_bytes()
    if method == "opacus-hooks" and x.device.type == "cpu" and available and batch * trainable * 4 > available / 2:
        raise MethodError(
            "not run",
            f"its per-example gradients alone need {batch * trainable * 4 / 2**30:.1f} GiB "
            f"({batch} × {trainable:,} × 4 bytes), more than half the "
            f"{available / 2**30:.1f} GiB available",
        )
    try:
        from opacus import PrivacyEngine
        from torch.utils.data import DataLoader, TensorDataset

        loader = DataLoader(TensorDataset(x, y), batch_size=batch)
        mode = "ghost" if method == "opacus-ghost" else "hooks"
        made = PrivacyEngine(accountant="rdp").make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            criterion=torch.nn.CrossEntropyLoss(),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
            grad_sample_mode=mode,
        )
    except Exception as error:  # noqa: BLE001 — Opacus' own checks, or its set-up failing on this model
        raise MethodError("refuses", _one_line(error)) from error
    if mode == "ghost":
        private, private_optimizer, criterion, _ = made
    else:
        (private, private_optimizer, _), criterion = made, torch.nn.CrossEntropyLoss()

    def peer_step() -> None:
        private_optimizer.zero_grad(set_to_none=True)
        criterion(private(x), y).backward()
        private_optimizer.step()

    peer_step.model = private  # type: ignore[attr-defined]
    peer_step.optimizer = private_optimizer  # type: ignore[attr-defined]
    return peer_step


# ------------------------------------------------------------------------------------------- measuring


def _synchronise(device) -> None:  # noqa: ANN001
    if device.type == "cuda":
        _torch().cuda.synchronize()


def clear_gradients(step) -> None:  # noqa: ANN001
    """No gradient (nor Opacus' per-example state) carried into the measured step."""
    for p in step.model.parameters():
        p.grad = None
        for attribute in ("grad_sample", "_norm_sample", "summed_grad"):
            if getattr(p, attribute, None) is not None:
                setattr(p, attribute, None)


def step_memory(step, device, cpu_peak: CpuPeak | None) -> dict[str, float]:  # noqa: ANN001
    """MiB the step needs above what was allocated before it (module docstring), and on a GPU the absolute peak."""
    torch = _torch()
    settle = getattr(step, "settle", None)
    clear_gradients(step)
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() + getattr(step, "held", lambda: 0)()  # (CUDA graphs' pool, buffers)
        return {"peak_mib": (peak - before) / 2**20, "absolute_peak_mib": peak / 2**20}
    assert cpu_peak is not None
    used = cpu_peak.during(step)
    if settle is not None:
        settle()
    return {"peak_mib": used / 2**20}


SLOW_STEP = 10.0  # seconds: a first step this slow is the only warm-up step


def warm_up(step, device, cpu_peak: CpuPeak | None, memory: dict, method: str, batch: int) -> None:  # noqa: ANN001
    """Untimed steps before the rounds: a first one (first-call costs), and a second one unless the first took
    ``SLOW_STEP`` seconds or more. The peak memory is measured on them (the second's replaces the first's),
    never on a timed step: the measurement returns freed memory to the system, which the next step would
    fault in again. dpml in a chunk smaller than the batch: one more step in one chunk of the whole batch,
    for its memory at the non-private step's physical batch."""
    measure = device.type == "cuda" or cpu_peak is not None
    for _ in range(2):
        start = time.perf_counter()
        if measure:
            memory[method] = step_memory(step, device, cpu_peak)
        else:
            step()
        _settle(step)
        _synchronise(device)
        if time.perf_counter() - start >= SLOW_STEP:
            break
    state = getattr(step, "state", None)
    if state is not None and state["chunk"] < batch and measure:
        tuned, state["chunk"] = state["chunk"], batch
        try:
            memory[method] |= {f"whole_{k}": v for k, v in step_memory(step, device, cpu_peak).items()}
        except Exception as error:  # noqa: BLE001 — the whole batch in one chunk may not fit: that is the result
            memory[method]["whole_error"] = _one_line(error)
            if device.type == "cuda":
                _torch().cuda.empty_cache()
        finally:
            state["chunk"] = tuned


def _settle(step) -> None:  # noqa: ANN001
    settle = getattr(step, "settle", None)
    if settle is not None:
        settle()


def measure_family(family: str, args: argparse.Namespace) -> list[dict]:  # noqa: C901
    """Every method on one family: set-up, interleaved timed rounds, then one memory step each."""
    torch = _torch()
    started = time.perf_counter()
    device = torch.device(args.device)
    base = {
        "family": family,
        "size": args.size,
        "batch": args.batch,
        "length": args.length if family in TEXT else None,
        "device": args.device,
    }
    try:
        torch.manual_seed(0)
        model, description = build(family, args.size, args.length)
        parameters = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        del model
    except NotImportable as error:
        return [{**base, "method": m, "verdict": "not importable", "error": str(error)} for m in METHODS]
    base.update(model=description, parameters=parameters, trainable=trainable)
    x, y = example_batch(family, args.batch, args.length, args.device)
    methods = [m for m in METHODS if m not in PEERS or m in args.peers]
    steps: dict[str, Callable[[], None]] = {}
    errors: dict[str, tuple[str, str]] = {}
    setup_seconds: dict[str, float] = {}
    infos: dict[str, dict[str, Any] | None] = {}  # the plan and chunk of each step, kept if it crashes later
    memory: dict[str, dict[str, Any]] = {}
    cpu_peak = CpuPeak() if device.type == "cpu" else None
    memory_note = cpu_peak.error if cpu_peak is not None else None
    for method in methods:
        start = time.perf_counter()
        try:
            steps[method] = step_function(family, method, args, x, y)
        except MethodError as error:
            errors[method] = (error.verdict, str(error).split(": ", 1)[1])
        except Exception as error:  # noqa: BLE001 — building the method's step failed outside its own checks
            errors[method] = ("crashes", _one_line(error))
        setup_seconds[method] = time.perf_counter() - start
        if method in steps:
            infos[method] = getattr(steps[method], "info", None)
            try:
                warm_up(steps[method], device, cpu_peak if memory_note is None else None, memory, method, args.batch)
            except Exception as error:  # noqa: BLE001
                errors[method] = ("crashes", _one_line(error))
            if method in errors:  # dropped after the except clause: its traceback's frames no longer hold its tensors
                _drop(steps, method, device)
        print(
            f"[families] {family} {method}: set up in {setup_seconds[method]:.1f} s"
            + (f"; {errors[method][0]}: {errors[method][1]}" if method in errors else ""),
            flush=True,
        )
    every = max(1, args.rounds // max(1, args.peer_rounds))
    times: dict[str, list[float]] = {m: [] for m in steps}
    rounds = args.rounds
    for r in range(args.rounds):
        if r and args.budget and time.perf_counter() - started > 0.75 * args.budget:  # leave time to finish the round
            rounds = r
            print(
                f"[families] {family}: {r} of {args.rounds} rounds done when three quarters of its "
                f"{args.budget:.0f} s were spent; the rest are not run",
                flush=True,
            )
            break
        for method in list(steps):
            step = steps[method]
            if method in PEERS and (r % every or len(times[method]) >= args.peer_rounds):
                continue
            settle = getattr(step, "settle", None)
            try:
                if settle is not None:  # a lead-in step, so the timed one overlaps its own next draw, as in a loop
                    step()
                _synchronise(device)
                start = time.perf_counter()
                step()
                _synchronise(device)
                times[method].append(time.perf_counter() - start)
                if settle is not None:  # its background draw done before the next method is timed
                    settle()
            except Exception as error:  # noqa: BLE001
                errors[method] = ("crashes", _one_line(error))
            if method in errors:  # as in the set-up: dropped once the traceback is gone
                _drop(steps, method, device)
    for method in list(steps):
        _drop(steps, method, device)
    if "nonprivate" not in times or not times["nonprivate"]:
        verdict, reason = errors.get("nonprivate", ("crashes", "no timed step"))
        return [{**base, "method": m, "verdict": f"non-private step {verdict}", "error": reason} for m in methods]
    baseline = statistics.median(times["nonprivate"])
    base_memory = memory.get("nonprivate", {}).get("peak_mib")
    rows = []
    for method in methods:
        row: dict[str, Any] = {**base, "method": method, "setup_seconds": setup_seconds.get(method), "rounds": rounds}
        if method in errors and not times.get(method):
            row.update(verdict=errors[method][0], error=errors[method][1])
            rows.append(row)
            continue
        if not times.get(method):
            row.update(verdict="not timed", error=f"the family's time ran out after {rounds} rounds, before its turn")
            rows.append(row)
            continue
        if method in errors:  # it ran some rounds, then failed
            row.update(verdict=errors[method][0], error=errors[method][1])
        ms = 1000 * statistics.median(times[method])
        row.update(
            ms_per_step=ms,
            steps=len(times[method]),
            throughput=1000 * baseline / ms,
            **(memory.get(method) or {}),
            **(infos.get(method) or {}),
        )
        peak = None if "whole_error" in row else row.get("whole_peak_mib", row.get("peak_mib"))
        if base_memory and isinstance(peak, float):
            row["memory_ratio"] = peak / base_memory
        if memory_note:
            row["memory_note"] = memory_note
        rows.append(row)
    return rows


def _drop(steps: dict, method: str, device) -> None:  # noqa: ANN001
    step = steps.pop(method, None)
    if step is not None:
        getattr(step, "close", lambda: None)()
    del step
    gc.collect()
    if device.type == "cuda":
        _torch().cuda.empty_cache()


# ----------------------------------------------------------------------------------------- running, output


def run_isolated(family: str, args: argparse.Namespace, limit: float) -> list[dict]:
    """The family in a child process of its own under ``limit`` seconds."""
    with tempfile.TemporaryDirectory() as folder:
        part = Path(folder) / "rows.json"
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            *_arguments(args, [family]),
            "--part",
            str(part),
            "--budget",
            str(max(1.0, limit - 10)),
        ]
        start = time.perf_counter()
        try:
            finished = subprocess.run(command, timeout=limit, check=False)
            code = finished.returncode
        except subprocess.TimeoutExpired:
            code = None
        if part.exists():
            return json.loads(part.read_text())
        seconds = time.perf_counter() - start
    reason = (
        f"timed out after {limit:.0f} s (--family-timeout, or what --total-timeout left)"
        if code is None
        else f"the family's process ended with status {code}"
        + (" (killed: out of memory?)" if code in (-9, 137) else "")
        + f" after {seconds:.0f} s"
    )
    return [
        {
            "family": family,
            "size": args.size,
            "batch": args.batch,
            "device": args.device,
            "method": m,
            "verdict": "not finished" if code is None else "crashes",
            "error": reason,
        }
        for m in METHODS
    ]


def _arguments(args: argparse.Namespace, families: list[str]) -> list[str]:
    """The options that reproduce this run (for the child processes and the page's command line)."""
    out = [
        "--size",
        args.size,
        "--batch",
        str(args.batch),
        "--length",
        str(args.length),
        "--rounds",
        str(args.rounds),
        "--peer-rounds",
        str(args.peer_rounds),
        "--device",
        args.device,
        "--families",
        *families,
    ]
    if list(args.peers) != list(PEERS):
        out += ["--peers", *args.peers]
    if args.dpml_chunk != "tuned":
        out += ["--dpml-chunk", args.dpml_chunk]
    if args.threads:
        out += ["--threads", str(args.threads)]
    if args.keep_share is not None:
        out += ["--keep-share", f"{args.keep_share:g}"]
    return out


def versions() -> dict[str, str]:
    import importlib.metadata as metadata

    found = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "timm", "torchvision", "opacus"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "absent"
    if _torchvision_ops_load() is False:
        found["torchvision"] += (
            " (its compiled operators do not load beside this torch: the models imported without them)"
        )
    return found


def machine(args: argparse.Namespace) -> dict[str, Any]:
    torch = _torch()
    found = {
        "cpu": cpu_name(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "versions": versions(),
        "load_average_15min_at_end": round(os.getloadavg()[2], 2),
    }
    if args.device == "cuda":
        found["gpu"] = torch.cuda.get_device_name(0)
        found["cuda"] = torch.version.cuda
    return found


def _cell(row: dict) -> str:
    """A peer's cell: its throughput ratio and time, or its verdict."""
    if "ms_per_step" not in row:
        return f"{row['verdict']}: {_short(row['error'])}"
    text = f"{row['throughput']:.2f} ({row['ms_per_step']:.0f} ms)"
    return text + (f"; then {row['verdict']}: {_short(row['error'])}" if "error" in row else "")


def _short(text: str, limit: int = 160) -> str:
    text = text.replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def page(rows: list[dict], meta: dict[str, Any]) -> str:  # noqa: C901
    cuda = meta["args"]["device"] == "cuda"
    where = f"GPU {meta['machine']['gpu']}" if cuda else "CPU"
    v = meta["machine"]["versions"]
    memory_how = (
        "`torch.cuda.max_memory_allocated` during one step minus what was allocated before it"
        if cuda
        else "peak resident set size during one step minus the resident set size before it "
        "(`VmHWM` reset through `/proc/self/clear_refs`, after `gc.collect()` and `malloc_trim(0)`)"
    )
    lines = [
        f"# Model families: dpml's DP-SGD step against non-private and Opacus{meta['label']}",
        "",
        f"Command: `{meta['command']}`. Commit {meta['commit']}, {meta['date']}. Machine: {meta['machine']['cpu']}, "
        f"{meta['machine']['logical_cpus']} logical CPUs, {meta['machine']['torch_threads']} torch threads"
        + (f", {meta['machine']['gpu']} (CUDA {meta['machine']['cuda']})" if cuda else "")
        + f"; torch {v['torch']}, transformers {v['transformers']}, peft {v['peft']}, timm {v['timm']}, "
        f"torchvision {v['torchvision']}, opacus {v['opacus']}, Python {v['python']}. Load average over the "
        f"last 15 minutes at the end: {meta['machine']['load_average_15min_at_end']} on "
        f"{meta['machine']['logical_cpus']} cores"
        + (
            " (other jobs shared the machine: the times are noisy)"
            if meta["machine"]["load_average_15min_at_end"] > 0.5 * (meta["machine"]["logical_cpus"] or 1) and not cuda
            else ""
        )
        + ".",
        "",
        f"Size `{meta['args']['size']}`, batch {meta['args']['batch']} (token families: sequences of "
        f"{meta['args']['length']} tokens, T/2 to T of them real; images 3×32×32; clips 3×{CLIP_FRAMES}×32×32). "
        "Per family one process, the "
        f"methods' steps alternating over {meta['args']['rounds']} rounds (Opacus in {meta['args']['peer_rounds']}"
        f" of them), median step time; throughput = non-private median / the method's. Peak memory: "
        f"{memory_how}; dpml in one chunk of the whole batch (the non-private step's physical batch). "
        f"Targets: DP throughput ≥ {SPEED_TARGET} × non-private, no parameter on the exact path"
        + (f", DP peak memory ≤ {MEMORY_TARGET} × non-private" if cuda else "")
        + ".",
        "",
        "| family | where | batch | non-private ms | dpml ms (chunk) | dpml throughput | Opacus hooks | "
        "Opacus ghost | peak memory DP / non-private | exact-path parameters | targets |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    families = list(dict.fromkeys(r["family"] for r in rows))
    details = []
    for family in families:
        by = {r["method"]: r for r in rows if r["family"] == family}
        non, dp = by.get("nonprivate", {}), by.get("dpml", {})
        if "ms_per_step" not in non:
            lines.append(
                f"| {family} | {where} | {meta['args']['batch']} | {non.get('verdict', '?')}: "
                f"{_short(non.get('error', ''), 240)} | | | | | | | |"
            )
            continue
        if "ms_per_step" in dp and "verdict" not in dp:
            dp_cell = f"{dp['ms_per_step']:.1f} ({dp['chunk']})"
            ratio = f"**{dp['throughput']:.2f}**"
            exact = dp.get("exact_parameters", [])
            exact_cell = f"{len(exact)} of {dp['trainable_parameters']}"
            memory = (
                f"{dp['memory_ratio']:.2f} ({dp.get('whole_peak_mib', dp.get('peak_mib')):.0f} / "
                f"{non['peak_mib']:.0f} MiB)"
                if "memory_ratio" in dp
                else dp.get("memory_note", "n/a")
            )
            if "whole_error" in dp:  # the whole batch in one chunk failed (out of memory): that is the result
                memory = f"whole batch in one chunk: {_short(dp['whole_error'], 80)}"
            if "whole_error" in dp or "whole_peak_mib" in dp:
                memory += f"; in its chunk {dp['peak_mib']:.0f} MiB"
            checks = [
                f"speed {'met' if dp['throughput'] >= SPEED_TARGET else 'missed'}",
                f"exact path {'empty' if not exact else 'not empty'}",
            ]
            if cuda and "memory_ratio" in dp:
                checks.append(f"memory {'met' if dp['memory_ratio'] <= MEMORY_TARGET else 'missed'}")
            elif cuda and "whole_error" in dp:
                checks.append("memory missed (the whole batch in one chunk failed)")
            targets = ", ".join(checks)
            chosen = (
                "the whole batch in one chunk (`--dpml-chunk whole`, not tuned)"
                if meta["args"].get("dpml_chunk") == "whole"
                else f"chunk of {dp['chunk']} rows chosen by the trainer's tuner in {dp['tune_seconds']:.1f} s"
                + (f" ({dp['tuner']})" if dp.get("tuner") else "")
            )
            details.append(
                f"- **{family}** ({non.get('model', '')}; {non.get('trainable', 0):,} of "
                f"{non.get('parameters', 0):,} parameters trainable): "
                f"plan {dp['plan_seconds']:.1f} s, {chosen}; "
                + (f"exact path: {', '.join(f'`{n}`' for n in exact)}" if exact else "exact path: none")
                + (f". Plan notes: {' '.join(dp['plan_notes'])}" if dp.get("plan_notes") else "")
                + (f". Chunks on the GPU: {dp['cuda_graphs']}" if dp.get("cuda_graphs") else "")
            )
        else:  # refused, or crashed: in its set-up, or in a step after others were timed (said with their median)
            before = f" after {dp['steps']} timed step(s) of {dp['ms_per_step']:.1f} ms" if "ms_per_step" in dp else ""
            dp_cell, ratio, exact_cell, memory, targets = (
                f"{dp.get('verdict', '?')}{before}: {_short(dp.get('error', ''))}",
                "",
                "",
                "",
                "missed",
            )
            details.append(
                f"- **{family}** ({non.get('model', '')}): dpml {dp.get('verdict')}{before}: {dp.get('error')}"
            )
        cut = f" ({non['rounds']} rounds)" if non.get("rounds", meta["args"]["rounds"]) < meta["args"]["rounds"] else ""
        lines.append(
            f"| {family} | {where} | {non['batch']} | {non['ms_per_step']:.1f}{cut} | {dp_cell} | {ratio} | "
            f"{_cell(by['opacus-hooks']) if 'opacus-hooks' in by else 'not asked'} | "
            f"{_cell(by['opacus-ghost']) if 'opacus-ghost' in by else 'not asked'} | {memory} | "
            f"{exact_cell} | {targets} |"
        )
    lines += [
        "",
        "Per family (the model, the plan's time, the parameters the plan sends to the exact path):",
        "",
        *details,
    ]
    return "\n".join(lines) + "\n"


def run_commits(start: str, end: str) -> str:
    """The commit the run started at, and the one it ended at where they differ: each family's process imports the
    code checked out when it starts."""
    return (
        start if start == end else f"{start} at the start, {end} at the end (the families after a commit ran its code)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--families",
        nargs="+",
        default=FAMILIES,
        choices=[*FAMILIES, *MORE_FAMILIES, "zoo", "peft", "layers", "more-text", "timm"],
    )
    parser.add_argument("--size", choices=list(SIZES), default="tiny")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds (non-private and dpml: one step each)")
    parser.add_argument("--peer-rounds", type=int, default=3, help="rounds in which each Opacus mode is timed")
    parser.add_argument("--peers", nargs="*", default=list(PEERS), choices=list(PEERS))
    parser.add_argument(
        "--dpml-chunk",
        choices=["tuned", "whole"],
        default="tuned",
        help="dpml's physical chunk: the trainer's tuned choice (≤ the batch) or the whole batch",
    )
    parser.add_argument(
        "--keep-share",
        type=float,
        default=None,
        help="the share of what a pass holds anyway that its kept per-example gradients may add "
        "(dpml.train.keep_budget.KEEP_SHARE; default: the engine's): what keeping costs and buys",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's own)")
    parser.add_argument(
        "--family-timeout",
        type=float,
        default=1800,
        help="seconds each family's child process may take (0: every family in this process)",
    )
    parser.add_argument(
        "--total-timeout",
        type=float,
        default=0,
        help="seconds for all the families together: each child gets at most what is left, and a "
        "family not started in time gets a row saying so (0: no limit)",
    )
    parser.add_argument("--label", default="", help="words added to the page's title (e.g. 'before ...')")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--stem", default=None, help="file names' stem (default families, families_cuda)")
    parser.add_argument(
        "--render",
        default=None,
        metavar="JSON",
        help="only write the page again from a results JSON this script wrote (no measurement)",
    )
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)  # a child process: write its rows here
    parser.add_argument("--budget", type=float, default=0, help=argparse.SUPPRESS)  # a child's seconds
    args = parser.parse_args()
    groups = {
        "zoo": ZOO,
        "peft": ["bert-lora", "bert-c3a", *PEFT_ON_BERT],
        "layers": LAYER_ZOO,
        "more-text": NEWER_TEXT,
        "timm": TIMM_ZOO,
    }
    args.families = [name for family in args.families for name in groups.get(family, [family])]
    if args.render:  # the page from recorded numbers, e.g. after its layout changed
        saved = json.loads(Path(args.render).read_text())
        Path(args.render).with_suffix(".md").write_text(page(saved["rows"], saved["meta"]))
        return
    for name, value in (
        ("--batch", args.batch),
        ("--length", args.length),
        ("--rounds", args.rounds),
        ("--peer-rounds", args.peer_rounds),
    ):
        if value < 1:
            parser.error(f"{name} = {value}: must be a positive integer")
    if args.keep_share is not None:  # (for every dpml step of this process; children get the option too)
        if args.keep_share < 0:
            parser.error(f"--keep-share = {args.keep_share}: must be at least 0")
        from dpml.train import keep_budget

        keep_budget.KEEP_SHARE = args.keep_share
    torch = _torch()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here")
    if args.device == "cpu":
        from dpml.devices import keep_freed_cpu_memory

        keep_freed_cpu_memory()  # as the trainer on the CPU, for every method alike (benchmarks/speed.py)
    if args.part is not None:  # a child: one family, its rows to the parent
        rows = [r for family in args.families for r in measure_family(family, args)]
        Path(args.part).write_text(json.dumps(rows, indent=2))
        return
    started, commit = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), current_commit()
    rows = []
    begun = time.perf_counter()
    for family in args.families:
        left = args.total_timeout - (time.perf_counter() - begun) if args.total_timeout > 0 else math.inf
        if left < 20:  # not worth starting: the family's row says so
            found = [
                {
                    "family": family,
                    "size": args.size,
                    "batch": args.batch,
                    "device": args.device,
                    "method": m,
                    "verdict": "not run",
                    "error": f"the run's {args.total_timeout:g} s (--total-timeout) were spent "
                    "on the families before it",
                }
                for m in METHODS
            ]
        elif args.family_timeout > 0:
            found = run_isolated(family, args, min(args.family_timeout, left - 5))
        else:
            found = measure_family(family, args)
        for row in found:
            print(
                "[families]", {k: v for k, v in row.items() if k not in ("exact_parameters", "plan_notes")}, flush=True
            )
        rows += found
    stem = args.stem or ("families" if args.device == "cpu" else "families_cuda")
    command = "python benchmarks/families.py " + " ".join(_arguments(args, args.families))
    if args.family_timeout != 1800:
        command += f" --family-timeout {args.family_timeout:g}"
    if args.total_timeout:
        command += f" --total-timeout {args.total_timeout:g}"
    if args.stem:
        command += f" --stem {args.stem}"
    if args.label:
        command += f" --label '{args.label}'"
    meta = {
        "command": command,
        "commit": run_commits(commit, current_commit()),
        "date": started,
        "machine": machine(args),
        "args": {k: v for k, v in vars(args).items() if k not in ("part", "budget", "render", "out")},
        "label": f" ({args.label})" if args.label else "",
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2, default=str))
    text = page(rows, meta)
    (out / f"{stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
