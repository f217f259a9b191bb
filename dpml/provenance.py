"""Where a release came from: the code (git), the exact records (DVC), the settings (params.yaml, dvc.lock).

Each registered version carries enough to rebuild it on another machine:

- ``code.commit`` and ``code.dirty``: the git commit of the working directory and whether any file
  other than ``params.yaml`` and ``dvc.lock`` (both logged with the run) and the run's summary metrics
  (``metrics/``, kept in git for ``dvc metrics diff``) differs from it;
- ``data.dvc_md5``: DVC's hash of ``data/raw`` (the ingested records, the bytes training saw), beside
  dpml's own ``data.version``, and ``data.dvc_remote``: the DVC remote they were pushed to *before* the
  version was registered (``dvc push`` of the ingest stage's output);
- the artifacts ``params.yaml`` and ``dvc.lock``.

The DVC part applies when the run is the workspace's DVC pipeline: the working directory holds
``dvc.yaml`` and ``.dvc`` and the run's configuration is ``params.yaml`` as it stands (a run with
``--params``/``--set`` is described by no ``dvc.yaml`` stage). Otherwise ``data.dvc`` says why not.
``dpml reproduce`` (:mod:`dpml.reproduce`) reads these tags back.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from dpml.config import Config, absolute_paths, load
from dpml.ledger.db import is_postgres, sqlite_file
from dpml.tracking.store import sqlite_path

LOGGED_FILES = ("params.yaml", "dvc.lock")
METRICS_FOLDER = "metrics"  # the git-tracked metrics dvc.yaml names: a run's output, not code
RAW_DATA = "data/raw"


class ProvenanceError(RuntimeError):
    """The release's data could not be recorded; nothing was registered."""


def git(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``git ARGS`` in ``root``; a machine without git answers like a directory outside a repository."""
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    except FileNotFoundError:
        return subprocess.CompletedProcess(["git", *args], 127, "", "git is not installed")


def dvc(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=root, capture_output=True, text=True)


def code_state(root: Path) -> dict[str, str]:
    """``code.commit`` (``none`` outside a git checkout) and ``code.dirty`` of the working directory."""
    head = git(root, "rev-parse", "HEAD")
    if head.returncode != 0:
        return {"code.commit": "none", "code.dirty": "unknown"}
    outputs = (*LOGGED_FILES, METRICS_FOLDER)
    changed = git(root, "status", "--porcelain", "--", ".", *(f":(exclude){name}" for name in outputs))
    return {"code.commit": head.stdout.strip(), "code.dirty": str(bool(changed.stdout.strip())).lower()}


def refuse_temporary_experiment_copy(config: Config, cwd: Path | None = None) -> None:
    """``dvc exp run --temp``/``--queue`` runs each stage in a copy of the repository under
    ``.dvc/tmp/exps`` (DVC sets ``DVC_ROOT`` to the real one): a relative ledger or SQLite MLflow store
    would be a new, empty one there, and the ledger's promise (every run charged to the one account)
    would silently break. Refuse before any work; experiments run in the workspace (``dvc exp run -S``)."""
    root = os.environ.get("DVC_ROOT")
    cwd = Path.cwd() if cwd is None else cwd
    if not os.environ.get("DVC_EXP_NAME") or not root or Path(root).resolve() == cwd.resolve():
        return
    stores = {
        "ledger.url" if config.ledger.url else "ledger.path": None
        if is_postgres(config.ledger.location())
        else sqlite_file(config.ledger.location()),
        "tracking.uri": sqlite_path(config.tracking.uri),
        "tracking.registry_uri": config.tracking.registry_uri and sqlite_path(config.tracking.registry_uri),
    }
    # (an unset registry_uri is the tracking store: named once)
    relative = [f"{key} = {str(path)!r}" for key, path in stores.items() if path is not None and not path.is_absolute()]
    if relative:
        raise ValueError(
            f"{', '.join(relative)}: relative to a temporary copy of the repository ({cwd}), made by "
            f"`dvc exp run --temp/--queue`, so this experiment would spend and register in new, empty "
            f"stores, not those of {root}; run experiments in the workspace (`dvc exp run -S KEY=VALUE`, "
            "one after another) or give absolute paths or a server"
        )


def is_dvc_pipeline_run(config: Config, root: Path, searched: bool = False) -> str | None:
    """None when this run is the workspace's DVC pipeline, else why not."""
    if searched:
        return "not recorded: a hyperparameter search (dpml tune) is not the pipeline dvc.yaml describes"
    if not (root / "dvc.yaml").is_file() or not (root / ".dvc").is_dir():
        return "not recorded: the working directory is not a DVC workspace"
    if not (root / "params.yaml").is_file():
        return "not recorded: no params.yaml in the working directory"
    try:
        workspace = load(root / "params.yaml")
    except Exception as error:  # noqa: BLE001 - an unrelated, broken params.yaml: not this run's description
        return f"not recorded: params.yaml in the working directory does not load ({type(error).__name__})"
    if parameters_of(workspace) != parameters_of(config):
        return "not recorded: the run's configuration is not params.yaml as it stands (--params or --set)"
    if Path(config.paths.data).resolve() != (root / "data").resolve():
        return "not recorded: paths.data is not the data folder dvc.yaml names"
    return None


def parameters_of(config: Config) -> dict:
    """What a configuration asks for, its paths absolute: ``tracking.origins`` is dpml's record of where each
    destination came from (it names the parameter file as the run was given it), not a parameter."""
    parameters = absolute_paths(config).to_dict()
    parameters["tracking"] = {k: v for k, v in parameters["tracking"].items() if k != "origins"}
    return parameters


def default_remote(root: Path) -> tuple[str, str]:
    """The workspace's default DVC remote: its name and its URL (DVC makes a local path absolute)."""
    from dvc.repo import Repo  # lazy: DVC only where provenance asks it

    with Repo(str(root)) as repo:
        name = repo.config["core"].get("remote")
        remote = repo.config["remote"].get(name, {}) if name else {}
    if not name:
        raise ProvenanceError(f"{root}: no default DVC remote; add one (dvc remote add -d NAME URL) to record releases")
    if not remote.get("url"):
        raise ProvenanceError(f"{root}: the default DVC remote {name!r} is not defined (dvc remote list)")
    return str(name), str(remote["url"])


def locked_raw_data_md5(root: Path) -> str:
    """DVC's hash of ``data/raw`` as ``dvc.lock`` records it for the ingest stage."""
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    for out in lock["stages"]["ingest"]["outs"]:
        if out["path"] == RAW_DATA:
            return str(out["md5"])
    raise ProvenanceError(f"{root / 'dvc.lock'}: the ingest stage records no {RAW_DATA}")


RECORDED_STAGES = ("ingest", "split", "preprocess", "train", "certify", "audit", "gate")


def push_raw_data(root: Path) -> dict[str, str]:
    """Record the stages before ``register`` in ``dvc.lock`` (``dvc commit``; under ``dvc repro`` they
    already are) and push the ingest stage's ``data/raw`` to the default remote. Raises
    :class:`ProvenanceError` if the ingest stage cannot be committed or pushed, before anything is
    registered. Where a later stage's outputs differ from what ``dvc.yaml`` declares (a setting that
    leaves one out), only the ingest stage is recorded and ``dvc.lock_scope`` says so."""
    name, url = default_remote(root)
    steps: list[tuple[str, ...]] = [("push", "ingest")]
    scope = "ingest..gate, recorded by dvc repro"
    if not os.environ.get("DVC_STAGE"):  # under dvc repro, DVC recorded each stage as it ran it (and locks its outputs)
        everything = dvc(root, "commit", "--force", *RECORDED_STAGES)
        scope = "ingest..gate"
        if everything.returncode != 0:
            scope = f"ingest only ({(everything.stderr or everything.stdout).strip()[-300:]})"
            steps.insert(0, ("commit", "--force", "ingest"))
    for args in steps:
        done = dvc(root, *args)
        if done.returncode != 0:
            raise ProvenanceError(
                f"dvc {' '.join(args)} failed ({(done.stderr or done.stdout).strip()[-800:]}); "
                f"the release's data must reach the DVC remote {name!r} ({url}) before it is "
                "registered"
            )
    return {
        "data.dvc_md5": locked_raw_data_md5(root),
        "data.dvc_remote": url,
        "data.dvc": "pushed",
        "dvc.lock_scope": scope,
    }


def release_provenance(config: Config, searched: bool, root: Path | None = None) -> tuple[dict[str, str], list[Path]]:
    """The provenance tags of a release and the files to log with it (see the module docstring)."""
    root = Path.cwd() if root is None else root
    tags = code_state(root)
    why_not = is_dvc_pipeline_run(config, root, searched)
    if why_not is None:
        tags |= push_raw_data(root)
    else:
        tags["data.dvc"] = why_not
    files = [root / name for name in LOGGED_FILES if (root / name).is_file() and why_not is None]
    return tags, files
