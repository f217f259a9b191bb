"""The privacy report: what was guaranteed, how it was computed, and what the audit found."""

from __future__ import annotations

from typing import Any


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "—" if value is None else str(value)


def render(*, data: dict[str, Any], train: dict[str, Any], certificate: dict[str, Any] | None,
           audit: dict[str, Any], gate: dict[str, Any]) -> str:
    """Markdown for MLflow and the Prefect UI; every number comes from the stage outputs."""
    lines = ["# dpml privacy report", ""]
    if certificate is None:
        lines += ["**No privacy guarantee**: this model was trained without differential privacy.", ""]
    else:
        lines += [f"**Guarantee.** {certificate['statement']}.", ""]
        lines += ["| accountant | version | ε | used for certificate | error |", "|---|---|---|---|---|"]
        for answer in certificate["answers"]:
            lines.append(
                f"| {answer['name']} | {answer['version']} | {_fmt(answer['epsilon'])} | "
                f"{'yes' if answer['used_for_certificate'] else 'cross-check'} | {answer['error'] or ''} |"
            )
        mech = certificate["mechanism"]
        lines += ["", "**Mechanism.**", ""]
        for event in mech["events"]:
            lines.append(
                f"- Poisson-subsampled Gaussian: rate q = {_fmt(event['sample_rate'])}, noise multiplier "
                f"σ = {_fmt(event['noise_multiplier'])}, {event['steps']} steps"
            )
        lines.append(f"- clip norm C = {_fmt(mech['clip_norm'])}, L2 sensitivity {_fmt(mech['sensitivity'])} "
                     f"under {mech['neighbouring']}; n = {mech['dataset_size']} training records")
        lines += [f"- {note}" for note in mech.get("notes", [])]
    lines += ["", "**Data.**", ""]
    lines.append(f"- source `{data['origin']}`, version (content SHA-256) `{data['version']}`")
    lines.append(f"- train / test / audit population: {data['n_train']} / {data['n_test']} / {data['n_audit']}")
    lines.append(f"- public scaling to [0, 1] with bounds [{_fmt(data['lower'])}, {_fmt(data['upper'])}]; "
                 f"input norm clipping to X0 = {_fmt(data['clip_norm'])} ({data['clip_mode']}): "
                 f"{100 * data['clipped_fraction_train']:.1f}% of training records changed")
    lines += ["", "**Utility.**", ""]
    lines.append(f"- test accuracy {_fmt(train['test_accuracy'])}, train accuracy {_fmt(train['train_accuracy'])}")
    lines += ["", "**Membership-inference audit** (members: training records; non-members: audit population).", ""]
    lines += ["| attack | AUC | TPR @ 1% FPR | TPR @ 0.1% FPR | advantage | members / non-members |",
              "|---|---|---|---|---|---|"]
    for name, result in audit["attacks"].items():
        lines.append(
            f"| {name} | {_fmt(result['auc'])} | {_fmt(result['tpr_at_1pct_fpr'])} | "
            f"{_fmt(result['tpr_at_0.1pct_fpr'])} | {_fmt(result['advantage'])} | "
            f"{result['members']} / {result['nonmembers']} |"
        )
    lines += ["", f"**Release gate: {'PASSED' if gate['passed'] else 'FAILED'}.**", ""]
    lines += [f"- {reason}" for reason in gate["reasons"]]
    return "\n".join(lines) + "\n"
