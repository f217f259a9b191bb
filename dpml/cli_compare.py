"""``dpml compare``: the experiments ``dvc exp show`` lists, in a table a person reads at 120 characters.

``dvc exp show`` tables every metric of ``metrics/summary.json`` and every parameter the stages read (about 140
columns), and has no setting for a default column set, so at a terminal's width it shows ``…``. This command
asks DVC for the same experiments (``dvc exp show --json``, any of its selection flags passed through: ``-A``,
``-n N``, ``--rev R``, ``--sha``, …) and prints one line per commit or experiment: its name, when it ran, the
certified ε (:func:`dpml.formatting.format_epsilon`, as everywhere), the test accuracy, the verdict's three parts
(:mod:`dpml.report.verdict`), and the parameters that differ from the commit it was run from (the workspace and
other commits: from the first commit listed). A long list of changes continues on the next lines, under its
column: nothing is cut. ``--json`` prints the same rows as JSON, for scripts. ``dvc exp show`` itself still shows
everything.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any

from dpml.cli_help import JSON_HELP, command
from dpml.formatting import format_epsilon
from dpml.report.verdict import PARTS

SUMMARY = "metrics/summary.json"
PARAMS = "params.yaml"
HEADERS = ("experiment", "created", "ε", "accuracy", *PARTS, "changed")


@dataclass(frozen=True)
class Row:
    """One line of the table: a commit (or the workspace) or an experiment run from one."""

    name: str
    timestamp: str | None  # when it ran, as DVC reports it (ISO 8601)
    metrics: dict[str, Any]
    params: dict[str, Any]
    parent: str | None = None  # an experiment's commit, under which it is shown
    baseline: dict[str, Any] | None = None  # the parameters it is compared with


def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"epochs": 3}}`` → ``{"train.epochs": 3}`` (lists stay values)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out |= flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _file_data(data: dict[str, Any] | None, kind: str, path: str) -> dict[str, Any]:
    """The contents DVC read from ``path`` (``{}`` when it could not: a file missing in that commit)."""
    entry = ((data or {}).get(kind) or {}).get(path) or {}
    return entry.get("data") or {}


def _created(stamp: str | None, today: date) -> str:
    if not stamp:
        return "-"
    when = datetime.fromisoformat(stamp)
    return when.strftime("%H:%M") if when.date() == today else when.strftime("%b %d")


def _row(state: dict[str, Any], name: str, parent: str | None, baseline: dict[str, Any] | None) -> Row:
    data = state.get("data")
    return Row(
        name,
        (data or {}).get("timestamp"),
        _file_data(data, "metrics", SUMMARY),
        flat(_file_data(data, "params", PARAMS)),
        parent,
        baseline,
    )


def experiment_rows(shown: list[dict[str, Any]]) -> list[Row]:
    """The rows of ``dvc exp show --json``'s output: each commit (the workspace first), then the experiments run
    from it. An experiment is compared with its commit; a commit and the workspace with the first commit listed."""
    commits = [state for state in shown if state.get("rev") != "workspace"]
    newest = commits[0] if commits else None
    first = flat(_file_data(newest.get("data"), "params", PARAMS)) if newest else None
    rows: list[Row] = []
    for state in shown:
        rev = str(state.get("rev", ""))
        own = state.get("name") or (rev if rev == "workspace" else rev[:7])
        row = _row(state, own, None, None if state is newest else first)
        rows.append(row)
        for run in state.get("experiments") or []:
            tip = (run.get("revs") or [{}])[0]
            label = run.get("name") or tip.get("name") or str(tip.get("rev", ""))[:7]
            rows.append(_row(tip, label, own, row.params))
    return rows


def changed_params(row: Row) -> dict[str, Any]:
    """Each parameter whose value differs from the row's baseline, with its value (``...`` if removed); none for a
    row whose parameters DVC could not read (a failed experiment: its metrics show as ``-`` too)."""
    if row.baseline is None or not row.params:
        return {}
    keys = sorted(set(row.params) | set(row.baseline))
    return {key: row.params.get(key, ...) for key in keys if row.params.get(key, ...) != row.baseline.get(key, ...)}


def changes(row: Row) -> list[str]:
    """``key=value`` for each changed parameter (``key=∅`` if removed)."""
    return [f"{key}={'∅' if value is ... else _value(value)}" for key, value in changed_params(row).items()]


def as_record(row: Row) -> dict[str, Any]:
    """A row for ``--json``: the numbers as ``metrics/summary.json`` holds them (``"inf"`` for an infinite ε), the
    verdict's parts by name, and the changed parameters (``null`` for one removed)."""
    return {
        "experiment": row.name,
        "commit": row.parent,
        "created": row.timestamp,
        "epsilon": row.metrics.get("epsilon"),
        "test_accuracy": row.metrics.get("test_accuracy"),
        "verdict": {part: row.metrics.get(f"verdict_{part}") for part in PARTS},
        "changed": {key: None if value is ... else value for key, value in changed_params(row).items()},
    }


def _value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def _number(value: Any) -> float | None:
    """A metric's number (``inf`` as DVC reads the summary's ``"inf"``); ``None`` for anything else."""
    if value == "inf":
        return math.inf
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _accuracy(value: Any) -> str:
    number = _number(value)
    return "-" if number is None else f"{number:.3f}"


def _epsilon(value: Any) -> str:
    number = _number(value)
    return "-" if number is None else format_epsilon(number)


def cells(row: Row, today: date) -> list[str]:
    """The fixed columns of a row, as text (an experiment's name indented under its commit's)."""
    metrics = row.metrics
    return [
        ("  " if row.parent else "") + row.name,
        _created(row.timestamp, today),
        _epsilon(metrics.get("epsilon")),
        _accuracy(metrics.get("test_accuracy")),
        *(str(metrics.get(f"verdict_{part}", "-")) for part in PARTS),
    ]


def _wrapped(items: list[str], width: int) -> Iterator[str]:
    """``items`` joined by two spaces into lines of at most ``width`` characters (a longer item alone)."""
    line = ""
    for item in items:
        if line and len(line) + 2 + len(item) > width:
            yield line
            line = item
        else:
            line = f"{line}  {item}" if line else item
    yield line


def render(rows: list[Row], width: int) -> list[str]:
    """The table: the fixed columns padded to their widest cell, then the changes, wrapped to ``width`` — beside
    the row where the longest change fits there, else on the lines under it (indented by :data:`UNDER`)."""
    today = datetime.now().date()
    table = [cells(row, today) for row in rows]
    sizes = [max(len(h), *(len(c[i]) for c in table)) for i, h in enumerate(HEADERS[:-1])]
    indent = sum(sizes) + 2 * len(sizes)

    def fixed(texts: list[str]) -> str:
        return "  ".join(text.ljust(size) for text, size in zip(texts, sizes, strict=True)) + "  "

    lines = [(fixed(list(HEADERS[:-1])) + (HEADERS[-1] if width - indent >= len(HEADERS[-1]) else "")).rstrip()]
    for row, texts in zip(rows, table, strict=True):
        changed = changes(row)
        if width - indent >= max(map(len, changed), default=0):
            pieces = list(_wrapped(changed, width - indent))
            lines.append((fixed(texts) + pieces[0]).rstrip())
            lines += [" " * indent + piece for piece in pieces[1:]]
        else:
            lines.append(fixed(texts).rstrip())
            lines += [UNDER + piece for piece in _wrapped(changed, width - len(UNDER))]
    return lines


UNDER = " " * 4
"""The indent of changes written under their row (an experiment's own name is indented by two)."""


def shown_experiments(selection: list[str]) -> list[dict[str, Any]]:
    """``dvc exp show --json`` (the DVC installed beside dpml) with the selection flags; DVC's error when it fails."""
    done = subprocess.run(
        [sys.executable, "-m", "dvc", "exp", "show", "--json", *selection], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"dvc exp show failed: {(done.stderr or done.stdout).strip()[-2000:]}")
    parsed: list[dict[str, Any]] = json.loads(done.stdout or "[]")
    return parsed


def selection_flags(args: argparse.Namespace) -> list[str]:
    """The ``dvc exp show`` flags that choose the commits, from this command's own."""
    flags = ["--all-commits"] if args.all_commits else []
    flags += ["--all-branches"] if args.all_branches else []
    flags += ["--all-tags"] if args.all_tags else []
    flags += [f"--rev={rev}" for rev in args.rev]
    return flags + ([f"--num={args.num}"] if args.num is not None else [])


def cmd_compare(args: argparse.Namespace) -> int:
    rows = experiment_rows(shown_experiments(selection_flags(args)))
    if args.json:
        print(json.dumps([as_record(row) for row in rows], indent=2))
        return 0
    width = args.width or shutil.get_terminal_size((120, 24)).columns
    print("\n".join(render(rows, width)))
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive integer")
    return value


def add_compare_command(sub: argparse._SubParsersAction) -> None:
    """``dpml compare`` in the command line's parser; its selection flags are ``dvc exp show``'s."""
    comp = command(sub, "compare", "the experiments of dvc exp show: ε, accuracy, verdict, what changed")
    comp.add_argument("-A", "--all-commits", action="store_true", help="every commit, with its experiments")
    comp.add_argument("-a", "--all-branches", action="store_true", help="the tip of every branch")
    comp.add_argument("-T", "--all-tags", action="store_true", help="every tagged commit")
    comp.add_argument("--rev", action="append", default=[], metavar="REV", help="this commit (repeatable)")
    comp.add_argument("-n", "--num", type=_positive, default=None, help="this many commits back from each")
    comp.add_argument("--width", type=_positive, default=None, help="line width (default: the terminal's, else 120)")
    comp.add_argument("--json", action="store_true", help=JSON_HELP)
    comp.set_defaults(func=cmd_compare)
