"""MLflow as the review desk: one parent run per pipeline run with its headline numbers, a nested run per
stage, the training data set, a described model version; checked in the store and in a real browser
(headless Chromium against ``mlflow ui``), with ε written the same way in the summary, the report and MLflow."""

from __future__ import annotations

import html
import os
import re
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
from mlflow import MlflowClient

from dpml.config import load
from dpml.formatting import format_epsilon, format_lower_bound, format_score
from dpml.train.registry import TRAINERS
from tests.browser import GRID_CELLS, chromium, evaluate_in_page
from tests.conftest import serving_mlflow, small_params, write_params

STAGES = ["ingest", "split", "preprocess", "train", "certify", "audit", "gate", "register"]


def rendered_text(url: str, profile: Path, expected: list[str]) -> str:
    """The visible text of ``url`` once the single-page app has rendered it, as headless Chromium sees it;
    waits longer (up to three times) while any of ``expected`` is missing."""
    text = ""
    for budget in (15_000, 30_000, 60_000):
        done = subprocess.run(
            [
                chromium(),
                "--headless",
                "--disable-gpu",
                "--no-sandbox",
                "--window-size=2400,1400",
                f"--user-data-dir={profile}",
                f"--virtual-time-budget={budget}",
                "--dump-dom",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )
        dom = re.sub(r"<script.*?</script>|<style.*?</style>", " ", done.stdout, flags=re.S)
        text = re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", dom)))
        if all(e in text for e in expected):
            break
    return text


@pytest.fixture(scope="module")
def released(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One small pipeline run (``dpml run --engine local``'s path) into a SQLite store."""
    from dpml.stages import run_all

    workdir = tmp_path_factory.mktemp("review-desk")
    before, here = os.environ.get("MLFLOW_TRACKING_URI"), Path.cwd()
    config = load(write_params(workdir / "run.yaml", small_params(workdir, gate={"epsilon_budget": 50.0})))
    os.chdir(workdir)  # like the workdir fixture: nothing is written into the checkout
    try:
        results = run_all(config, echo=lambda _: None)
    finally:
        os.chdir(here)
        if before is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
    return {
        "workdir": workdir,
        "config": config,
        "results": results,
        "client": MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}"),
    }


@pytest.fixture(scope="module")
def ui(released: dict[str, Any]) -> Iterator[str]:
    """``mlflow ui`` on the run's store, on 127.0.0.1 and a free port."""
    workdir = released["workdir"]
    with serving_mlflow(
        "ui", ["--backend-store-uri", f"sqlite:///{workdir / 'mlflow.db'}"], workdir, workdir / "ui.log"
    ) as url:
        yield url


@pytest.mark.slow
def test_one_parent_run_with_a_nested_run_per_stage(released: dict[str, Any]) -> None:
    client, results = released["client"], released["results"]
    epsilon = format_epsilon(results["certify"]["epsilon"])
    experiment = client.get_experiment_by_name("dpml-test")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    [version] = client.search_model_versions("name='dpml-test-model'")
    parent = client.get_run(version.run_id)
    assert parent.info.run_name == f"digits · dpsgd · ε={epsilon}"
    assert parent.data.tags["dp.epsilon"] == version.tags["dp.epsilon"] == epsilon
    assert "ledger.spend_id" in parent.data.tags and not {"dpml.pid", "dpml.host"} & set(
        parent.data.tags
    )  # in the ledger
    headline = parent.data.metrics
    # The headline as the summary writes it (dpml.formatting): ε rounded up, the lower bound down, the accuracy to
    # four digits; the exact numbers on the stage runs below.
    assert headline["epsilon"] == float(epsilon) >= results["certify"]["epsilon"] and headline["gate.passed"] == 1.0
    assert headline["test_accuracy"] == float(format_score(results["train"]["test_accuracy"]))
    assert headline["delta"] == 1e-5
    assert headline["audit.max_epsilon_lower_bound"] == float(format_lower_bound(results["audit"]["max_lower_bound"]))
    assert headline["audit.max_epsilon_lower_bound"] <= results["audit"]["max_lower_bound"]
    children = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    by_stage = {run.info.run_name: run for run in children}
    assert sorted(by_stage) == sorted(STAGES) and all(run.info.status == "FINISHED" for run in children)
    order = sorted(children, key=lambda run: run.info.start_time)
    assert [run.info.run_name for run in order] == STAGES  # each stage's own start time
    assert parent.info.start_time == by_stage["ingest"].info.start_time  # the parent spans the pipeline
    train = by_stage["train"]
    assert train.info.end_time - train.info.start_time > 100  # training took its time, recorded by the stage
    assert train.data.params["dp.noise_multiplier"] == "1.0" and not any(
        k.startswith("audit.") for k in train.data.params
    )
    assert train.data.metrics["test_accuracy"] == results["train"]["test_accuracy"]
    assert by_stage["certify"].data.metrics["epsilon"] == results["certify"]["epsilon"]
    # The audit's detail (every attack, bound, power and check) on its own stage run; the parent stays a headline.
    detail = {k for k in by_stage["audit"].data.metrics if k.startswith(("audit.target.", "audit.conformance."))}
    assert detail and not detail & set(headline) and len(headline) < 20, sorted(headline)
    for run in [parent, *children]:
        assert "None" not in run.data.params.values(), run.info.run_name
    [logged] = parent.inputs.dataset_inputs
    version_of_data = results["ingest"]["version"]
    assert logged.dataset.name == "digits" and logged.dataset.digest == version_of_data[:36]
    assert version_of_data in logged.dataset.source and "sklearn:digits" in logged.dataset.source
    assert {(t.key, t.value) for t in logged.tags} == {("mlflow.data.context", "training")}
    assert f"certified ε = {epsilon}** at δ = 1e-05" in version.description
    assert "release gate: PASSED" in version.description and "accountant dp_accounting.pld" in version.description
    # The run page: the version's description, and the settings of the trainer that ran, none of the others'
    assert parent.data.tags["mlflow.note.content"] == version.description
    others = {name for t in TRAINERS.values() if t.name != "dpsgd" for name in t.sections}
    assert others and not [k for k in parent.data.params if k.split(".", 1)[0] in others]
    assert parent.data.params["train.algorithm"] == "dpsgd" and parent.data.params["dp.noise_multiplier"] == "1.0"


@pytest.mark.slow
def test_epsilon_is_written_alike_in_the_summary_the_report_and_mlflow(released: dict[str, Any]) -> None:
    from dpml.cli_text import run_summary
    from dpml.stages import Layout

    results = released["results"]
    epsilon = format_epsilon(results["certify"]["epsilon"])
    summary = run_summary(results)
    assert f"certified epsilon    {epsilon} at delta = 1e-05" in summary and f"(certified {epsilon});" in summary
    assert len(summary.strip().splitlines()) <= 15  # one screen (lines naming this test's long folders aside)
    assert "viewStateShareKey=dpml-review" in summary
    report = Layout(released["config"]).report.read_text()
    assert f"({epsilon}, 1e-05)-DP" in report and f"| {epsilon} | yes |" in report


@pytest.mark.slow
def test_a_browser_shows_epsilon_and_the_gate_on_the_experiment_and_the_version(
    released: dict[str, Any], ui: str, tmp_path: Path
) -> None:
    if chromium() is None:
        pytest.skip(
            "no Chromium on this machine (scripts/test.sh installs Debian's chromium when run as root): "
            "the MLflow UI was not checked in a browser"
        )
    from dpml.tracking.review_view import review_url

    epsilon = format_epsilon(released["results"]["certify"]["epsilon"])
    run_name = f"digits · dpsgd · ε={epsilon}"
    experiment_id = released["client"].get_experiment_by_name("dpml-test").experiment_id
    runs = rendered_text(review_url(experiment_id, ui), tmp_path / "profile", [run_name, "within budget"])
    assert "Training runs" in runs  # the model-development tabs: absent for an experiment without the kind tag
    version = rendered_text(f"{ui}/#/models/dpml-test-model/versions/1", tmp_path / "profile", ["release gate: PASSED"])
    assert f"certified ε = {epsilon} at δ = 1e-05" in version and "release gate: PASSED" in version, version[:3000]
    assert f"dp.epsilon {epsilon}" in version and "gate.passed true" in version
    verdict = released["results"]["gate"]["verdict"]
    assert verdict["title"] in version and f"verdict.attacks {verdict['attacks']['word']}" in version  # three parts


@pytest.mark.slow
def test_the_review_view_shows_what_a_reviewer_decides_from_inside_1600_pixels(
    released: dict[str, Any], ui: str
) -> None:
    """Opened at 1600 × 1000 in a real browser, the review view draws the run's certified ε, δ, accuracy, largest
    lower bound and the three parts of the verdict, each cell inside the window and showing the run's own value
    (a column off to the right is not drawn at all: the grid draws only what the window shows)."""
    if chromium() is None:
        pytest.skip(
            "no Chromium on this machine (scripts/test.sh installs Debian's chromium when run as root): "
            "the review view was not measured in a browser"
        )
    from dpml.tracking.review_view import REVIEW_COLUMNS, review_url

    client, results = released["client"], released["results"]
    experiment_id = client.get_experiment_by_name("dpml-test").experiment_id
    [version] = client.search_model_versions("name='dpml-test-model'")
    parent = client.get_run(version.run_id)
    cells = evaluate_in_page(
        review_url(experiment_id, ui),
        GRID_CELLS,
        lambda found: {c["column"] for c in found} >= set(REVIEW_COLUMNS),
        width=1600,
    )
    drawn = {c["column"]: c for c in cells}
    assert set(REVIEW_COLUMNS) <= set(drawn), sorted(drawn)
    assert [c for c in REVIEW_COLUMNS if not 0 <= drawn[c]["left"] < drawn[c]["right"] <= 1600] == []
    for column in REVIEW_COLUMNS:
        kind, name = column.split(".", 1)
        logged = (parent.data.metrics if kind == "metrics" else parent.data.tags)[name.strip("`")]
        shown = drawn[column]["text"]
        assert float(shown) == pytest.approx(logged, rel=1e-9) if kind == "metrics" else shown == logged, column
    verdict = results["gate"]["verdict"]
    assert drawn["tags.`verdict.certificate`"]["text"] == verdict["certificate"]["word"]
    assert parent.data.metrics["epsilon"] == float(format_epsilon(results["certify"]["epsilon"]))  # as written
    assert len(drawn["metrics.`epsilon`"]["text"]) <= 10 and len(drawn["metrics.`test_accuracy`"]["text"]) <= 6


@pytest.mark.slow
def test_the_release_card_is_one_self_contained_page_with_the_verdict_first(
    released: dict[str, Any], tmp_path: Path
) -> None:
    """The release card: logged with the version's run and written beside release.json, the same page; verdict
    first, ε in plain words, the release's identity, every attack's ROC against the DP limit, the conformance
    checks, the audit's power and the ledger — with nothing fetched from a network. A browser opening it
    from disk reads the verdict and ε."""
    from dpml.stages import Layout

    results = released["results"]
    layout = Layout(released["config"])
    card = layout.release_card.read_text()
    run_id, version = results["register"]["run_id"], results["register"]["model_version"]
    logged = released["client"].download_artifacts(run_id, "release_card.html", str(tmp_path))
    assert Path(logged).read_text() == card  # the same page in MLflow and on disk
    verdict, epsilon = results["gate"]["verdict"], format_epsilon(results["certify"]["epsilon"])
    assert re.search(r"<(script|link|img|iframe)\b|\bsrc=|@import|url\(", card) is None  # no external resource
    body = re.sub(r"<style.*?</style>", "", card, flags=re.S)
    assert body.index(f"Release gate: {verdict['title']}") < body.index("ε = ")  # the verdict comes first
    for fact in (
        f"models:/dpml-test-model/{version}",
        run_id,
        results["ingest"]["version"],
        "DP limit (ε = " + epsilon,
        *(verdict[part]["word"] for part in ("certificate", "implementation", "attacks")),
        *results["audit"]["target"]["attacks"],
        "the certificate covers the model, not this card's numbers",  # (the audit's figures come from the records)
    ):
        assert fact in card, fact
    assert card.count("<path") >= 2 + len(results["audit"]["target"]["attacks"])  # chance, DP limit, each attack
    if chromium() is None:
        pytest.skip(
            "no Chromium on this machine (scripts/test.sh installs Debian's chromium when run as root): "
            "the card was checked as HTML, not rendered"
        )
    text = rendered_text(layout.release_card.resolve().as_uri(), tmp_path / "profile", [verdict["title"]])
    assert f"Release gate: {verdict['title']}" in text and f"ε = {epsilon} at δ = 1e-05." in text
    assert text.index(verdict["title"]) < text.index("Attacks against the limit")
