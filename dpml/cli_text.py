"""What the CLI prints: the run summary, the audit's power and conformance lines, a lineage's ledger view."""

from __future__ import annotations

from typing import Any

from dpml.formatting import format_epsilon, format_lower_bound
from dpml.report.verdict import counted_power, verdict_lines


def slot_lines(counts: dict[str, dict[str, int]] | None) -> list[str]:
    """The table's cells that went to a declared fill or slot (printed for the operator; not logged)."""
    if not counts or not (counts.get("missing") or counts.get("other")):
        return []
    parts = [f"{name}: {n} missing" for name, n in counts.get("missing", {}).items()]
    parts += [f"{name}: {n} <other>" for name, n in counts.get("other", {}).items()]
    return [f"  table cells          {', '.join(parts)} (to the declared fills and slots; data/raw/meta.json)"]


def run_summary(results: dict[str, Any]) -> str:
    """The run in at most 15 lines (16 when the model registry is another store): the verdict first, then
    the numbers it rests on and where the release went; every detail one step away (the release card, the
    privacy report, ``dpml audit``/``dpml ledger``)."""
    train, cert, audit, gate, release = (results[k] for k in ("train", "certify", "audit", "gate", "register"))
    eps = cert["epsilon"]
    accountant = f"  ({cert['certificate']['accountant']})" if cert.get("certificate") else "  (non-private)"
    lines = [
        "",
        "dpml run summary",
        f"  release gate         {gate['verdict']['title']}",
        *verdict_lines(gate["verdict"], indent="    ", width=17),
        f"  certified epsilon    {format_epsilon(eps)} at delta = {cert['delta']:g}{accountant}; lineage "
        f"{release['lineage']}: largest unit ε {format_epsilon(release['lineage_max_unit_epsilon'])} (dpml ledger)",
        f"  test accuracy        {train['test_accuracy']:.4f}",
        audit_line(audit, eps),
        f"  model version        {release['model_uri']}"
        + ("  → alias champion" if release["champion"] else "")
        + ("  (this spend's release, registered before)" if release.get("already_released") else "")
        + f"  MLflow run {release['run_id']}",
        *destination_lines(release),
        "  UI                   "
        + ui_hint(release["tracking_uri"], release.get("registry_uri"))
        + "  then "
        + review_hint(release["tracking_uri"], release["experiment_id"]),
        *prefect_lines(results.get("prefect")),
        f"  details              {release.get('card', 'release_card.html')} (release card), "
        f"{release.get('report', 'privacy_report.md')} (privacy report)",
        *slot_lines(results.get("ingest", {}).get("slot_counts")),
    ]
    return "\n".join(lines)


def run_record(results: dict[str, Any]) -> dict[str, Any]:
    """``dpml run --json`` (and ``tune``): what :func:`run_summary` says, as data — the three-part verdict, the
    certificate's numbers, the audit's headline and where the release went."""
    cert, audit, gate, release = (results[k] for k in ("certify", "audit", "gate", "register"))
    return {
        "verdict": gate["verdict"],
        "epsilon": cert["epsilon"],
        "delta": cert["delta"],
        "accountant": (cert.get("certificate") or {}).get("accountant"),
        "test_accuracy": results["train"]["test_accuracy"],
        "largest_lower_bound": audit["max_lower_bound"],
        "lineage": release["lineage"],
        "lineage_max_unit_epsilon": release["lineage_max_unit_epsilon"],
        "model_uri": release["model_uri"],
        "champion": release["champion"],
        "already_released": bool(release.get("already_released")),
        "run_id": release["run_id"],
        "tracking_uri": release["tracking_uri"],
        "registry_uri": release.get("registry_uri") or release["tracking_uri"],
        "experiment_id": release["experiment_id"],
        "release_card": release.get("card"),
        "privacy_report": release.get("report"),
        "prefect": results.get("prefect"),
    }


def audit_record(result: dict[str, Any], out: str) -> dict[str, Any]:
    """``dpml audit --json``: the re-audit's attacks, bounds and verdict against the certified ε, as data."""
    audit = result["audit"]
    return {
        "model_uri": f"models:/{result['model']}",
        "audit_run_id": result["audit_run_id"],
        "outputs": out,
        "certified_epsilon": result["certified_epsilon"],
        "largest_lower_bound": audit["max_lower_bound"],
        "consistent": bool(result["consistent"]),
        "conforms": bool(result["conforms"]),
        "attacks": {
            name: {k: r[k] for k in ("auc", "tpr_at_1pct_fpr", "tpr_at_0.1pct_fpr")}
            for name, r in audit["target"]["attacks"].items()
        },
        "one_run": [{"method": b["method"], "epsilon": b["epsilon"]} for b in audit["one_run"]],
    }


def audit_line(audit: dict[str, Any], epsilon: float) -> str:
    """The audit in one line: the largest counted lower bound against the certified ε and the most its methods
    could show (their power), the strongest attack (with the non-private control beside it) and the reference
    models."""
    attacks, control = audit["target"]["attacks"], audit.get("control", {}).get("attacks", {})
    name = max(attacks, key=lambda n: attacks[n]["auc"])
    beside = f" | control {control[name]['auc']:.3f}" if name in control else ""
    references = audit["references"]
    power = counted_power(audit)
    reach = f"its methods reach {power:.3g}; " if power is not None else ""
    return (
        f"  audit                empirical ε lower bound {format_lower_bound(audit['max_lower_bound'])} "
        f"(certified {format_epsilon(epsilon)}); {reach}"
        f"strongest {name} AUC {attacks[name]['auc']:.3f}{beside}; reference models {references['models']} "
        f"({references['found_stored']} stored, {references['trained_by_this_stage']} trained)"
    )


def prefect_lines(prefect: dict[str, Any] | None) -> list[str]:
    """A Prefect run's flow run and the API it reported to, with where that API came from (``--prefect-api``,
    ``PREFECT_API_URL`` or a temporary server, stopped when the run ended); nothing for ``--engine local``."""
    if not prefect:
        return []
    origin = prefect.get("origin")
    where = {"temporary server": "a temporary server for this run, stopped when it ended"}.get(origin or "", origin)
    return [
        f"  Prefect              flow run {prefect['flow_run_name']} ({prefect['flow_run_id']}) via API "
        f"{prefect['api_url']}" + (f"  ({where})" if where else "")
    ]


def destination_lines(release: dict[str, Any]) -> list[str]:
    """Where the run wrote and why: the tracking store, the registry (when it was set: otherwise it is the
    tracking store) and the experiment, each with the setting it came from (flag, environment variable,
    params.yaml or default; :mod:`dpml.routing`)."""
    origins = release.get("origins") or {}
    if not origins:
        return []
    registry = release.get("registry_uri") or release["tracking_uri"]
    registry_origin = origins.get("registry_uri", "default")
    shown = [(release["tracking_uri"], origins.get("uri", "default"), "tracking store")]
    if registry != release["tracking_uri"] or registry_origin != "default":
        shown.append((registry, registry_origin, "model registry"))  # the same store unless told otherwise
    shown.append((release.get("experiment", ""), origins.get("experiment", "default"), "experiment"))
    return [f"  {label:<20} {value}  ({origin})" for value, origin, label in shown]


def ui_hint(uri: str, registry_uri: str | None = None) -> str:
    """Where to look at the release: a tracking server is opened in a browser at its own URL; the embedded
    store through ``mlflow ui`` on its database (and its registry, when that is another store)."""
    from dpml.tracking.store import is_server  # lazy: per command

    if is_server(uri):
        return f"{uri.rstrip('/')}  (the tracking server's UI)"
    registry = f" --registry-store-uri {registry_uri}" if registry_uri and registry_uri != uri else ""
    return f"mlflow ui --backend-store-uri {uri}{registry} --host 127.0.0.1"


def review_hint(uri: str, experiment_id: str) -> str:
    """The runs list with the headline columns (:func:`dpml.tracking.review_view.review_url`): a full URL on a tracking
    server, the path to open in ``mlflow ui`` (at http://127.0.0.1:5000 by default) otherwise."""
    from dpml.tracking.store import is_server  # lazy: per command
    from dpml.tracking.review_view import review_url  # lazy: per command

    return review_url(experiment_id, uri if is_server(uri) else "http://127.0.0.1:5000")


def power_summary(audit: dict) -> list[str]:
    """One line per ε lower-bound method: its power (largest reportable bound) and whether it gates."""
    lines = []
    for name, entry in audit.get("power", {}).items():
        role = "gates" if entry["gating"] else "not counted: " + entry.get("note", "")
        lines.append(f"    power {name:<24} {entry['power']:.3f}  ({role})")
    return lines


def conformance_summary_lines(audit: dict) -> list[str]:
    """The conformance checks of the trainer against its certificate, one line each."""
    conformance = audit.get("conformance")
    if not conformance:
        return []
    if not conformance["ran"]:
        return [f"  conformance          not checked: {conformance['reason']}"]
    return [
        f"  conformance          {'PASSED' if c['passed'] else 'FAILED'} {c['line']}" for c in conformance["checks"]
    ]


def lineage_text(entry: dict[str, Any], budget: float) -> str:
    """``dpml ledger``'s view of one lineage: versions, spends, people by ε, the largest."""
    versions = entry["dataset_versions"]
    lines = [
        f"lineage {entry['lineage']}: {len(versions)} data version(s), {entry['private_spends']} DP runs, "
        f"{entry['nonprivate_runs']} non-private"
        + (
            f", {entry['cancelled_spends']} cancelled before training (not counted)"
            if entry["cancelled_spends"]
            else ""
        ),
        f"  largest unit ε = {format_epsilon(entry['epsilon_total'])} at δ = {entry['delta']:g} "
        f"(budget {budget:g} per unit, "
        f"{max(budget - entry['epsilon_total'], 0):.4g} left for the most exposed); {entry['units']:,} units",
    ]
    if entry["unit_epsilon"]:
        levels = entry["unit_epsilon"]
        shown = "  ".join(f"ε {format_epsilon(eps)}: {count:,}" for eps, count in levels[:12])
        lines.append(f"  units by ε   {shown}" + (f"  … {len(levels) - 12} more levels" if len(levels) > 12 else ""))
    if entry["unknown_unit_spends"]:
        lines.append(
            "  spends with unknown units (charged to every unit): "
            + ", ".join(f"#{i}" for i in entry["unknown_unit_spends"])
        )
    if entry.get("filter_order"):
        lines.append(
            f"  individual Rényi filter at order α* = {entry['filter_order']:g} (ledger.on_exhausted: exclude)"
        )
    lines += people_lines(entry)
    for spend in entry["spends"]:
        alone = "non-private" if not spend["private"] else f"ε alone {format_epsilon(spend['epsilon_alone'])}"
        units = "" if spend["units"] is None else f"{spend['units']:,} units"
        counted = "" if spend["counted"] else "  (not counted)"
        lines.append(
            f"  #{spend['id']:<4} {alone:<18} {units:<14} {spend['label']}  "
            f"[{', '.join(spend['events']) or 'reserved'}]  data {spend['dataset_version'][:12]}{counted}"
        )
    return "\n".join(lines)


PEOPLE_SHOWN = 10  # groups of people listed per lineage (``--json`` has them all)


def _releases(releases: list[dict[str, Any]]) -> str:
    return ", ".join(f"#{r['spend']} {r['lineage']}" for r in releases) or "none"


def people_lines(entry: dict[str, Any]) -> list[str]:
    """The lineage's people grouped by every release that touched them, across lineages, largest ε first;
    and a warning line when other lineages hold some of the same people (a ledger written before one
    person had one account: merge them with ``dpml ledger rename``)."""
    people = entry.get("people") or []
    lines = []
    if entry.get("shared_with"):
        shared = ", ".join(f"{name!r} ({count:,})" for name, count in entry["shared_with"].items())
        lines.append(
            f"  the same people are also under lineage {shared}: each person's ε above composes the releases "
            "of every lineage; make them one account with dpml ledger rename OTHER "
            f"{entry['lineage']} --merge"
        )
    if people:
        lines.append("  people by the releases that touched them (any lineage):")
    for group in people[:PEOPLE_SHOWN]:
        lines.append(f"    {group['units']:>10,} units  ε {group['epsilon']:<8.4g} {_releases(group['releases'])}")
    if len(people) > PEOPLE_SHOWN:
        lines.append(f"    … {len(people) - PEOPLE_SHOWN} more groups (dpml ledger --json)")
    return lines


def person_text(person: str, found: dict[str, Any] | None) -> str:
    """``dpml ledger --person ID``: the releases that touched one person, across lineages, and their ε."""
    if found is None:
        return f"person {person!r}: no release has touched them (the ledger has never charged this id)"
    lines = [
        f"person {person!r}: ε = {format_epsilon(found['epsilon'])} at δ = {found['delta']:g} "
        f"over {len(found['releases'])} "
        f"release(s), lineage(s) {', '.join(found['lineages'])}"
    ]
    for release in found["releases"]:
        counted = "" if release["counted"] else "  (cancelled: not counted)"
        lines.append(
            f"  #{release['spend']:<4} {release['lineage']:<20} ε alone {format_epsilon(release['epsilon_alone'])}  "
            f"{release['label']}{counted}"
        )
    return "\n".join(lines)


def ledger_rename_text(moved: dict[str, Any], budget: float) -> str:
    """What ``dpml ledger rename`` did, in one line."""
    how = "merged into" if moved["merged"] else "renamed to"
    shared = f"; {moved['shared_units']:,} people were in both, now one account" if moved["merged"] else ""
    return (
        f"lineage {moved['old']!r} {how} {moved['new']!r}: {moved['spends']} spend(s) moved, their history kept "
        f"(event lineage_renamed){shared}; largest unit ε of {moved['new']!r} = "
        f"{format_epsilon(moved['epsilon_total'])} (budget {budget:g})"
    )
