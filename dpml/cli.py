"""The ``dpml`` command: run the pipeline, run one stage, compute ε."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import math
import os
import re
import sys
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn, TextIO

from dpml.cli_compare import add_compare_command
from dpml.cli_completion import SHELLS, completion_script
from dpml.cli_help import JSON_HELP, VERBOSE_HELP, command, examples_epilog, version
from dpml.cli_privacy import cmd_calibrate, cmd_certificate, cmd_epsilon, cmd_ledger
from dpml.cli_text import audit_record, conformance_summary_lines, power_summary, run_record, run_summary
from dpml.config import ConfigError, load
from dpml.formatting import format_epsilon
from dpml.interrupts import RunStopped, exit_code, spent_line, stop_reason, termination_raises
from dpml.ledger.ledger import LedgerError
from dpml.terminal import quiet_third_party_output, warning_line


def _run_pipeline(args: argparse.Namespace, search: bool) -> dict[str, Any]:
    """The whole pipeline (``search``: with ``dpml tune``'s search in place of one training run)."""
    from dpml.config import check_tunable  # lazy: per command

    config = load(args.params, args.set)
    if search:
        check_tunable(config)
    if args.engine == "local" and args.prefect_api:
        raise ValueError(f"--prefect-api {args.prefect_api}: only for --engine prefect (the local engine runs no flow)")
    stages = _StageEcho(sys.stderr if args.json else sys.stdout)  # --json: stdout is the JSON alone
    with _reporting_what_a_stop_spent(config, stages):
        if args.engine == "local":
            from dpml.stages import run_all  # lazy: per command

            return run_all(config, progress=True, search=search, echo=stages)
        from flows.pipeline import run_from_cli  # lazy: per command

        return run_from_cli(args.params, args.set, search=search, api_flag=args.prefect_api)


class _StageEcho:
    """``run_all``'s echo: prints its ``[dpml] NAME …`` lines and remembers the stage now running."""

    _STARTED = re.compile(r"^\[dpml\] (\w+) …$")

    def __init__(self, stream: TextIO) -> None:
        self.stage: str | None = None
        self.stream = stream

    def __call__(self, line: str) -> None:
        started = self._STARTED.match(line)
        if started:
            self.stage = started.group(1)
        print(line, file=self.stream)


@contextlib.contextmanager
def _reporting_what_a_stop_spent(config: Any, stages: _StageEcho) -> Iterator[None]:
    """Ctrl-C, SIGTERM or a cancellation inside the block: settle the run's spend and attach the line saying
    what was spent to the exception (:mod:`dpml.stages.stopped`), for :func:`main` to print. A Prefect flow
    run has already settled and attached it (it knows its stage); the local engine's stage comes from its
    echo. SIGINT and SIGTERM are held meanwhile: a second Ctrl-C must not cut the clean-up short."""
    from dpml.interrupts import note_spent, signals_held  # lazy: per command
    from dpml.stages.stopped import settle_stopped_run, spend_note  # lazy: per command

    spend_before = spend_note(config)
    try:
        yield
    except (KeyboardInterrupt, RunStopped) as stop:
        with signals_held():
            if spent_line(stop) is None:
                note_spent(stop, settle_stopped_run(config, spend_before, stop_reason(stop), stages.stage))
        raise


class _DropTraceback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True


# Loggers of the systems dpml drives that log a failure with its traceback before dpml reports it.
_TRACEBACK_LOGGERS = ("prefect.flow_runs", "prefect.task_runs", "mlflow.store.db.utils")


@contextlib.contextmanager
def _logs_without_tracebacks(unless: bool) -> Iterator[None]:
    """Prefect logs a failed flow or task run with its traceback, MLflow a failed database write; at
    the CLI a failure is one ``dpml: error:`` line, so their tracebacks go (their one-line messages
    stay) unless ``--debug``."""
    loggers = [] if unless else [logging.getLogger(name) for name in _TRACEBACK_LOGGERS]
    dropper = _DropTraceback()
    for logger in loggers:
        logger.addFilter(dropper)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(dropper)


def cmd_run(args: argparse.Namespace) -> int:
    results = _run_pipeline(args, search=False)
    print(json.dumps(run_record(results), indent=2, default=str) if args.json else run_summary(results))
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    results = _run_pipeline(args, search=True)
    config = load(args.params, args.set)
    chosen = {k.removeprefix("chosen."): v for k, v in results["train"].items() if k.startswith("chosen.")}
    if args.json:
        print(
            json.dumps(
                run_record(results)
                | {"chosen": chosen, "noisy_validation_accuracy": results["train"]["noisy_validation_accuracy"]},
                indent=2,
                default=str,
            )
        )
        return 0
    print(run_summary(results))
    print(
        f"  search               {config.tune.distribution} (E[K] = {config.tune.mean:g}); released the best "
        f"candidate {chosen}, noisy validation accuracy {results['train']['noisy_validation_accuracy']:.4f}; "
        "its ε above includes the whole search"
    )
    return 0


def cmd_stage(args: argparse.Namespace) -> int:
    from dpml.provenance import refuse_temporary_experiment_copy  # lazy: per command
    from dpml.stages import run_stage  # lazy: per command

    config = load(args.params, args.set)
    refuse_temporary_experiment_copy(config)
    result = run_stage(args.name, config, progress=True)
    printable = {k: v for k, v in result.items() if k != "certificate"}
    print(json.dumps(printable, indent=2, default=str))
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    from dpml.stages import audit_registered_model  # lazy: per command

    config = load(args.params, args.set)
    out = Path(args.out or "artifacts/reaudit")
    result = audit_registered_model(args.model, config.tracking, out)
    if args.json:
        print(json.dumps(audit_record(result, str(out)), indent=2, default=str))
        return 0 if result["consistent"] else 3
    audit = result["audit"]
    print(f"re-audit of {result['model']} (MLflow run {result['audit_run_id']}), outputs in {out}")
    for name, r in audit["target"]["attacks"].items():
        print(
            f"  {name:<22} AUC {r['auc']:.3f}, TPR@1%FPR {r['tpr_at_1pct_fpr']:.3f}, "
            f"TPR@0.1%FPR {r['tpr_at_0.1pct_fpr']:.3f}"
        )
    for bound in audit["one_run"]:
        print(f"  {bound['method']:<22} ε ≥ {bound['epsilon']:.3f}")
    for line in power_summary(audit) + conformance_summary_lines(audit):
        print(line)
    verdict = "consistent with" if audit["max_lower_bound"] <= result["certified_epsilon"] else "EXCEEDS"
    print(
        f"  largest empirical lower bound ε ≥ {audit['max_lower_bound']:.4g}: {verdict} the certified "
        f"ε = {format_epsilon(result['certified_epsilon'])}"
    )
    if not result["conforms"]:
        print("  the trainer does NOT conform to its certificate (see the conformance lines above)")
    return 0 if result["consistent"] else 3


def cmd_schema(args: argparse.Namespace) -> int:
    from dpml.data.schema_draft import draft_schema  # lazy: per command

    source = (
        args.source
        if ":" in args.source.split("/")[0]
        else f"{'parquet' if args.source.endswith(('.parquet', '.pq')) else 'csv'}:{args.source}"
    )
    text = draft_schema(source, args.label, args.id, args.max_categories)
    if args.out:
        Path(args.out).write_text(text)
        print(
            f"draft schema written to {args.out}: READ FROM THE DATA, NOT PRIVATE; replace every marked value "
            "with public knowledge before a private run",
            file=sys.stderr,
        )
    else:
        print(text, end="")
    return 0


def cmd_reproduce(args: argparse.Namespace) -> int:
    """Rebuild a release from its provenance and compare (``--verify``: no training, no ε)."""
    from dpml.reproduce import reproduce  # lazy: per command

    config = load(args.params, args.set)
    echo = (lambda line: print(line, file=sys.stderr)) if args.json else print  # --json: stdout is the JSON alone
    result = reproduce(args.model, config, Path.cwd(), args.verify, args.accuracy_band, echo)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    return 0 if result["verified"] else 3


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text}: must be a finite number")
    return value


def _positive_float(text: str) -> float:
    value = _number(text)
    if not 0 < value <= 1e6:
        raise argparse.ArgumentTypeError(f"{text}: must be in (0, 1e6]")
    return value


def _rate(text: str) -> float:
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: must be in (0, 1]")
    return value


def _band(text: str) -> float:
    value = _number(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: must be in [0, 1]")
    return value


def _delta(text: str) -> float:
    value = _number(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be in (0, 1)")
    return value


def _steps(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: must be an integer ≥ 1") from None
    if not 1 <= value <= 10**9:
        raise argparse.ArgumentTypeError(f"{text}: must be an integer in [1, 1e9]")
    return value


STAGE_NAMES = ("ingest", "split", "preprocess", "train", "certify", "audit", "gate", "register")


def mechanism_args(p: argparse.ArgumentParser, required: bool) -> None:
    """DP-SGD's parameters; σ and steps are optional where one of them is being calibrated."""
    p.add_argument(
        "--noise-multiplier",
        type=_positive_float,
        required=required,
        default=None,
        help="σ: the Gaussian noise's standard deviation over the clip norm",
    )
    p.add_argument("--sample-rate", type=_rate, required=True, help="q: each record's Poisson sampling rate, in (0, 1]")
    p.add_argument("--steps", type=_steps, required=required, default=None, help="the number of DP-SGD steps")
    p.add_argument("--delta", type=_delta, default=1e-5, help="δ of the (ε, δ) guarantee (default 1e-5)")
    p.add_argument(
        "--neighbouring",
        choices=("add-remove", "replace-one"),
        default="add-remove",
        help="the neighbouring relation: add or remove one record (default), or replace one",
    )
    p.add_argument("--json", action="store_true", help=JSON_HELP)


def prefect_api_arg(p: argparse.ArgumentParser) -> None:
    """``--prefect-api URL``: the run's Prefect API, before ``PREFECT_API_URL`` (``flows/prefect_api.py``)."""
    p.add_argument(
        "--prefect-api",
        metavar="URL",
        default=None,
        help="the Prefect API of the flow run, e.g. http://127.0.0.1:4200/api (default: PREFECT_API_URL, "
        "else a temporary server for this run alone)",
    )


class Parser(argparse.ArgumentParser):
    """argparse with dpml's one-line errors (``dpml: error: …``, exit 2); ``--help`` shows the usage."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("dpml").strip()
        print(f"dpml: error: {command + ': ' if command else ''}{message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="dpml",
        description="Privacy-audited model production.",
        epilog=examples_epilog("dpml"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=version())
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error")
    parser.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", required=True)

    def config_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--params", default="params.yaml", help="configuration file (default: params.yaml)")
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="SECTION.KEY=VALUE",
            help="override one parameter, e.g. --set dp.target_epsilon=2 (repeatable)",
        )
        # also accepted after the command (dpml run --verbose); SUPPRESS keeps `dpml --verbose run`'s value
        p.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)

    run = command(sub, "run", "run the whole pipeline")
    config_args(run)
    run.add_argument(
        "--engine",
        choices=("prefect", "local"),
        default="prefect",
        help="prefect: a Prefect flow run (default); local: the stages in-process",
    )
    prefect_api_arg(run)
    run.add_argument("--json", action="store_true", help=JSON_HELP)
    run.set_defaults(func=cmd_run)

    tun = command(sub, "tune", "private hyperparameter search (tune section), then certify, audit, release")
    config_args(tun)
    tun.add_argument(
        "--engine",
        choices=("prefect", "local"),
        default="prefect",
        help="prefect: a Prefect flow run (default); local: the stages in-process",
    )
    prefect_api_arg(tun)
    tun.add_argument("--json", action="store_true", help=JSON_HELP)
    tun.set_defaults(func=cmd_tune)

    stage = command(sub, "stage", "run one stage (what dvc.yaml calls)")
    stage.add_argument("name", choices=STAGE_NAMES, help="the stage: " + ", ".join(STAGE_NAMES))
    config_args(stage)
    stage.set_defaults(func=cmd_stage)

    aud = command(sub, "audit", "re-audit a registered model version with the data it was trained on")
    aud.add_argument("--model", required=True, help="models:/NAME@ALIAS or models:/NAME/VERSION")
    aud.add_argument(
        "--out", default=None, help="folder for the rebuilt data and audit outputs (default artifacts/reaudit)"
    )
    config_args(aud)
    aud.add_argument("--json", action="store_true", help=JSON_HELP)
    aud.set_defaults(func=cmd_audit)

    rep = command(sub, "reproduce", "rebuild a registered release's code, data and certificate and check them")
    rep.add_argument("model", help="models:/NAME/VERSION or models:/NAME@ALIAS")
    rep.add_argument(
        "--verify",
        action="store_true",
        help="check out its commit, pull its data from the DVC remote, check both hashes, recompute the "
        "certificate; no training, no ε (without it: retrain by dvc repro, charged to the ledger)",
    )
    rep.add_argument(
        "--accuracy-band",
        type=_band,
        default=0.05,
        help="retraining: largest accepted |test accuracy - released| (default 0.05)",
    )
    config_args(rep)
    rep.add_argument("--json", action="store_true", help=JSON_HELP)
    rep.set_defaults(func=cmd_reproduce)

    cert = command(sub, "certificate", "recompute a release's certificate from its logged mechanism description")
    which = cert.add_mutually_exclusive_group(required=True)
    which.add_argument("model", nargs="?", default=None, help="models:/NAME/VERSION or models:/NAME@ALIAS")
    which.add_argument("--run", default=None, help="MLflow run id of a pipeline run (instead of a release)")
    cert.add_argument("--json", action="store_true", help=JSON_HELP)
    config_args(cert)
    cert.set_defaults(func=cmd_certificate)

    sch = command(sub, "schema", "draft a table's data: section from its file (read from the data: NOT private)")
    sch.add_argument("source", help="csv:PATH, parquet:PATH, or a path (.parquet/.pq read as Parquet)")
    sch.add_argument("--label", required=True, help="the label column")
    sch.add_argument("--id", default=None, help="the column naming the person each row belongs to")
    sch.add_argument("--max-categories", type=int, default=30, help="categories kept per column (default 30)")
    sch.add_argument("--out", default=None, help="write the draft here instead of printing it")
    sch.set_defaults(func=cmd_schema)

    cal = command(sub, "calibrate", "σ for a target ε (given steps), or the most steps (given σ)")
    cal.add_argument("--target-epsilon", type=_positive_float, required=True, help="the ε to reach")
    mechanism_args(cal, required=False)
    cal.set_defaults(func=cmd_calibrate)

    led = command(sub, "ledger", "the privacy budget ledger: per lineage, its spends and each person's ε")
    led.add_argument(
        "action",
        nargs="*",
        metavar="rename OLD NEW",
        help="rename lineage OLD to NEW, keeping its history (with --merge: into the existing lineage NEW)",
    )
    led.add_argument(
        "--merge",
        action="store_true",
        help="rename: merge OLD into the existing lineage NEW (one account for the people of both)",
    )
    led.add_argument("--dataset", default=None, help="one lineage (ledger.dataset; default: every lineage)")
    led.add_argument(
        "--person",
        default=None,
        metavar="ID",
        help="every release that touched the person with this id (data.id_column), across lineages",
    )
    led.add_argument("--json", action="store_true", help=JSON_HELP)
    config_args(led)
    led.set_defaults(func=cmd_ledger)

    eps = command(sub, "epsilon", "ε of DP-SGD with Poisson sampling, from every accountant")
    mechanism_args(eps, required=True)
    eps.set_defaults(func=cmd_epsilon)

    add_compare_command(sub)
    comp = command(sub, "completion", "print the shell completion script of dpml (bash or zsh)")
    comp.add_argument("shell", choices=SHELLS, help="the shell: " + " or ".join(SHELLS))
    comp.set_defaults(func=cmd_completion)
    return parser


def cmd_completion(args: argparse.Namespace) -> int:
    print(completion_script(build_parser(), args.shell), end="")
    return 0


_STORAGE_FULL = ("database or disk is full", "disk I/O error", "No space left on device", "File too large")


def _one_line(error: BaseException) -> str:
    """An error as one line: its message's lines joined (a configuration error lists each key)."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    foreign = not type(error).__module__.startswith("dpml")  # dpml's own errors are phrased where they happen
    if foreign and any(sign in text for sign in _STORAGE_FULL):  # SQLite (via SQLAlchemy) on a full disk
        return (
            f"a write failed: {text.split(' [SQL:')[0][:300]}; is the disk full? Free space and run again "
            "(a spend already started stays counted in the ledger)"
        )
    if isinstance(error, OSError) and error.filename is not None:
        return f"cannot use {error.filename}: {error.strerror or text} (check the path, its permissions and free space)"
    known = (ConfigError, ValueError, LookupError, LedgerError, RuntimeError)
    return text if isinstance(error, known) and text else f"{type(error).__name__}: {text or 'no message'}"


def main(argv: list[str] | None = None) -> int:
    """Run one command; every failure ends as one ``dpml: error: …`` line (the traceback with --debug)."""
    args = build_parser().parse_args(argv)
    if not args.verbose:
        quiet_third_party_output()
    warnings.showwarning = functools.partial(warning_line, verbose=args.verbose)
    try:
        with termination_raises(), _logs_without_tracebacks(unless=args.debug):
            return int(args.func(args))
    except BrokenPipeError:  # `dpml … | head`: the reader left; nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (KeyboardInterrupt, RunStopped) as stop:  # Ctrl-C, SIGTERM, a cancellation: one line, what was spent
        if args.debug:
            traceback.print_exc()
        print(f"dpml: {spent_line(stop) or stop_reason(stop)}", file=sys.stderr)
        return exit_code(stop)
    except Exception as error:  # noqa: BLE001 - the CLI boundary: one line, the traceback only with --debug
        if args.debug:
            traceback.print_exc()
        print(f"dpml: error: {_one_line(error)}", file=sys.stderr)
        return 2 if isinstance(error, ConfigError) else 1


if __name__ == "__main__":
    sys.exit(main())
