"""What ``dpml --help`` and ``dpml --version`` show: each command's parser with its examples at the end."""

from __future__ import annotations

import argparse
import importlib.metadata

EXAMPLES: dict[str, list[tuple[str, str]]] = {
    "dpml": [
        ("dpml run", "the whole pipeline as a Prefect flow run on params.yaml"),
        ("dpml run --engine local --set dp.target_epsilon=2", "in-process, with one parameter changed"),
        ("dpml epsilon --noise-multiplier 1.1 --sample-rate 0.01 --steps 1000", "ε of DP-SGD"),
        ("dpml ledger", "the privacy budget spent per lineage"),
        ("dpml compare", "the experiments dvc exp show lists, in 120 columns"),
        ("dpml COMMAND --help", "a command's options and examples"),
    ],
    "run": [
        ("dpml run", "a Prefect flow run (a temporary API server, or the server in PREFECT_API_URL)"),
        ("dpml run --prefect-api http://127.0.0.1:4200/api", "on that Prefect server (before PREFECT_API_URL)"),
        ("dpml run --engine local", "the stages in this process, no Prefect"),
        ("dpml run --params configs/census-hi.yaml --set dp.target_epsilon=1", "another configuration, one override"),
        ("dpml run --verbose", "with Prefect's, Dask's, absl's and MLflow's own logs"),
    ],
    "tune": [
        ("dpml tune", "private hyperparameter search (tune section), then certify, audit, release"),
        ("dpml tune --engine local --set tune.mean=4", "in-process, 4 candidates in expectation"),
    ],
    "stage": [
        ("dpml stage train", "one stage on params.yaml (what dvc.yaml calls)"),
        ("dpml stage audit --params run.yaml", "the audit of another configuration's outputs"),
    ],
    "audit": [
        ("dpml audit --model models:/dpml-digits@champion", "re-audit the champion with the data it saw"),
        ("dpml audit --model models:/dpml-digits/3 --out artifacts/reaudit-3", "version 3, outputs elsewhere"),
    ],
    "reproduce": [
        ("dpml reproduce models:/dpml-digits/1 --verify", "check commit, data and certificate; no training"),
        ("dpml reproduce models:/dpml-digits/1 --accuracy-band 0.03", "retrain by dvc repro and compare"),
    ],
    "certificate": [
        ("dpml certificate --run 60ef3f4425cd4245872f2bdaab55799f", "recompute a logged run's ε"),
        ("dpml certificate --run RUN_ID --json", "machine-readable"),
    ],
    "schema": [
        ("dpml schema data/census.csv --label income", "print a draft data: section"),
        ("dpml schema parquet:data/visits.pq --label outcome --id patient --out schema.yaml", "to a file"),
    ],
    "calibrate": [
        ("dpml calibrate --target-epsilon 3 --sample-rate 0.01 --steps 10000", "σ for ε = 3 after 10000 steps"),
        ("dpml calibrate --target-epsilon 3 --sample-rate 0.01 --noise-multiplier 1.0", "the most steps at σ = 1"),
    ],
    "ledger": [
        ("dpml ledger", "every lineage: spends, units by ε, the largest"),
        ("dpml ledger --dataset digits --json", "one lineage, machine-readable"),
        ("dpml ledger --person p00042", "every release that touched one person (data.id_column), across lineages"),
        ("dpml ledger rename patients-2026-11-20 patients", "rename a lineage, keeping its history"),
        ("dpml ledger rename bom plain --merge", "one account for the people of two lineages"),
    ],
    "compare": [
        ("dpml compare", "the workspace, HEAD and HEAD's experiments: ε, accuracy, verdict, changed parameters"),
        ("dpml compare -A", "every commit and its experiments"),
        ("dpml compare --rev main -n 5 --width 100", "the last five commits of main, in 100 columns"),
        ("dpml compare --json", "the same rows as JSON: numbers, the verdict's parts, the changed parameters' values"),
    ],
    "completion": [
        ('eval "$(dpml completion bash)"', "complete dpml's commands, options and choices in this shell (~/.bashrc)"),
        ('eval "$(dpml completion zsh)"', "the same in zsh (~/.zshrc)"),
    ],
    "epsilon": [
        ("dpml epsilon --noise-multiplier 1.1 --sample-rate 0.01 --steps 1000", "from every accountant"),
        (
            "dpml epsilon --noise-multiplier 1.1 --sample-rate 0.01 --steps 1000 --neighbouring replace-one --json",
            "replace-one neighbours, as JSON",
        ),
    ],
}


def examples_epilog(command: str) -> str:
    """``examples:`` and one indented line per example (command, then what it does)."""
    rows = EXAMPLES[command]
    return "examples:\n" + "\n".join(f"  {line}\n      {what}" for line, what in rows)


def version() -> str:
    """``dpml <version>``, from the installed package's metadata."""
    try:
        return f"dpml {importlib.metadata.version('dpml')}"
    except importlib.metadata.PackageNotFoundError:
        return "dpml (version unknown: the package is not installed; run scripts/setup.sh)"


def command(sub: argparse._SubParsersAction, name: str, summary: str) -> argparse.ArgumentParser:
    """The parser of ``dpml NAME``: its one-line summary (in ``dpml --help``'s list and as its own --help's description
    line), and its examples at the end of its --help."""
    return sub.add_parser(
        name,
        help=summary,
        description=summary[:1].upper() + summary[1:] + ".",
        epilog=examples_epilog(name),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


JSON_HELP = "print the result as JSON (for scripts) instead of text"
VERBOSE_HELP = (
    "also show Prefect's, Dask's, absl's and MLflow's own logs and progress bars, and other libraries' warnings"
)
