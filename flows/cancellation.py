"""Prefect cancellation of a flow run that no worker supervises (``dpml run`` calls the flow in its own process).

Prefect 3 cancels a flow run by setting it ``Cancelling``; the process worker (or runner) that started the
flow's process sees that and stops the process. ``dpml run`` starts the flow itself: nothing watches, so
Prefect's cancellation was ignored — the run went on to register a champion and stayed ``Cancelling``.

:class:`CancellationWatch` is that watcher, inside the run: a thread reads the flow run's state every
:data:`POLL_S` seconds and, once it is ``Cancelling`` (or ``Cancelled``), asks the run to stop through
:class:`dpml.interrupts.StopRequests`. The run stops at its next safe point — anywhere inside a stage
before registration (training included) or while waiting for the audit's reference models — settles its
ledger spend and ends ``Cancelled`` (``flows/pipeline.py``). A cancellation that arrives once
registration has begun is too late: the release completes, and the flow says so in its log.

Under a Prefect worker the watcher runs as well; whichever acts first, the flow run ends ``Cancelled``.
"""

from __future__ import annotations

import contextvars
import threading
from types import TracebackType
from uuid import UUID

from dpml.interrupts import StopRequests

POLL_S = 1.0
"""How often the flow run's state is read: a cancellation is noticed within about a second."""


class CancellationWatch:
    """``with CancellationWatch(flow_run_id, name, stops):`` — watch the flow run while inside the block."""

    def __init__(self, flow_run_id: UUID, name: str, stops: StopRequests, poll_s: float = POLL_S) -> None:
        self.flow_run_id, self.name, self.stops, self.poll_s = flow_run_id, name, stops, poll_s
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> CancellationWatch:
        # The thread runs in a copy of this context: Prefect's scoped settings (the run's API URL) go with it.
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._watch,), name="dpml-cancellation-watch", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_s + 5)

    def _watch(self) -> None:
        from prefect import get_client

        with get_client(sync_client=True) as client:
            while not self._done.wait(self.poll_s):
                try:
                    state = client.read_flow_run(self.flow_run_id).state
                except Exception:  # noqa: BLE001 - the API may blink; the next poll tries again
                    continue
                if state is not None and (state.is_cancelling() or state.is_cancelled()):
                    self.stops.request(f"the Prefect flow run {self.name!r} was cancelled")
                    return
