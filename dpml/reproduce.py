"""``dpml reproduce models:/NAME/VERSION [--verify]``: rebuild a release from its provenance and compare.

``--verify`` rebuilds the release's inputs and checks them, spending no ε:

From the version's provenance tags (:mod:`dpml.provenance`):

1. the code: ``code.commit`` is checked out in a clean, temporary git worktree of the working
   directory's repository, with the run's logged ``params.yaml`` and ``dvc.lock`` put in;
2. the data: ``data/raw`` is pulled by DVC from the remote the release pushed it to
   (``data.dvc_remote``) at the hash ``dvc.lock`` records, and checked twice: DVC's directory hash
   (the ``.dir`` manifest's MD5 equals ``data.dvc_md5`` and every file's MD5 equals the manifest's entry)
   and dpml's own content hash of the records (equals ``data.version``);
3. the guarantee: the certificate is recomputed from the logged mechanism description by the
   accountants (:func:`dpml.accounting.accountants.certify`) and must equal the logged ε.

No training, no ledger charge. Any mismatch is reported by name and makes the check fail.

Without ``--verify`` (:func:`rebuild_release`), after steps 1–2 the release is retrained in the worktree
by ``dvc repro`` of each stage from ``split`` to ``gate`` (the pulled ``data/raw`` stands in for
``ingest``, so a source file changed since is not read), with the *invoking* configuration's ledger: the
retraining is a private run like any other and is charged (said before it starts; refused like any
run over budget). Nothing is registered. The retrained certificate must equal the released one, and the
test accuracy must lie within ``band`` of the released accuracy (DP noise differs between runs unless
the operator's secret ``DPML_NOISE_SEED`` is the one the release ran with, in which case it is equal).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from dpml.config import safe_yaml
from dpml.formatting import format_score
from dpml.accounting.accountants import certify
from dpml.ledger.db import is_postgres, sqlite_file, without_password
from dpml.accounting.mechanism import MechanismDescription
from dpml.provenance import RAW_DATA, dvc, git, locked_raw_data_md5
from dpml.stages.ingest import stored_records_version


class ReproduceError(RuntimeError):
    """The release cannot be rebuilt (the message says what is missing)."""


def release_tags(uri: str, tracking: Any) -> dict[str, Any]:
    """The registered version's name, number, run id and tags (``models:/NAME/VERSION`` or ``@ALIAS``)."""
    from dpml.tracking.registered import find_version  # lazy: MLflow only where a run is recorded

    try:
        return find_version(uri, tracking)
    except ValueError as error:
        raise ReproduceError(str(error)) from None


def required_tags(release: dict[str, Any]) -> dict[str, str]:
    tags = release["tags"]
    where = f"models:/{release['name']}/{release['version']}"
    if tags.get("data.dvc") != "pushed":
        raise ReproduceError(
            f"{where}: its data was not recorded in DVC "
            f"({tags.get('data.dvc', 'released before dpml recorded provenance')})"
        )
    if tags.get("code.commit", "none") == "none":
        raise ReproduceError(f"{where}: no code.commit (it was not run from a git checkout)")
    return tags


@contextmanager
def worktree_at(commit: str, repository: Path) -> Iterator[Path]:
    """A clean, detached git worktree of ``repository`` at ``commit``; removed afterwards."""
    if git(repository, "cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        raise ReproduceError(f"code.commit {commit}: not in the git repository at {repository} (git fetch it first)")
    parent = Path(tempfile.mkdtemp(prefix="dpml-reproduce-"))
    tree = parent / "worktree"
    added = git(repository, "worktree", "add", "--detach", str(tree), commit)
    if added.returncode != 0:
        shutil.rmtree(parent, ignore_errors=True)
        raise ReproduceError(f"git worktree add {commit}: {added.stderr.strip()}")
    try:
        yield tree
    finally:
        git(repository, "worktree", "remove", "--force", str(tree))
        shutil.rmtree(parent, ignore_errors=True)


def put_logged_files(tracking: Any, run_id: str, tree: Path) -> None:
    """The run's logged ``params.yaml`` and ``dvc.lock`` into the worktree."""
    from dpml.tracking.registered import download_run_file  # lazy: MLflow only where a run is recorded

    for name in ("params.yaml", "dvc.lock"):
        try:
            local = download_run_file(tracking, run_id, name, tree.parent)
        except ValueError as error:
            raise ReproduceError(str(error)) from None
        shutil.copyfile(local, tree / name)


def pull_raw_data(tree: Path, remote: str) -> None:
    """``data/raw`` at the hash the logged ``dvc.lock`` records, from the release's remote."""
    for args in (
        ("remote", "add", "--local", "--force", "--default", "release", remote),
        ("pull", "--quiet", "ingest"),
    ):
        done = dvc(tree, *args)
        if done.returncode != 0:
            raise ReproduceError(f"dvc {' '.join(args)}: {(done.stderr or done.stdout).strip()[-800:]}")


def _md5(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def dvc_directory_mismatches(tree: Path, expected: str) -> list[str]:
    """DVC's hash of ``data/raw``, checked from the bytes: the ``.dir`` manifest in the cache hashes to
    ``expected`` and lists exactly the pulled files with their MD5s. Returns what differs."""
    if not expected.endswith(".dir"):
        return [f"data.dvc_md5 {expected!r} is not a DVC directory hash"]
    digest = expected.removesuffix(".dir")
    manifest = tree / ".dvc" / "cache" / "files" / "md5" / digest[:2] / (digest[2:] + ".dir")
    if not manifest.is_file():
        return [f"the DVC manifest {expected} was not pulled"]
    problems = []
    if _md5(manifest) != digest:
        problems.append(f"the DVC manifest's bytes hash to {_md5(manifest)}, not {digest}")
    listed = {entry["relpath"]: entry["md5"] for entry in json.loads(manifest.read_text())}
    folder = tree / RAW_DATA
    present = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    if present != set(listed):
        problems.append(f"{RAW_DATA} holds {sorted(present)}, the manifest lists {sorted(listed)}")
    problems += [
        f"{RAW_DATA}/{name}: MD5 {_md5(folder / name)}, the manifest says {md5}"
        for name, md5 in sorted(listed.items())
        if name in present and _md5(folder / name) != md5
    ]
    return problems


def recomputed_certificate(tracking: Any, run_id: str) -> tuple[float, float]:
    """(logged ε, ε recomputed by the accountants from the logged mechanism at the logged δ)."""
    from dpml.tracking.registered import load_run_json  # lazy: MLflow only where a run is recorded

    logged = load_run_json(tracking, run_id, "certificate.json")
    if not logged:
        raise ReproduceError(f"run {run_id} trained without differential privacy: no certificate to recompute")
    run_config = load_run_json(tracking, run_id, "config.json")
    fresh = certify(MechanismDescription.from_dict(logged["mechanism"]), float(run_config["dp"]["delta"]))
    return float(logged["epsilon"]), float(fresh["epsilon"])


def rebuilt_inputs(tree: Path, tracking: Any, release: dict[str, Any], echo: Callable[[str], None]) -> dict[str, Any]:
    """Steps 1–2 in the worktree ``tree``: the logged files put in, the data pulled and both hashes
    checked. Returns ``data_version`` and the ``problems`` found."""
    from dpml.tracking.registered import load_run_json  # lazy: MLflow only where a run is recorded

    tags = release["tags"]
    echo(f"code      {tags['code.commit']} checked out in a clean worktree")
    put_logged_files(tracking, release["run_id"], tree)
    problems = []
    locked = locked_raw_data_md5(tree)
    if locked != tags["data.dvc_md5"]:
        problems.append(
            f"the logged dvc.lock records {RAW_DATA} as {locked}, the version's data.dvc_md5 is {tags['data.dvc_md5']}"
        )
    pull_raw_data(tree, tags["data.dvc_remote"])
    problems += dvc_directory_mismatches(tree, tags["data.dvc_md5"])
    run_config = load_run_json(tracking, release["run_id"], "config.json")
    try:
        version = stored_records_version(tree / RAW_DATA / "records.npz", bool(run_config["data"].get("id_column")))
    except Exception as error:  # noqa: BLE001 - damaged bytes: reported as a mismatch, not a crash
        version = f"unreadable ({type(error).__name__}: {error})"
    if version != tags.get("data.version"):
        problems.append(
            f"the pulled records hash to data.version {version}, the release says {tags.get('data.version')}"
        )
    echo(
        f"data      {RAW_DATA} pulled from {tags['data.dvc_remote']}: DVC {tags['data.dvc_md5']}, "
        f"data.version {version[:16]}…"
    )
    return {"data_version": version, "problems": problems}


def _release_and_warnings(
    uri: str, tracking: Any, echo: Callable[[str], None]
) -> tuple[dict[str, Any], dict[str, Any]]:
    release = release_tags(uri, tracking)
    tags = required_tags(release)
    checks = {
        "model": f"models:/{release['name']}/{release['version']}",
        "commit": tags["code.commit"],
        "code_dirty": tags.get("code.dirty", "unknown"),
    }
    if checks["code_dirty"] != "false":
        echo(
            f"note: the release ran with uncommitted changes (code.dirty = {checks['code_dirty']}); the commit "
            "is checked out, which may differ from the code that ran"
        )
    return release, checks


def verify_release(uri: str, tracking: Any, repository: Path, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Steps 1–3 of the module docstring; returns what was checked and ``verified``."""
    release, checks = _release_and_warnings(uri, tracking, echo)
    tags = release["tags"]
    with worktree_at(tags["code.commit"], repository) as tree:
        checks |= rebuilt_inputs(tree, tracking, release, echo)
    problems: list[str] = checks["problems"]
    version = checks["data_version"]
    logged, fresh = recomputed_certificate(tracking, release["run_id"])
    if abs(fresh - logged) > 1e-9 * max(1.0, logged):
        problems.append(
            f"the certificate recomputed from the logged mechanism gives ε = {fresh:.6g}, the run logged "
            f"ε = {logged:.6g}"
        )
    echo(f"guarantee ε = {fresh:.6g} recomputed from the logged mechanism (logged {logged:.6g})")
    checks |= {
        "data_version": version,
        "dvc_md5": tags["data.dvc_md5"],
        "epsilon_logged": logged,
        "epsilon_recomputed": fresh,
        "verified": not problems,
    }
    return checks


RETRAINED_STAGES = ("split", "preprocess", "train", "certify", "audit", "gate")


def invoking_ledger(config: Any) -> dict[str, Any]:
    """The invoking configuration's ledger section with its files made absolute, for the worktree."""
    ledger = config.ledger.model_dump()
    for key in ("path", "unit_key"):
        if ledger.get(key):
            ledger[key] = str(Path(ledger[key]).resolve())
    if ledger.get("url") and not is_postgres(ledger["url"]):
        ledger["url"] = "sqlite:///" + str(sqlite_file(ledger["url"]).resolve())
    return ledger


def retrain_in(tree: Path, ledger: dict[str, Any]) -> dict[str, Any]:
    """``dvc repro`` of each stage from split to gate in ``tree``, charging ``ledger``; the certificate
    and the train metrics it produced."""
    # Read as dpml reads it (category texts such as `no`/`yes` kept as the strings they are, so the dump
    # quotes them), and written back with only the ledger section changed.
    params = safe_yaml((tree / "params.yaml").read_text(encoding="utf-8-sig"), str(tree / "params.yaml"))
    params["ledger"] = ledger
    (tree / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for stage in RETRAINED_STAGES:
        done = dvc(tree, "repro", "--single-item", "--force", "--quiet", stage)
        if done.returncode != 0:
            output = done.stdout + done.stderr
            said = [line for line in output.splitlines() if line.startswith("dpml: error:")]
            raise ReproduceError(
                f"dvc repro {stage} failed: "
                + (said[0].removeprefix("dpml: error: ") if said else output.strip()[-800:])
            )
    return {
        "certificate": json.loads((tree / "artifacts/certify/certificate.json").read_text()),
        "train": json.loads((tree / "artifacts/train/metrics.json").read_text()),
    }


def rebuild_release(
    uri: str, config: Any, repository: Path, band: float, echo: Callable[[str], None] = print
) -> dict[str, Any]:
    """Retrain the release from its commit and data (module docstring) and compare."""
    from dpml.tracking.registered import load_run_json  # lazy: MLflow only where a run is recorded

    release, checks = _release_and_warnings(uri, config.tracking, echo)
    tags = release["tags"]
    logged = load_run_json(config.tracking, release["run_id"], "certificate.json")
    released_accuracy, rounded = released_test_accuracy(config.tracking, release["run_id"])
    ledger = invoking_ledger(config)
    echo(
        f"retraining is a private run: it charges the ledger {without_password(ledger['url'] or ledger['path'])} "
        f"(lineage {tags.get('dp.lineage', '?')}, about ε = {tags.get('dp.epsilon', '?')}, budget "
        f"{ledger['epsilon_budget']:g})"
    )
    with worktree_at(tags["code.commit"], repository) as tree:
        checks |= rebuilt_inputs(tree, config.tracking, release, echo)
        if checks["problems"]:
            return checks | {"verified": False, "retrained": False}
        echo(f"train     dvc repro {' → '.join(RETRAINED_STAGES)} in the worktree")
        rebuilt = retrain_in(tree, ledger)
    problems: list[str] = checks["problems"]
    fresh = rebuilt["certificate"]
    same_certificate = all((fresh or {}).get(k) == (logged or {}).get(k) for k in ("epsilon", "delta", "mechanism"))
    if not same_certificate:
        problems.append(
            f"the retrained certificate (ε = {(fresh or {}).get('epsilon')}) differs from the released "
            f"one (ε = {(logged or {}).get('epsilon')})"
        )
    accuracy = float(rebuilt["train"]["test_accuracy"])
    compared = float(format_score(accuracy)) if rounded else accuracy  # at the precision the release wrote
    if abs(compared - released_accuracy) > band:
        problems.append(
            f"test accuracy {accuracy:.4f} is {abs(accuracy - released_accuracy):.4f} from the released "
            f"{released_accuracy:.4f}, outside the band ±{band:g}"
        )
    echo(
        f"result    certificate {'identical' if same_certificate else 'DIFFERENT'}; "
        f"test accuracy {accuracy:.4f} (released {released_accuracy:.4f}, band ±{band:g})"
    )
    return checks | {
        "epsilon": (fresh or {}).get("epsilon"),
        "test_accuracy": accuracy,
        "released_test_accuracy": released_accuracy,
        "verified": not problems,
        "retrained": True,
    }


def released_test_accuracy(tracking: Any, run_id: str) -> tuple[float, bool]:
    """The release's test accuracy and whether it was written rounded: exact from the train stage's child
    run; from the release run's own metric (rounded by :func:`dpml.formatting.format_score`) only for a
    release without stage runs, so that a retrained accuracy is compared at the precision recorded."""
    from dpml.tracking.registered import run_metrics, stage_run_metrics  # lazy: MLflow only where a run is recorded

    exact = stage_run_metrics(tracking, run_id, "train")
    if exact is not None and "test_accuracy" in exact:
        return float(exact["test_accuracy"]), False
    metrics = run_metrics(tracking, run_id)
    if "test_accuracy" not in metrics:
        raise ReproduceError(f"run {run_id}: no test_accuracy metric logged")
    return float(metrics["test_accuracy"]), True


def reproduce(
    uri: str, config: Any, repository: Path, verify: bool, band: float, echo: Callable[[str], None] = print
) -> dict[str, Any]:
    """``dpml reproduce``: :func:`verify_release` or :func:`rebuild_release`, reported; its result (``verified``:
    whether it matched)."""
    if verify:
        result = verify_release(uri, config.tracking, repository, echo)
        what = "code, data and certificate rebuilt as released"
    else:
        result = rebuild_release(uri, config, repository, band, echo)
        what = "retrained from its code and data: certificate identical, accuracy within the band"
    for problem in result["problems"]:
        echo(f"  MISMATCH: {problem}")
    echo(f"{result['model']}: " + (f"verified: {what}" if result["verified"] else "NOT verified"))
    return result
