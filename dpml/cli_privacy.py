"""The ``dpml`` commands about privacy arithmetic and the ledger: ``calibrate``, ``epsilon``,
``certificate`` (of a release or a run) and ``ledger`` (per lineage, per person, rename)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from dpml.cli_text import ledger_rename_text, lineage_text, person_text
from dpml.config import ConfigError, load
from dpml.data.units import digests_of_ids
from dpml.formatting import format_epsilon


def cmd_calibrate(args: argparse.Namespace) -> int:
    from dpml.accounting.calibrate import calibrate_noise_multiplier, calibrate_steps  # lazy: per command

    if (args.steps is None) == (args.noise_multiplier is None):
        raise ValueError("give exactly one of --steps (to calibrate σ) and --noise-multiplier (to calibrate steps)")
    if args.steps is not None:
        sigma = calibrate_noise_multiplier(
            args.target_epsilon, args.sample_rate, args.steps, args.delta, args.neighbouring
        )
        result = {"noise_multiplier": sigma, "steps": args.steps}
        text = f"noise multiplier σ = {sigma:.6g} for {args.steps} steps"
    else:
        steps = calibrate_steps(
            args.target_epsilon, args.sample_rate, args.noise_multiplier, args.delta, args.neighbouring
        )
        result = {"noise_multiplier": args.noise_multiplier, "steps": steps}
        text = f"at most {steps} steps with σ = {args.noise_multiplier:g}"
    result |= {
        "target_epsilon": args.target_epsilon,
        "sample_rate": args.sample_rate,
        "delta": args.delta,
        "neighbouring": args.neighbouring,
    }
    print(
        json.dumps(result, indent=2)
        if args.json
        else f"{text} keep ε ≤ {args.target_epsilon:g} at δ = {args.delta:g} "
        f"(q = {args.sample_rate:g}, {args.neighbouring})"
    )
    return 0


def cmd_ledger(args: argparse.Namespace) -> int:
    """``dpml ledger``: the view (per lineage, and per person); ``dpml ledger rename OLD NEW [--merge]``."""
    from dpml.stages.train import open_ledger  # lazy: per command

    if args.action:
        return cmd_ledger_rename(args)
    config = load(args.params, args.set)
    if args.person is not None:
        return _ledger_person(open_ledger(config), args.person, args.json)
    summary = open_ledger(config).summary(args.dataset)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    if not summary:
        print(
            f"{open_ledger(config).location}: no spends recorded"
            + (f" for lineage {args.dataset!r}" if args.dataset else "")
        )
    budget = config.ledger.epsilon_budget
    for entry in summary:
        print(lineage_text(entry, budget))
    return 0


def cmd_ledger_rename(args: argparse.Namespace) -> int:
    """Rename a lineage keeping its history, or merge it into another (``--merge``): an explicit ledger
    operation, one transaction (:meth:`dpml.ledger.ledger.Ledger.rename_lineage`)."""
    from dpml.stages.train import open_ledger  # lazy: per command

    if len(args.action) != 3 or args.action[0] != "rename":
        raise ConfigError(
            f"ledger {' '.join(args.action)!r}: the one ledger operation is: dpml ledger rename OLD NEW [--merge]"
        )
    _, old, new = args.action
    config = load(args.params, args.set)
    moved = open_ledger(config).rename_lineage(old, new, merge=args.merge)
    if args.json:
        print(json.dumps(moved, indent=2))
        return 0
    print(ledger_rename_text(moved, config.ledger.epsilon_budget))
    return 0


def _ledger_person(ledger: Any, person: str, as_json: bool) -> int:
    """``dpml ledger --person ID``: every release that touched the person of that id (data.id_column)."""
    found = ledger.person(digests_of_ids([person]))
    if as_json:
        print(json.dumps({"person": person, **(found or {"lineages": [], "epsilon": 0.0, "releases": []})}, indent=2))
    else:
        print(person_text(person, found))
    return 0


def cmd_certificate(args: argparse.Namespace) -> int:
    """Recompute a logged run's certificate from its logged mechanism description."""
    from dpml.accounting.accountants import certify  # lazy: per command
    from dpml.accounting.mechanism import MechanismDescription  # lazy: per command
    from dpml.tracking.registered import load_run_json  # lazy: per command

    config = load(args.params, args.set)
    run_id = args.run
    if args.model is not None:
        from dpml.tracking.registered import find_version  # lazy: per command

        run_id = find_version(args.model, config.tracking)["run_id"]
    logged = load_run_json(config.tracking, run_id, "certificate.json")
    run_config = load_run_json(config.tracking, run_id, "config.json")
    if not logged:
        print(f"{args.model or 'run ' + run_id} trained without differential privacy: no certificate")
        return 0
    fresh = certify(MechanismDescription.from_dict(logged["mechanism"]), float(run_config["dp"]["delta"]))
    same = abs(fresh["epsilon"] - logged["epsilon"]) <= 1e-9 * max(1.0, logged["epsilon"])
    if args.json:
        print(json.dumps({"logged": logged, "recomputed": fresh, "match": same}, indent=2))
    else:
        print(f"logged:     {logged['statement']}")
        print(f"recomputed: {fresh['statement']}")
        for answer in fresh["answers"]:
            value = format_epsilon(answer["epsilon"]) if answer["epsilon"] is not None else f"n/a ({answer['error']})"
            print(f"  {answer['name']:<20} {answer['version']:<10} {value}")
        print("match" if same else "MISMATCH: the logged certificate does not follow from the logged mechanism")
    return 0 if same else 3


def cmd_epsilon(args: argparse.Namespace) -> int:
    from dpml.accounting.accountants import certify  # lazy: per command
    from dpml.accounting.mechanism import MechanismDescription, PoissonGaussianSteps  # lazy: per command

    mechanism = MechanismDescription(
        trainer="cli",
        events=(PoissonGaussianSteps(args.sample_rate, args.noise_multiplier, args.steps),),
        neighbouring=args.neighbouring,
        clip_norm=1.0,
        dataset_size=0,
    )
    certificate = certify(mechanism, args.delta)
    if args.json:
        print(
            json.dumps(
                {
                    k: certificate[k]
                    for k in (
                        "epsilon",
                        "delta",
                        "accountant",
                        "accountant_version",
                        "neighbouring",
                        "statement",
                        "answers",
                    )
                },
                indent=2,
            )
        )
    else:
        print(
            f"epsilon = {format_epsilon(certificate['epsilon'])} at delta = {args.delta:g} "
            f"({certificate['accountant']})"
        )
        for answer in certificate["answers"]:
            value = format_epsilon(answer["epsilon"]) if answer["epsilon"] is not None else f"n/a ({answer['error']})"
            print(f"  {answer['name']:<20} {value}")
    return 0
