"""Every ``transformers`` architecture with a sequence- or image-classification head, through dpml's public path.

For each model type in ``transformers``' auto mappings (``AutoModelForSequenceClassification``,
``AutoModelForImageClassification``), the library's default configuration shrunk to a tiny one (the sizes
below; list-valued stage sizes cut to one block of 16–64 channels; nested configurations, a multimodal model's
text and vision towers and an encoder-decoder's two halves, shrunk alike), built with random weights (never from a
hub), batch normalisation replaced by ``dpml.replace_batch_norm``, wrapped by ``dpml.models.library.adapt``
(token records ``(2, T)``: ids, a mask with padding, an ``<eos>`` last, as a tokenizer writes them), planned by
``plan_clipping`` (the probe judging every rule against autograd) and then checked: the engine's clipped sums
and norms against a per-example loop of autograd (the probe's own reference,
:func:`dpml.train.clipping_reference.per_example_reference`: one ``autograd.grad`` per example of one batched
forward pass), C the median norm so that some examples are clipped, in float64 (relative error < 1e-6), or in float32
(< 1e-3 for sums, 1e-4 for norms) where the model's own kernels take no float64 (``torch._grouped_mm`` in
mixtures of experts).

Results: ``exact`` (float64 or float32), ``exact path`` (a parameter planned to autograd's per-example path,
named), ``refused`` (the adapter, ``replace_batch_norm`` or the plan refused the model, with its message),
``not exact``, and ``not built`` / ``not run`` where the shrunk configuration itself does not build, or its
forward pass fails or its loss is not finite (``not run``: ``model(x)`` through the adapter, nothing of the
engine), the architecture's own constraints the generic shrinking missed. One subprocess per architecture (one thread,
``--timeout`` seconds), ``--jobs`` at once.

With ``--speed``, each exact architecture's DP step (``plan_clipping``'s plan, then ``clipped_sum_and_noise`` and an
SGD step, as the trainer takes it) is timed against its non-private step (forward, mean cross-entropy, backward, SGD
step) in float32 at a batch of ``SPEED_BATCH`` (token records of ``SPEED_LENGTH``), the two alternating over
``--rounds`` rounds after two warm-up steps each, on the subprocess's one thread; the column is the non-private
median ÷ the DP median. At these tiny widths a step takes milliseconds and the host's per-operation work weighs more
than at the sizes people train (``results/families*.md``): the column is for finding cliffs (a step that forms
B × |W| numbers somewhere, RoCBert's 0.01 before 5b6a2c2), not a throughput claim.

    python benchmarks/architecture_sweep.py [--kinds text image] [--only bert vit ...] [--jobs 2] [--speed]
        [--rounds 5] [--out benchmarks/results] [--stem architecture_sweep]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import said  # noqa: E402  (benchmarks/ is the script's folder)

LENGTH, BATCH, VOCABULARY, IMAGE, CLASSES, MOST_PARAMETERS = 16, 4, 96, 32, 3, 30_000_000
SPEED_BATCH, SPEED_LENGTH = 32, 32  # (32 tokens: position tables of 64 rows, offset by 2 in BART and RoBERTa)
NO_DROPOUT = (
    "attention_probs_dropout_prob hidden_dropout_prob dropout attention_dropout activation_dropout resid_pdrop "
    "embd_pdrop attn_pdrop summary_first_dropout classifier_dropout hidden_dropout layerdrop encoder_layerdrop "
    "decoder_layerdrop drop_path_rate dropout_rate"
).split()
TEXT_SIZES: dict[str, Any] = {
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64, "d_model": 32,
    "n_embd": 32, "n_layer": 2, "n_head": 2, "n_layers": 2, "n_heads": 2, "num_layers": 2, "num_heads": 2,
    "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 2, "decoder_attention_heads": 2,
    "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "d_ff": 64, "d_kv": 16, "ffn_dim": 64, "n_inner": 64,
    "embedding_size": 32, "embed_dim": 32, "num_key_value_heads": 1, "head_dim": 16, "kv_channels": 16,
    "max_position_embeddings": 64, "n_positions": 64, "n_ctx": 64, "max_seq_len": 64, "seq_length": 64,
    "vocab_size": VOCABULARY, "type_vocab_size": 2, "moe_intermediate_size": 32, "num_experts": 4,
    "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "shared_expert_intermediate_size": 32,
    "pooler_hidden_size": 32, "rotary_dim": 8, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "kv_lora_rank": 16, "q_lora_rank": 16, "use_cache": False, "pad_token_id": 0, "bos_token_id": 1,
    "eos_token_id": 2, "sep_token_id": 2, "cls_token_id": 1, "mask_token_id": 3, "unk_token_id": 4,
    "decoder_start_token_id": 2, "forced_eos_token_id": None, "emb_dim": 32, "entity_vocab_size": 16,
    "entity_emb_size": 16, "d_latents": 32, "num_latents": 8, "cross_attention_hidden_size": 32,
}  # fmt: skip
IMAGE_SIZES: dict[str, Any] = {
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
    "image_size": IMAGE, "patch_size": 4, "num_channels": 3, "embed_dim": 16, "embedding_size": 16, "mlp_ratio": 2,
    "window_size": 2, "encoder_stride": 4, "d_model": 32, "num_key_value_heads": 1, "head_dim": 16,
}  # fmt: skip
OVERRIDES: dict[str, dict[str, Any]] = {
    "diffllama": {"num_key_value_heads": 2},  # (its differential attention splits the values in two along the heads)
}
STAGE_LISTS = {
    "depths": "ones", "num_layers": "ones", "layers": "ones", "block_repeats": "ones", "num_blocks": "ones",
    "hidden_sizes": "widths", "embed_dims": "widths", "embed_dim": "widths", "dims": "widths", "widths": "widths",
    "channels": "widths", "out_channels": "widths", "hidden_size": "widths", "mlp_ratios": "twos", "mlp_ratio": "twos",
}  # fmt: skip


def _set(config: Any, defaults: dict[str, Any], key: str, value: Any) -> None:
    """``config.key = value`` where the default configuration has the key, as the default's type (strict
    configuration classes check that a float stays a float)."""
    if key not in defaults or isinstance(defaults[key], (list, dict)):
        return
    old = defaults[key]
    if isinstance(old, float) and isinstance(value, int):
        value = float(value)
    elif isinstance(old, int) and not isinstance(old, bool) and isinstance(value, float) and value.is_integer():
        value = int(value)
    setattr(config, key, value)


def _stage_list(key: str, values: list[Any]) -> list[Any]:
    """A list of per-stage sizes cut down: one block a stage, 16, 32, 64, 64, … channels, ratios of 2."""
    if not values or isinstance(values[0], bool) or not all(isinstance(v, (int, float)) for v in values):
        return values
    kind = "ones" if "head" in key else STAGE_LISTS.get(key)
    if kind == "ones":
        return [1] * len(values)
    if kind == "widths":
        return [16 * 2 ** min(k, 2) for k in range(len(values))]
    if kind == "twos":
        return [type(v)(2) for v in values]
    return values


def tiny_config(model_type: str, kind: str) -> Any:
    """The library's default configuration of ``model_type``, shrunk (module docstring)."""
    from transformers import AutoConfig

    config = _shrunk(AutoConfig.for_model(model_type), kind)
    for key, value in OVERRIDES.get(model_type, {}).items():
        setattr(config, key, value)
    if getattr(config, "is_encoder_decoder", False) and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = 0
    config.num_labels = CLASSES
    return config


def _shrunk(config: Any, kind: str) -> Any:
    """``config`` with the sizes of its kind, no dropout, and each nested configuration (``sub_configs``: a
    multimodal model's ``text_config`` and ``vision_config``, an encoder-decoder's ``encoder`` and ``decoder``)
    shrunk the same way, a vision one with the image sizes."""
    defaults = config.to_dict()
    if kind == "image":
        for key, value in defaults.items():
            if isinstance(value, list):
                setattr(config, key, _stage_list(key, value))
    for key, value in (TEXT_SIZES if kind == "text" else IMAGE_SIZES).items():
        _set(config, defaults, key, value)
    for key in NO_DROPOUT:
        _set(config, defaults, key, 0.0)
    if "qk_rope_head_dim" in defaults and "head_dim" in defaults:
        config.head_dim = config.qk_rope_head_dim  # (multi-head latent attention: rotary on the rope part)
    if "kv_lora_rank" in defaults:  # (latent attention: one key and value a head; experts in one group)
        config.num_key_value_heads = config.num_attention_heads
        for key in ("n_group", "topk_group"):
            _set(config, defaults, key, 1)
    for name in getattr(config, "sub_configs", None) or {}:
        nested = getattr(config, name, None)
        if nested is not None and hasattr(nested, "to_dict"):
            setattr(config, name, _shrunk(nested, "image" if "vision" in name else kind))
    return config


def example_batch(kind: str, batch: int = BATCH, length: int = LENGTH) -> tuple[Any, Any]:
    """Token records (B, 2, T) with padding and an ``<eos>`` (id 2) last, or images (B, 3, 32, 32); labels."""
    import torch

    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, CLASSES, (batch,), generator=generator)
    if kind == "image":
        return torch.randn(batch, 3, IMAGE, IMAGE, generator=generator), labels
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1::4, length // 2 :] = 0
    mask[3::4, length - 3 :] = 0
    ids = torch.randint(5, VOCABULARY, (batch, length), generator=generator) * mask
    ids[torch.arange(batch), mask.sum(1) - 1] = 2
    return torch.stack([ids, mask], 1), labels


def step_times(model: Any, kind: str, rounds: int) -> dict[str, Any]:
    """The non-private and the DP step's medians (ms) at ``SPEED_BATCH``, float32, and their ratio (module
    docstring); the plan made again for the float32 model."""
    import statistics

    import torch

    from dpml.train.clipping_check import plan_clipping
    from dpml.train.dpsgd import clipped_sum_and_noise, per_example_cross_entropy, trainable_parameters

    model = model.float()
    x, y = example_batch(kind, SPEED_BATCH, SPEED_LENGTH)
    plan = plan_clipping(model, per_example_cross_entropy, tuple(x.shape[1:]), x.dtype)
    params = trainable_parameters(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)

    def nonprivate() -> None:
        optimizer.zero_grad(set_to_none=True)
        per_example_cross_entropy(model(x), y).mean().backward()
        optimizer.step()

    def private() -> None:
        sums, noises, _ = clipped_sum_and_noise(model, x, y, 1.0, 1.0, len(y), generator, exact=plan.exact)
        for name, p in params.items():
            p.grad = sums[name].add_(noises[name]).div_(len(y))
        optimizer.step()

    times: dict[str, list[float]] = {"nonprivate": [], "dp": []}
    for round_ in range(rounds + 2):
        for name, step in (("nonprivate", nonprivate), ("dp", private)):
            start = time.perf_counter()
            step()
            if round_ >= 2:  # (two warm-up steps each)
                times[name].append(1e3 * (time.perf_counter() - start))
    medians = {f"{name}_ms": round(statistics.median(found), 2) for name, found in times.items()}
    return medians | {"throughput": round(medians["nonprivate_ms"] / medians["dp_ms"], 2)}


def loop_and_engine_agree(model: Any, plan: Any, x: Any, y: Any, tolerance: float, norm_tolerance: float) -> str:
    """'' where the engine's clipped sums and norms equal those of the probe's own per-example loop
    (:func:`dpml.train.clipping_reference.per_example_reference`, C the median norm), else the worst relative
    errors."""
    import contextlib

    import torch

    from dpml.train.clipping import clipped_gradient_sum
    from dpml.train.clipping_reference import per_example_reference
    from dpml.train.dpsgd import per_example_cross_entropy as loss_fn

    @contextlib.contextmanager
    def seeded() -> Any:  # (the same dropout masks, if any, in both passes)
        torch.manual_seed(0)
        yield

    reference = per_example_reference(model, loss_fn, x, y, torch.zeros(len(y)), seeded)
    with seeded():
        sums, found = clipped_gradient_sum(model, loss_fn, x, y, reference.clip, exact=plan.exact)
    total = math.sqrt(sum(float(r.norm()) ** 2 for r in reference.clipped.values()))
    worst = max(float((sums[n] - r).norm()) / (float(r.norm()) + 1e-6 * total) for n, r in reference.clipped.items())
    norms = reference.norms()
    worst_norm = float(((found - norms).abs() / norms).max())
    if worst < tolerance and worst_norm < norm_tolerance:
        return ""
    return f"clipped sums {worst:.1e}, norms {worst_norm:.1e} (relative)"


def run_one(model_type: str, kind: str, rounds: int = 0) -> dict[str, Any]:
    """One architecture's row (module docstring)."""
    import torch
    from transformers import AutoModelForImageClassification, AutoModelForSequenceClassification

    import dpml
    from dpml.models.library import adapt
    from dpml.train.clipping_check import ClippingUnsupported, plan_clipping
    from dpml.train.dpsgd import per_example_cross_entropy

    auto = AutoModelForImageClassification if kind == "image" else AutoModelForSequenceClassification
    row: dict[str, Any] = {"type": model_type, "kind": kind}
    try:
        config = tiny_config(model_type, kind)
        with torch.device("meta"):
            row["parameters"] = sum(p.numel() for p in auto.from_config(config).parameters())
        if row["parameters"] > MOST_PARAMETERS:
            return row | {"result": "not built", "why": f"{row['parameters']:,} parameters at the tiny sizes"}
        torch.manual_seed(0)
        net = auto.from_config(config)
        row["class"] = type(net).__name__
    except Exception as error:  # the architecture's own constraints: nothing of dpml's has run
        return row | {"result": "not built", "why": said(error)}
    x, y = example_batch(kind)
    shape, dtype = tuple(x.shape[1:]), x.dtype
    try:  # dpml's public path up to the plan: batch normalisation replaced, the module adapted
        if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in net.modules()):
            net = dpml.replace_batch_norm(net, groups=1)
            row["class"] += " (BatchNorm as GroupNorm)"
        model = adapt(net, shape, dtype).train()
    except ValueError as error:
        return row | {"result": "refused", "why": said(error)}
    try:
        if not bool(torch.isfinite(per_example_cross_entropy(model(x), y)).all()):
            raise FloatingPointError("its own loss is not finite on the batch (outside dpml)")
    except Exception as error:  # the shrunk configuration does not run as the library wrote it
        return row | {"result": "not run", "why": said(error)}
    start = time.perf_counter()
    try:
        plan = plan_clipping(model, per_example_cross_entropy, shape, dtype)
    except (ClippingUnsupported, ValueError) as error:
        return row | {"result": "refused", "why": said(error)}
    except Exception as error:  # a failure of the plan itself, not a refusal
        return row | {"result": "plan failed", "why": said(error), "trace": traceback.format_exc()[-1500:]}
    row["plan_seconds"] = round(time.perf_counter() - start, 1)
    if plan.exact_parameters:
        return row | {"result": "exact path", "why": "; ".join(plan.exact_parameters)}
    wide_x = x.double() if kind == "image" else x
    try:
        wide = model.double()
        if not bool(torch.isfinite(per_example_cross_entropy(wide(wide_x), y)).all()):
            raise FloatingPointError("not finite in double precision")  # (CANINE's hashing: compared in float32)
        disagree = loop_and_engine_agree(wide, plan, wide_x, y, 1e-6, 1e-6)
        precision = "float64"
    except Exception as error:  # (a kernel without float64: compared in float32)
        if "double" not in str(error).lower():
            return row | {"result": "not exact", "why": said(error), "trace": traceback.format_exc()[-1500:]}
        disagree, precision = loop_and_engine_agree(model.float(), plan, x, y, 1e-3, 1e-4), "float32"
    if disagree:
        return row | {"result": "not exact", "why": disagree}
    row["result"] = f"exact ({precision})"
    if rounds:
        try:
            row |= step_times(model, kind, rounds)
        except Exception as error:  # (the timing's own failure: the row's result stands)
            row["speed"] = f"not timed: {said(error)}"
    return row


def architectures(kinds: list[str]) -> list[tuple[str, str]]:
    from transformers.models.auto import modeling_auto

    mappings = {
        "text": modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
        "image": modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
    }
    return [(name, kind) for kind in kinds for name in sorted(mappings[kind])]


def in_subprocess(model_type: str, kind: str, timeout: int, rounds: int) -> dict[str, Any]:
    from bench_common import row_in_subprocess

    command = [sys.executable, __file__, "--one", model_type, "--kinds", kind, "--rounds", str(rounds)]
    return row_in_subprocess(command, timeout, ROOT, {"type": model_type, "kind": kind, "result": "not exact"})


def page(rows: list[dict[str, Any]], command: str) -> str:
    import torch
    import transformers

    from bench_common import cpu_name, current_commit, results_line

    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Every transformers classification architecture through dpml's public path",
        "",
        f"Command: `{command}`. Commit {current_commit()}, {when}. Machine: {cpu_name()}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}. What each result means: the script's docstring.",
        "",
        results_line(rows),
        "",
    ]
    timed = any("throughput" in row or "speed" in row for row in rows)
    if timed:
        ratios = sorted(row["throughput"] for row in rows if "throughput" in row)
        lines += [
            f"DP ÷ non-private: the non-private step's median time ÷ the DP step's at batch {SPEED_BATCH} (token "
            f"records of {SPEED_LENGTH}), float32, one thread (the script's docstring: a search for cliffs at tiny "
            f"widths, not a throughput claim); median over the {len(ratios)} timed "
            f"{ratios[len(ratios) // 2] if ratios else '—'}, lowest {ratios[0] if ratios else '—'}.",
            "",
        ]
    speed_column = (" DP ÷ non-private (ms) |", "---|") if timed else ("", "")
    lines += [
        "| architecture | head | model | parameters | result |" + speed_column[0] + " why |",
        "|---|---|---|---|---|" + speed_column[1] + "---|",
    ]
    for row in rows:
        why = row.get("why", "").replace("|", "/")
        speed = ""
        if timed:
            speed = (
                f" {row['throughput']} ({row['nonprivate_ms']} / {row['dp_ms']}) |"
                if "throughput" in row
                else f" {row.get('speed', '')} |"
            )
        lines.append(
            f"| {row['type']} | {row['kind']} | {row.get('class', '')} | {row.get('parameters', 0):,} | "
            f"{row['result']} |{speed} {why} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", choices=["text", "image"], default=["text", "image"])
    parser.add_argument("--only", nargs="*", default=None, help="these model types only")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--stem", default="architecture_sweep")
    parser.add_argument("--speed", action="store_true", help="time each exact one's DP and non-private steps")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds with --speed")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        import torch

        torch.set_num_threads(1)
        print(json.dumps(run_one(args.one, args.kinds[0], args.rounds)), flush=True)
        return
    todo = [(t, k) for t, k in architectures(args.kinds) if args.only is None or t in args.only]
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda item: in_subprocess(*item, args.timeout, args.rounds if args.speed else 0), todo))
    for row in rows:
        speed = f"{row['throughput']:5.2f}" if "throughput" in row else "     "
        print(f"{row['type']:28s} {row['kind']:6s} {row['result']:18s} {speed} {row.get('why', '')[:100]}", flush=True)
    from bench_common import without_paths

    command = "python benchmarks/architecture_sweep.py " + " ".join(without_paths(sys.argv[1:]))
    text = page(rows, command.strip())  # (its commit read before this run's own files are written)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.stem}.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.out / f"{args.stem}.md").write_text(text)


if __name__ == "__main__":
    main()
