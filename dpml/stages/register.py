"""Stage register: log the run to MLflow and register the model version with its privacy tags."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dpml import io
from dpml.data.tables import table_encoding, transform_of
from dpml.faults import fault_point
from dpml.formatting import format_epsilon, format_lower_bound, format_score
from dpml.accounting.mechanism import MechanismDescription
from dpml.provenance import release_provenance
from dpml.stages.audit import audit_detail_metrics, strongest
from dpml.stages.layout import CONTRACT, Layout, load_model
from dpml.stages.records import driver_tags, stage_params, stage_records
from dpml.stages.spend_outputs import check_outputs_of_spend
from dpml.stages.train import lineage_of, open_ledger, release_config
from dpml.report.release_card import render_card
from dpml.report.verdict import verdict_lines, verdict_metrics, verdict_tags

if TYPE_CHECKING:
    from dpml.config import Config
    from dpml.ledger.ledger import Ledger, Spend


def serving_spec(config: Config, data_meta: dict[str, Any]) -> dict[str, Any]:
    """What the registered model needs to take raw records (:mod:`dpml.tracking.serving`), all public: the class
    names, the table encoding or the raw feature count, and the public transform."""
    encoding = table_encoding(config.data, config.preprocess)
    source = {"table": encoding.to_dict()} if encoding is not None else {"n_features": int(data_meta["n_features"])}
    return {
        "format": 1,
        "classes": [str(c) for c in data_meta["classes"]],
        "input": source,
        "transform": transform_of(config).to_dict(),
    }


RESOLVED = {
    "released",
    "release_abandoned",
    "cancelled",
    "failed",  # events after which a spend's release is settled
    "interrupted",
}  # stopped before registration (dpml.stages.stopped)


def reconcile_interrupted_releases(config: Config, ledger: Ledger) -> None:
    """Settle what interrupted registrations left, before this one registers.

    Every run whose registration never finished — FAILED or KILLED, or RUNNING under a process that was
    killed outright — has its model versions withdrawn and the champion alias put back
    (:func:`dpml.tracking.runs.clean_up_unreleased_runs`); its spend gets ``release_abandoned`` (it stays
    counted, and ``dpml stage register`` may still release its outputs). A run killed after its MLflow
    run finished but before the ledger heard of it released a model the ledger does not name: its spend
    gets the ``released`` event it missed, marked ``reconciled``.
    """
    from dpml.tracking import runs as tracking  # lazy: MLflow only where a run is recorded

    spends = {s.id: s for s in ledger.spends(counted_only=False)}
    for cleaned in tracking.clean_up_unreleased_runs(config.tracking, registering_processes(ledger)):
        spend_id = cleaned["spend_id"]
        if spend_id.isdigit() and int(spend_id) in spends:
            ledger.record_event(
                int(spend_id), "release_abandoned", {"run_id": cleaned["run_id"], "withdrawn": cleaned["withdrawn"]}
            )
    unsettled = {
        s.id: s.created_at for s in spends.values() if not RESOLVED & {kind for kind, _ in ledger.events(s.id)}
    }
    for spend_id, release in tracking.finished_releases(config.tracking, unsettled).items():
        ledger.record_event(spend_id, "released", release | {"reconciled": "true"})


REGISTERING = "registering"  # a spend's event: the host and process that start registering its release


def registering_processes(ledger: Ledger) -> Callable[[dict[str, str]], list[tuple[str, int]]]:
    """For a run's tags, the processes this ledger recorded as registering its spend (``ledger.spend``, the
    spend's identity: :func:`spend_tag`); none for a run of another ledger or of no spend."""
    spend_ids = {identity_of(spend): spend.id for spend in ledger.spends(counted_only=False)}

    def processes(tags: dict[str, str]) -> list[tuple[str, int]]:  # asked for the unfinished runs only
        spend_id = spend_ids.get(tags.get("ledger.spend", ""))
        if spend_id is None:
            return []
        return [
            (str(d.get("host", "")), int(d["pid"]))
            for kind, d in ledger.events(spend_id)
            if kind == REGISTERING and str(d.get("pid", "")).isdigit()
        ]

    return processes


CARD = "release_card.html"  # the release card's artifact name (MLflow) beside release.json (disk)


def spend_tag(ledger: Ledger, spend_id: int) -> str:
    """The spend's identity on its model version (``ledger.spend``): its id and the time it was reserved,
    so that two ledgers' spend 7 never pass for one another in a shared registry."""
    spend = next((s for s in ledger.spends(counted_only=False) if s.id == spend_id), None)
    if spend is None:
        raise RuntimeError(f"spend {spend_id} is not in the ledger at {ledger.location}")
    return identity_of(spend)


def identity_of(spend: Spend) -> str:
    """``<id>@<reservation time>``: unique across ledgers sharing a registry."""
    return f"{spend.id}@{spend.created_at:.6f}"


def conformance_tag(summary: dict[str, Any]) -> str:
    """``passed``, ``failed: <check>, …`` or ``not checked: <why>`` (older audit records: ``not checked``)."""
    conformance = summary.get("conformance")
    if not conformance or not conformance["ran"]:
        return "not checked" + (f": {conformance['reason']}" if conformance else "")
    failed = [c["check"] for c in conformance["checks"] if not c["passed"]]
    return "passed" if not failed else "failed: " + ", ".join(failed)


def run_name(dataset: str, trainer: str, epsilon: float) -> str:
    """The parent MLflow run's name, e.g. ``fashion-mnist · dpsgd · ε=2.99987``."""
    return f"{dataset} · {trainer} · ε={format_epsilon(epsilon)}"


def version_description(tags: dict[str, str], decision: dict[str, Any]) -> str:
    """The model version's description (Markdown, shown at the top of its page): the guarantee, the audit's
    verdict and the gate, from the version's own tags."""
    evidence = "counted as evidence" if tags["audit.is_evidence"] == "true" else "not counted as evidence"
    return "\n".join(
        [
            f"**{decision['verdict']['title']}**",
            "",
            *(f"- {line.strip()}" for line in verdict_lines(decision["verdict"])),
            "",
            f"- **certified ε = {tags['dp.epsilon']}** at δ = {tags['dp.delta']} ({tags['privacy.guarantee']}; "
            f"accountant {tags['dp.accountant']})",
            f"- mechanism: {tags['dp.mechanism']}",
            f"- audit: largest empirical ε lower bound {tags['audit.epsilon_lower_bound']} ({evidence}); strongest "
            f"attack AUC {tags['audit.auc']} ({tags['audit.auc_attack']}); conformance {tags['audit.conformance']}",
            f"- release gate: {'PASSED' if decision['passed'] else 'FAILED'}: {tags['gate.reason']}",
            f"- data: {tags['dp.lineage']}, version {tags['data.version'][:12]}",
        ]
    )[:5000]  # MLflow keeps 5000 characters


def register(config: Config) -> dict[str, Any]:
    """Log the run to MLflow and register the model version with its privacy tags — once per spend, and
    only the outputs that spend paid for (:mod:`dpml.stages.spend_outputs`): a spend already released in
    this registry gets its version back (a retried task, a repeated ``dpml stage register``)."""
    from dpml.tracking import runs as tracking  # lazy: MLflow only where a run is recorded
    from dpml.tracking.dataset import training_dataset  # lazy: MLflow only where a run is recorded

    started = time.time()
    as_run = config
    config = release_config(config)
    layout = Layout(config)
    ledger = open_ledger(config)
    spend_id = check_outputs_of_spend(layout, ledger)
    reconcile_interrupted_releases(config, ledger)
    identity = spend_tag(ledger, spend_id)
    decision = io.read_json(layout.gate)
    train_metrics = io.read_json(layout.train_metrics)
    certificate = io.read_json(layout.certificate)
    summary = io.read_json(layout.audit)
    data_meta = io.read_json(layout.raw_meta)
    attacks = summary["target"]["attacks"]
    strongest_auc, auc = strongest(attacks, "auc")
    strongest_tpr, tpr = strongest(attacks, "tpr_at_0.1pct_fpr")
    epsilon = certificate["epsilon"] if certificate else float("inf")
    mechanism = "none (non-private)"
    if certificate:
        mechanism = MechanismDescription.from_dict(certificate["mechanism"]).summary()
    spend = io.read_json(layout.spend)
    lineage = spend.get("lineage") or lineage_of(config)
    lineage_max = ledger.total(lineage)
    version_tags = {
        "dp.epsilon": format_epsilon(epsilon),
        "privacy.guarantee": "none" if not certificate else certificate.get("kind", "dp"),
        "dp.lineage": lineage,
        "dp.lineage_max_unit_epsilon": format_epsilon(lineage_max),
        "dp.lineage_delta": f"{config.ledger.delta:g}",
        "dp.units_trained": "unknown" if spend.get("units") is None else str(spend["units"]),
        "dp.units_excluded": str(train_metrics.get("units_excluded", 0)),
        "ledger.spend_id": str(spend["spend_id"]),
        "ledger.spend": identity,
        "dp.delta": f"{config.dp.delta:g}",
        "dp.accountant": f"{certificate['accountant']} {certificate['accountant_version']}" if certificate else "none",
        "dp.mechanism": mechanism,
        "data.version": data_meta["version"],
        "audit.auc": f"{auc:.6g}",
        "audit.auc_attack": strongest_auc,
        "audit.tpr_at_0.1pct_fpr": f"{tpr:.6g}",
        "audit.tpr_attack": strongest_tpr,
        "audit.epsilon_lower_bound": format_lower_bound(summary["max_lower_bound"]),
        "audit.control_tpr_at_1pct_fpr": "none"
        if summary["control_power"] is None
        else f"{summary['control_power']:.6g}",
        "audit.is_evidence": str(decision["audit_is_evidence"]).lower(),
        "audit.references": str(summary["references"]["per_subject"]),
        "audit.conformance": conformance_tag(summary),
        "gate.passed": str(decision["passed"]).lower(),
        "gate.reason": "; ".join(decision["reasons"])[:5000],
        **verdict_tags(decision["verdict"]),
    }
    metrics = {  # as written everywhere else (dpml.formatting: ε rounded up, the lower bound down); the exact
        # values are on the stage runs (train: accuracies, certify: ε) and in their files
        "test_accuracy": float(format_score(train_metrics["test_accuracy"])),
        "train_accuracy": float(format_score(train_metrics["train_accuracy"])),
        "epsilon": float(format_epsilon(epsilon)),
        "delta": config.dp.delta,
        "audit.max_epsilon_lower_bound": float(format_lower_bound(summary["max_lower_bound"])),
        "gate.passed": int(decision["passed"]),
        **verdict_metrics(decision["verdict"]),
    }
    metrics |= {k: v for k, v in train_metrics.items() if k.startswith("robust_")}
    if certificate and certificate.get("kind") == "kl":
        version_tags |= {
            "kl.certified": f"{certificate['kl']:.6g}",
            "kl.pinsker_delta": f"{certificate['pinsker_delta']:.6g}",
        }
        metrics["kl_certified"] = certificate["kl"]
    if layout.tuning.exists():
        tuning = io.read_json(layout.tuning)
        version_tags |= {
            "tune.chosen": json.dumps(tuning["chosen"], sort_keys=True),
            "tune.selection": str(tuning["selection"]),
            "tune.noisy_validation_accuracy": f"{tuning['noisy_validation_accuracy']:.6g}",
        }
    provenance, logged_files = release_provenance(as_run, searched=layout.tuning.exists())
    cards: dict[str, str] = {}

    def release_card(run_id: str, version: str) -> dict[str, str]:
        """The release card, once the version's number exists (:mod:`dpml.report.release_card`)."""
        facts = {
            "model": config.tracking.model_name or "",
            "version": version,
            "model URI": f"models:/{config.tracking.model_name}/{version}",
            "run": run_id,
            "commit": provenance.get("code.commit", "none"),
            "data version": data_meta["version"],
            "data set": lineage,
            "trainer": config.train.algorithm,
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "test accuracy": f"{train_metrics['test_accuracy']:.4f}",
        }
        standing = ledger.summary(lineage)
        cards[CARD] = render_card(
            identity=facts,
            verdict=decision["verdict"],
            certificate=certificate,
            audit=summary,
            scores=io.read_json(layout.scores) if layout.scores.exists() else None,
            ledger=standing[0] if standing else None,
            budget=config.ledger.epsilon_budget,
            reasons=decision["reasons"],
        )
        return dict(cards)

    earlier = tracking.release_of_spend(config.tracking, identity)
    if earlier is not None:  # this spend's one version: judged again if the gate's verdict changed
        if earlier.pop("recorded_verdict") != version_tags["gate.passed"]:
            judged = {k: v for k, v in version_tags.items() if k.startswith(("gate.", "verdict"))}
            earlier = tracking.record_verdict(
                config.tracking, earlier, judged, version_description(version_tags, decision)
            )
        release_card(earlier["run_id"], earlier["model_version"])
        io.write_text(layout.release_card, cards[CARD])
        return finish_release(
            config, layout, ledger, spend_id, earlier | {"already_released": True}, decision, train_metrics
        )
    artifacts = [
        p
        for p in (
            layout.report,
            layout.certificate,
            layout.mechanism,
            layout.audit,
            layout.scores,
            layout.roc_png,
            layout.roc_control_png,
            layout.histograms_png,
            layout.gate,
            layout.model_spec,
            layout.tuning,
            layout.model_source,
        )
        if p.exists()
    ]
    version_tags |= provenance
    # A fixed DPML_NOISE_SEED makes the noise reproducible: private only while the value stays secret.
    seed_fixed = str(bool(train_metrics.get("noise_seed_fixed", False))).lower()
    version_tags["noise_seed.fixed"] = seed_fixed
    own_record = {
        "stage": "register",
        "started": started,
        "ended": None,
        "params": stage_params(config, "register"),
        "metrics": {},
    }  # ends when its nested run is written, after the model version
    ledger.record_event(spend_id, REGISTERING, {"host": socket.gethostname(), "pid": os.getpid()})  # for a kill
    release = tracking.log_release(
        config=config.tracking,
        run_name=run_name(lineage, config.train.algorithm, epsilon),
        params=config.run_params(),
        metrics=metrics,
        artifacts=artifacts + logged_files,
        model=load_model(layout),
        in_features=int(io.read_json(layout.prepared_meta)["n_features"]),
        serving_spec=serving_spec(config, data_meta),
        version_tags=version_tags,
        version_description=version_description(version_tags, decision),
        promote=decision["passed"],
        dataset=training_dataset(lineage, config.data.source, data_meta["version"]),
        stage_runs=with_audit_detail(stage_records(layout, list(CONTRACT)[:-1]), summary) + [own_record],
        run_tags={
            "data.version": data_meta["version"],
            "data.origin": data_meta["origin"],
            "dp.epsilon": version_tags["dp.epsilon"],
            "gate.passed": str(decision["passed"]).lower(),
            **verdict_tags(decision["verdict"]),
            "noise_seed.fixed": seed_fixed,
            "ledger.spend_id": str(spend["spend_id"]),
            "ledger.spend": identity,
            **provenance,
            **driver_tags(),
            "mlflow.note.content": version_description(version_tags, decision),
        },  # the run page's description
        documents={"config.json": config.to_dict()},
        after_version=release_card,
    )
    if CARD in cards:
        io.write_text(layout.release_card, cards[CARD])  # the same page, to open from disk
    return finish_release(config, layout, ledger, spend_id, release, decision, train_metrics)


def with_audit_detail(records: list[dict[str, Any]], summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The stage records with the audit's detail on the audit stage's own nested run, so that the release's
    run keeps the headline numbers a reviewer sorts by. Where the audit stage left no record (outputs restored
    from before dpml kept them), the detail gets a record of its own, so nothing is dropped."""
    detail = audit_detail_metrics(summary)
    audited = [r for r in records if r["stage"] == "audit"]
    if not audited:
        now = time.time()
        return records + [{"stage": "audit", "started": now, "ended": now, "params": {}, "metrics": detail}]
    return [r | {"metrics": r["metrics"] | detail} if r["stage"] == "audit" else r for r in records]


def finish_release(
    config: Config,
    layout: Layout,
    ledger: Ledger,
    spend_id: int,
    release: dict[str, Any],
    decision: dict[str, Any],
    train_metrics: dict[str, Any],
) -> dict[str, Any]:
    """Tell the ledger the spend is released (once), write ``release.json`` and return the release."""
    fault_point("register:before_released_event")
    if "released" not in {kind for kind, _ in ledger.events(spend_id)}:
        ledger.record_event(spend_id, "released", {"run_id": release["run_id"], "model_uri": release["model_uri"]})
    lineage = io.read_json(layout.spend).get("lineage") or lineage_of(config)
    epsilon = (io.read_json(layout.certificate) or {}).get("epsilon", float("inf"))
    release |= {
        "gate_passed": decision["passed"],
        "epsilon": epsilon,
        "test_accuracy": train_metrics["test_accuracy"],
        "lineage": lineage,
        "lineage_max_unit_epsilon": ledger.total(lineage),
        "spend_id": spend_id,
        "experiment": config.tracking.experiment,
        "origins": dict(config.tracking.origins),
        "card": str(layout.release_card),
        "report": str(layout.report),
    }
    io.write_json(layout.release, release)
    return release
