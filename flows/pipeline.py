"""The privacy-audited pipeline as a Prefect flow.

ingest → split → preprocess → train → certify → [reference models, in parallel] → audit → gate
→ register, then ``dvc commit`` so DVC's lock file matches what this run produced (when it ran
``params.yaml`` unchanged). Runs on the Prefect API that ``dpml run`` resolved (``flows/prefect_api.py``:
``--prefect-api``, else ``PREFECT_API_URL``, else a temporary server), or, under a Prefect worker, on the
API of that worker; the scheduled deployment is declared in ``prefect.yaml``.

**Where it reports.** The flow reads the API it runs against from its own client, once, logs it with
the run, returns it for the summary, and hands it to its Dask workers explicitly (the nanny's ``env``):
nothing here reads or writes ``os.environ``.

**The reference models** are independent: a subflow fans them out over a Dask task runner (a local
cluster of ``audit.workers`` processes that the flow run starts and closes, or the scheduler at
``audit.dask_address``; ``flows/dask_cluster.py``). Models already stored for the same data, split and
configuration are reused, not retrained. With ``train.world_size > 1`` each reference model trains on
that many processes, like the release: the local cluster's workers are then started non-daemonic, so
that they may start processes (each distributed training has a rendezvous port of its own,
:func:`dpml.train.distributed.spawn`); an external cluster is asked in pre-flight whether its workers
can, and the run is refused before any spend, naming both settings, if not.

**Stopping** (``flows/cancellation.py``, :mod:`dpml.interrupts`): a Prefect cancellation stops the run at
its next safe point before registration — inside any stage, training included, or while waiting for the
reference models — and the flow run ends ``Cancelled``; Ctrl-C and SIGTERM stop it at once (the flow run
ends ``Crashed``). Either way the flow settles the ledger spend (:mod:`dpml.stages.stopped`), logs one line
saying what was spent, and its Dask workers are killed, with whatever they started, on the way out.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from prefect import flow, get_run_logger, unmapped
from prefect.artifacts import create_markdown_artifact
from prefect.context import FlowRunContext
from prefect.exceptions import CancelledRun, TerminationSignal
from prefect.futures import as_completed
from prefect.states import Cancelled as CancelledState
from prefect.states import State
from prefect_dask import DaskTaskRunner

from dpml.cli_text import run_summary
from dpml.config import Config, ConfigBase, absolute_paths, check_tunable, load
from dpml.interrupts import Cancelled, RunStopped, StopRequests, note_spent, stop_reason, stoppable
from dpml.preflight import preflight
from dpml.stages import outputs_locked
from dpml.progress import progress_over
from dpml.stages.records import driven_by
from dpml.stages.stopped import SpendNote, settle_stopped_run, spend_note
from flows.cancellation import CancellationWatch
from flows.dask_cluster import check_dask_workers, reference_cluster
from flows.prefect_api import prefect_api
from tasks import stages as t

RELEASE_ARTIFACT = "dpml-release"
"""Key of the markdown artifact each flow run leaves with its release summary."""

STOPS = (RunStopped, KeyboardInterrupt, TerminationSignal, CancelledRun)
"""What stops a run from outside: dpml's requests and SIGTERM, Ctrl-C, Prefect's SIGTERM bridge, and a
cancelled subflow."""


@flow(name="train-reference-models", log_prints=True)
def train_reference_models(config: ConfigBase, jobs: list[tuple[str, bool, float | None, int]]) -> Any:
    # ConfigBase, not Config: Prefect validates a flow's arguments against the annotation, and a trainer
    # registered at run time (a plugin) rebuilds Config, so an older Config class would refuse them.
    futures = t.train_reference.map(config=unmapped(config), job=jobs)
    try:
        with stoppable():  # a cancellation wakes the wait; the flow then kills the workers (flows/dask_cluster.py)
            for _ in progress_over(as_completed(futures), len(futures), "audit reference models", "model"):
                pass  # each model's completion advances the progress in this subflow's log
    except Cancelled as stop:
        return CancelledState(message=stop.reason)
    return [future.result() for future in futures]


def release_markdown(results: dict[str, Any]) -> str:
    """The flow run's ``dpml-release`` artifact: the release gate's verdict, then the run summary."""
    gate, release = results["gate"], results["register"]
    verdict = gate["verdict"]["title"]
    return (
        f"# dpml release: gate {verdict}\n\n`{release['model_uri']}`"
        + (" (alias `champion`)" if release["champion"] else "")
        + f"\n\n```\n{run_summary(results).strip()}\n```\n"
    )


class _Run:
    """One flow run's stages in order, with the safe points between them and the stage now running."""

    def __init__(self, config: Config, stops: StopRequests, api_url: str) -> None:
        self.config, self.stops, self.api_url = config, stops, api_url
        self.stage: str | None = None

    def step(self, name: str, task: Callable[..., Any], *args: Any) -> Any:
        """A safe point, then the stage (stoppable inside: ``tasks/stages.py``)."""
        self.stops.checkpoint()
        self.stage = name
        return task(*args)

    def reference_models(self, jobs: list[tuple[str, bool, float | None, int]]) -> Any:
        self.stops.checkpoint()
        self.stage = "audit"
        with reference_cluster(self.config.audit, self.api_url, self.config.train.world_size) as address:
            runner = train_reference_models.with_options(task_runner=DaskTaskRunner(address=address))
            return runner(self.config, jobs)

    def certify_audit_release(self, results: dict[str, Any]) -> dict[str, Any]:
        config = self.config
        results["certify"] = self.step("certify", t.certify, config)
        jobs = t.reference_jobs(config)
        if jobs:
            results["references"] = self.reference_models(jobs)
        results["audit"] = self.step("audit", t.audit, config)
        results["gate"] = self.step("gate", t.gate, config)
        self.stops.checkpoint()  # the last safe point: registration runs to its end
        self.stage = "register"
        results["register"] = t.register(config)
        if self.stops.requested:
            get_run_logger().warning(
                "%s during registration: too late to stop, the release was completed", self.stops.requested
            )
        create_markdown_artifact(
            key=RELEASE_ARTIFACT,
            markdown=release_markdown(results),
            description="dpml release summary: accuracy, certified ε, audit, gate, model version",
        )
        return results


def this_runs_api() -> tuple[str, dict[str, str]]:
    """The Prefect API this flow run reports to (its own client's), and the run's identity for the summary."""
    from prefect import get_client

    context = FlowRunContext.get()
    client = context.client if context is not None and context.client is not None else get_client(sync_client=True)
    url = str(client.api_url).rstrip("/")
    run = context.flow_run if context is not None else None
    return url, {"api_url": url, "flow_run_id": str(run.id) if run else "", "flow_run_name": run.name if run else ""}


def _stopped(
    config: Config, run: _Run | None, spend_before: SpendNote | None, stops: StopRequests, stop: BaseException
) -> State:
    """Settle and report a stopped run: a cancellation ends the flow run ``Cancelled`` (returned); Ctrl-C and
    SIGTERM go on up, carrying the line (:func:`dpml.interrupts.note_spent`)."""
    cancelled = isinstance(stop, (Cancelled, CancelledRun))
    if stops.requested:  # the watcher saw the cancellation (under a worker, Prefect's SIGTERM may act first)
        reason = stops.requested
    elif isinstance(stop, TerminationSignal):
        reason = "terminated (SIGTERM)"
    else:
        reason = stop_reason(stop)
    line = settle_stopped_run(config, spend_before, reason, run.stage if run else None)
    get_run_logger().warning("%s", line)
    if cancelled:
        return CancelledState(message=line)
    note_spent(stop, line)
    raise stop


def _pipeline(config: Config, body: Callable[[_Run], dict[str, Any]], search: bool = False) -> Any:
    """The run's turn in its checkout's output folders (:mod:`dpml.stages.checkout_lock`), pre-flight, then
    ``body``, all watched for cancellation; a stop from outside is settled (:func:`_stopped`)."""
    api_url, identity = this_runs_api()
    get_run_logger().info("Prefect API: %s (flow run %s)", api_url, identity["flow_run_name"])
    if search:
        check_tunable(config)  # before any work
    run: _Run | None = None
    spend_before: SpendNote | None = None
    with StopRequests() as stops, ExitStack() as turn:
        try:
            with CancellationWatch(FlowRunContext.get().flow_run.id, identity["flow_run_name"], stops):
                with stops.stoppable():  # waiting for another run in these folders: a cancellation ends the wait
                    turn.enter_context(outputs_locked(config, "dpml tune" if search else "dpml run"))
                preflight(config)  # before any work: device, noise seed, writable folders, MLflow store, ledger
                check_dask_workers(config)
                spend_before = spend_note(config)
                run = _Run(config, stops, api_url)
                with driven_by({"prefect.api_url": api_url, "prefect.flow_run_id": identity["flow_run_id"]}):
                    results = body(run)  # the release's MLflow run is tagged with this flow run
        except STOPS as stop:
            return _stopped(config, run, spend_before, stops, stop)
    results["prefect"] = identity
    return results


@flow(name="privacy_audited_pipeline", log_prints=True)
def privacy_audited_pipeline(params_path: str = "params.yaml", overrides: list[str] | None = None) -> Any:
    """Run every stage for the configuration in ``params_path`` (plus ``overrides``)."""
    config = absolute_paths(load(params_path, overrides or []))
    record = not overrides and params_path == "params.yaml"

    def body(run: _Run) -> dict[str, Any]:
        results = {name: run.step(name, getattr(t, name), config) for name in ("ingest", "split", "preprocess")}
        results["train"] = run.step("train", t.train, config)
        results = run.certify_audit_release(results)
        if record:
            results["dvc"] = t.record_in_dvc()
        return results

    return _pipeline(config, body)


@flow(name="private_hyperparameter_search", log_prints=True)
def private_hyperparameter_search(params_path: str = "params.yaml", overrides: list[str] | None = None) -> Any:
    """``dpml tune``: the pipeline with a private search (``tune`` section) in place of one training run.

    The released model is the best candidate; its certificate and the ledger charge the whole
    search. DVC is not updated: ``dvc.yaml`` describes the single-run pipeline.
    """
    config = absolute_paths(load(params_path, overrides or []))

    def body(run: _Run) -> dict[str, Any]:
        results = {name: run.step(name, getattr(t, name), config) for name in ("ingest", "split", "preprocess")}
        results["train"] = run.step("tune", t.tune, config)
        return run.certify_audit_release(results)

    return _pipeline(config, body, search=True)


def run_from_cli(
    params_path: str, overrides: list[str], search: bool = False, api_flag: str | None = None
) -> dict[str, Any]:
    """``dpml run`` / ``dpml tune`` on the Prefect engine: resolve the Prefect API once (``--prefect-api`` >
    ``PREFECT_API_URL`` > a temporary server, :func:`flows.prefect_api.prefect_api`), run the flow on it, and
    stop the temporary server afterwards whatever happened. A cancelled flow run raises
    :class:`dpml.interrupts.Cancelled` carrying the flow's line about what was spent."""
    with prefect_api(api_flag) as api:
        pipeline = private_hyperparameter_search if search else privacy_audited_pipeline
        try:
            results = pipeline(params_path=params_path, overrides=overrides)
        except CancelledRun as cancelled:
            stop = Cancelled(str(cancelled))
            note_spent(stop, str(cancelled))
            raise stop from None
    results["prefect"]["origin"] = api.origin
    return results


if __name__ == "__main__":
    run_from_cli("params.yaml", [])
