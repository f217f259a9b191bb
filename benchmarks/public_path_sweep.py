"""Models nobody here wrote, trained end to end through the public API: ``dpml.replace_batch_norm`` where the model has
batch normalisation, then ``dpml.train_private`` (issue 46, item 4: a model from these libraries goes in unchanged).

Three sets, each model in its own subprocess (one thread, ``--timeout`` seconds), ``--jobs`` at once:

- ``timm``: one model of each timm architecture of ``benchmarks/timm_zoo.py`` (``TIMM_SPECS``: its registered
  configuration, made small), random weights, 5 classes, as ``timm.create_model`` returns it — timm's own
  ``BatchNormAct2d`` and ``BatchNorm2d`` included, which ``dpml.replace_batch_norm`` replaces (the timm families of
  ``families.py`` are instead built with their norms swapped by hand, ``family_zoo._batch_norms_to_group_norms``);
  40 random 3×32×32 images.
- ``torchvision``: one classifier of each torchvision family (``TORCHVISION``), 5 classes, 40 random images of
  64×64 (Inception v3: 299×299), batch norms replaced by ``dpml.replace_batch_norm``; GoogLeNet and Inception v3 return
  their auxiliary heads' logits beside their own in training.
- ``transformers``: every sequence- and image-classification architecture of ``benchmarks/architecture_sweep.py``,
  shrunk the same way but with **the library's default dropout** (the sweep switches it off to compare with a loop);
  48 token records ``(input_ids, attention_mask, label)`` of 16 tokens with padding, or 48 images.

The run: ``train_private(model, dataset, noise_multiplier=1, delta=1e-5, epochs=1, clip_norm=1,
expected_batch_size=10 or 12, physical_batch_size=8 or 16, learning_rate=0.1, seed=0)``: Poisson batches, some
larger than a chunk, the plan's probe, the accountant. Results: ``trained`` (with the certified ε and how many
parameters took the exact path), ``refused`` (dpml refused the model before any step, with its message: a buffer the
forward pass writes the examples into, say), ``failed`` (anything else raised inside dpml's run), and ``not built``
/ ``not run`` where the configuration does not build, or the model's own forward fails on one record outside dpml (the
architecture's constraints the generic shrinking misses: ``architecture_sweep.md`` has the same rows).

    python benchmarks/public_path_sweep.py [--sets timm torchvision transformers] [--only NAME ...] [--jobs 2]
        [--out benchmarks/results] [--stem public_path_sweep]
"""

from __future__ import annotations

import argparse
import json
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

IMAGES, TOKEN_RECORDS = 40, 48
TORCHVISION: dict[str, tuple[int, dict[str, Any]]] = {  # one of each family: the image side it takes, its settings
    **{name: (64, {}) for name in (
        "alexnet", "vgg11_bn", "resnet18", "resnext50_32x4d", "wide_resnet50_2", "densenet121", "googlenet",
        "squeezenet1_1", "shufflenet_v2_x0_5", "mobilenet_v2", "mobilenet_v3_small", "mnasnet0_5", "efficientnet_b0",
        "efficientnet_v2_s", "regnet_x_400mf", "regnet_y_400mf", "convnext_tiny", "swin_t", "swin_v2_t",
    )},
    "vit_b_32": (64, {"image_size": 64}),
    "inception_v3": (299, {}),  # (its auxiliary head's pooling needs the 299×299 images it was made for)
}  # fmt: skip


def _images(side: int) -> tuple[Any, Any]:
    """``IMAGES`` random 3×side×side images and labels of 5 classes (seed 0)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randn(IMAGES, 3, side, side, generator=generator), torch.randint(0, 5, (IMAGES,), generator=generator)


def build(name: str, kind: str) -> tuple[Any, Any]:
    """The model as its library builds it, and its data set."""
    import torch

    import families

    families._declare_torchvision_schemas()  # (timm and transformers' vision code import torchvision)
    torch.manual_seed(0)
    if kind == "timm":
        import timm
        from timm_zoo import TIMM_SPECS

        architecture, settings = TIMM_SPECS[name]
        model = timm.create_model(architecture, pretrained=False, num_classes=5, **settings)
        data = _images(32)
    elif kind == "torchvision":
        import torchvision.models

        side, settings = TORCHVISION[name]
        model = getattr(torchvision.models, name)(weights=None, num_classes=5, **settings)
        data = _images(side)
    else:
        import architecture_sweep as sweep
        from transformers import AutoModelForImageClassification, AutoModelForSequenceClassification

        sweep.NO_DROPOUT[:] = []  # (the library's default dropout kept)
        auto = AutoModelForImageClassification if kind == "image" else AutoModelForSequenceClassification
        config = sweep.tiny_config(name, kind)
        with torch.device("meta"):
            if sum(p.numel() for p in auto.from_config(config).parameters()) > sweep.MOST_PARAMETERS:
                raise ValueError("too large at the tiny sizes")
        model = auto.from_config(config)
        x, y = sweep.example_batch(kind, batch=TOKEN_RECORDS)
        data = (x, y) if kind == "image" else (x[:, 0], x[:, 1], y)
    return model, torch.utils.data.TensorDataset(*data)


def forward_on_one_record(model: Any, dataset: Any, kind: str) -> None:
    """The model's own forward pass on one record, in evaluation mode, before anything of dpml's."""
    import torch

    first = dataset[0][:-1]
    with torch.no_grad():
        if kind == "text":
            model.eval()(input_ids=first[0][None], attention_mask=first[1][None])
        else:
            model.eval()(first[0][None])


def run_one(name: str, kind: str) -> dict[str, Any]:
    """One model's row (module docstring)."""
    import torch

    import dpml
    from dpml.train.clipping_check import ClippingUnsupported

    row: dict[str, Any] = {"model": name, "kind": kind}
    try:
        model, dataset = build(name, kind)
        row["class"] = type(model).__name__
    except Exception as error:  # the library's own constraints: nothing of dpml's has run
        return row | {"result": "not built", "why": said(error)}
    try:
        forward_on_one_record(model, dataset, kind)
    except Exception as error:  # its forward fails on one record, outside dpml
        return row | {"result": "not run", "why": said(error)}
    images = kind != "text"
    start = time.perf_counter()
    try:
        if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            model = dpml.replace_batch_norm(model)
            row["class"] += " (batch norms replaced)"
        result = dpml.train_private(
            model.train(),
            dataset,
            noise_multiplier=1.0,
            delta=1e-5,
            epochs=1,
            clip_norm=1.0,
            expected_batch_size=10 if images else 12,
            physical_batch_size=8 if images else 16,
            learning_rate=0.1,
            seed=0,
        )
    except (ClippingUnsupported, ValueError) as error:
        return row | {"result": "refused", "why": said(error)}
    except Exception as error:
        return row | {"result": "failed", "why": said(error), "trace": traceback.format_exc()[-1500:]}
    return row | {
        "result": "trained",
        "epsilon": round(result.epsilon, 3),
        "exact_parameters": result.history.get("exact_clipping_parameters"),
        "seconds": round(time.perf_counter() - start, 1),
    }


def models(sets: list[str]) -> list[tuple[str, str]]:
    todo: list[tuple[str, str]] = []
    if "timm" in sets:
        from timm_zoo import TIMM_SPECS

        todo += [(name, "timm") for name in TIMM_SPECS]
    if "torchvision" in sets:
        todo += [(name, "torchvision") for name in TORCHVISION]
    if "transformers" in sets:
        from architecture_sweep import architectures

        todo += architectures(["text", "image"])
    return todo


def in_subprocess(name: str, kind: str, timeout: int) -> dict[str, Any]:
    from bench_common import row_in_subprocess

    failed = {"model": name, "kind": kind, "result": "failed"}
    return row_in_subprocess([sys.executable, __file__, "--one", name, kind], timeout, ROOT, failed)


def page(rows: list[dict[str, Any]], command: str) -> str:
    import torch

    from bench_common import cpu_name, current_commit, results_line

    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Models nobody here wrote, trained through dpml's public API",
        "",
        f"Command: `{command}`. Commit {current_commit()}, {when}. Machine: {cpu_name()}; torch {torch.__version__}. "
        "What each result means: the script's docstring.",
        "",
        results_line(rows),
        "",
        "| model | set | class | result | ε | exact-path parameters | seconds | why |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        why = row.get("why", "").replace("|", "/")
        lines.append(
            f"| {row['model']} | {row['kind']} | {row.get('class', '')} | {row['result']} | {row.get('epsilon', '')} | "
            f"{row.get('exact_parameters', '')} | {row.get('seconds', '')} | {why} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sets",
        nargs="+",
        choices=["timm", "torchvision", "transformers"],
        default=["timm", "torchvision", "transformers"],
    )
    parser.add_argument("--only", nargs="*", default=None, help="these models only")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--stem", default="public_path_sweep")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        import torch

        torch.set_num_threads(1)
        print(json.dumps(run_one(*args.one), default=str), flush=True)
        return
    todo = [(n, k) for n, k in models(args.sets) if args.only is None or n in args.only]
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda item: in_subprocess(*item, args.timeout), todo))
    for row in rows:
        print(f"{row['model']:28s} {row['kind']:6s} {row['result']:10s} {row.get('why', '')[:100]}", flush=True)
    from bench_common import without_paths

    command = "python benchmarks/public_path_sweep.py " + " ".join(without_paths(sys.argv[1:]))
    text = page(rows, command.strip())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.stem}.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.out / f"{args.stem}.md").write_text(text)


if __name__ == "__main__":
    main()
