"""The Dask cluster that trains the audit's reference models in parallel, owned by the flow run from start to end.

- **Where its workers report.** A local cluster's workers get this run's Prefect API in their nanny's
  ``env`` (explicitly: nothing reads or writes this process's ``os.environ`` for it).
- **Distributed training inside a worker.** Dask starts its local workers as daemonic processes, and a
  daemonic process may not start processes (``AssertionError: daemonic processes are not allowed to have
  children``). With ``train.world_size > 1`` the workers are started non-daemonic
  (``distributed.worker.daemon: false``, set only while the cluster starts them). They still end with
  this process: each exits when the pipe from its nanny closes (Dask's own watch), and their training
  processes end with them (:func:`dpml.interrupts.die_with_parent`). An external cluster
  (``audit.dask_address``) is asked in pre-flight whether its workers can (:func:`check_dask_workers`).
- **Stopping.** On a stop (Ctrl-C, SIGTERM, a cancellation) the busy workers are not asked to finish: each
  worker's process tree is frozen and killed, its nanny told not to restart it, and only then is the
  cluster closed — a scheduler closed under a busy worker makes it log its lost heartbeat, and a worker
  restarted during the shutdown fails to start, both with tracebacks, and the run ends in one line.
- **Closing after a run.** Each worker's heartbeat is stopped before the cluster closes: a heartbeat still
  in flight when the scheduler closes its connection makes the worker log "Failed to communicate with
  scheduler during heartbeat" with a traceback, an ERROR that means nothing once the work is done. Its
  other errors still reach the terminal.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dpml.config import AuditConfig, Config
from dpml.preflight import PreflightError

CLOSE_TIMEOUT_S = 20


@contextmanager
def workers_may_start_processes(needed: bool) -> Iterator[None]:
    """While inside, Dask starts its local workers non-daemonic (module docstring), when ``needed``."""
    if not needed:
        yield
        return
    import dask

    with dask.config.set({"distributed.worker.daemon": False}):
        yield


def _kill_tree(pid: int) -> None:
    """SIGSTOP ``pid`` (it starts nothing more), then SIGKILL its descendants and itself."""
    import psutil

    try:
        root = psutil.Process(pid)
        root.suspend()
        tree = [*root.children(recursive=True), root]
    except psutil.Error:
        return
    for process in tree:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(tree, timeout=5)


def _stop_heartbeat(dask_worker: Any) -> None:
    """Run inside a worker: it sends the scheduler no more heartbeats (the work is done; it closes next)."""
    dask_worker.periodic_callbacks["heartbeat"].stop()


def stop_heartbeats(address: str) -> None:
    """Stop the heartbeat of every worker of the scheduler at ``address`` (module docstring)."""
    from distributed import Client

    try:
        with Client(address, timeout=CLOSE_TIMEOUT_S) as client:
            client.run(_stop_heartbeat)
    except Exception:  # noqa: BLE001 - a worker that cannot be reached sends no heartbeat either; closing follows
        pass


def kill_workers(cluster: Any) -> None:
    """Kill every worker process of a local cluster (and what they started), and keep their nannies from
    restarting them."""
    from distributed.core import Status

    for nanny in list(cluster.workers.values()):
        nanny.status = Status.closing_gracefully  # a nanny in this state neither unregisters nor restarts its worker
        process = getattr(getattr(nanny, "process", None), "process", None)  # Nanny → WorkerProcess → AsyncProcess
        pid = getattr(process, "pid", None)
        if pid:
            _kill_tree(pid)


@contextmanager
def reference_cluster(audit: AuditConfig, api_url: str, world_size: int) -> Iterator[str]:
    """The scheduler address the reference models go to: ``audit.dask_address``, or a local cluster of
    ``audit.workers`` processes started here and closed on the way out (module docstring)."""
    if audit.dask_address:
        yield audit.dask_address
        return
    from distributed import LocalCluster

    with workers_may_start_processes(world_size > 1):
        cluster = LocalCluster(
            n_workers=audit.workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            env={"PREFECT_API_URL": api_url},
        )
    try:
        yield cluster.scheduler_address
    except BaseException:
        kill_workers(cluster)
        raise
    else:
        stop_heartbeats(cluster.scheduler_address)
    finally:
        try:
            cluster.close(timeout=CLOSE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - closing what is already dead may complain; nothing is left to stop
            pass


def _is_daemonic() -> bool:
    return bool(multiprocessing.current_process().daemon)


def check_dask_workers(config: Config) -> None:
    """Pre-flight for ``train.world_size > 1`` with ``audit.dask_address``: every worker of that cluster must
    be able to start the training processes of a reference model (not daemonic), or the run is refused
    before any spend, naming both settings."""
    address, world = config.audit.dask_address, config.train.world_size
    if world <= 1 or not address:
        return
    from distributed import Client

    settings = f"train.world_size = {world} with audit.dask_address = {address!r}"
    try:
        with Client(address, timeout="20s") as client:
            daemonic = sorted(worker for worker, flag in client.run(_is_daemonic).items() if flag)
    except OSError as error:
        raise PreflightError(f"{settings}: the Dask scheduler does not answer ({error})") from None
    if daemonic:
        raise PreflightError(
            f"{settings}: {len(daemonic)} worker(s) of that cluster are daemonic processes, which "
            f"cannot start the {world} training processes of each reference model; start them "
            "with distributed.worker.daemon: false, or set train.world_size: 1, or leave "
            "audit.dask_address unset (a local cluster)"
        )
