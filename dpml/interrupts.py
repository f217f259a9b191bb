"""Stopping a run from outside: Ctrl-C, SIGTERM and a cancellation request, promptly and cleanly.

A run can be asked to stop in three ways; each ends as an exception in the main thread, so every
``finally`` on the way out runs (the temporary Prefect server, the Dask cluster and the distributed
training processes are stopped there) and the CLI prints one line saying what was spent:

- **Ctrl-C** (SIGINT): Python's :class:`KeyboardInterrupt`, wherever the main thread is.
- **SIGTERM**: Python's default ends the process on the spot, with no cleanup, leaving its child
  processes behind; inside :func:`termination_raises` it raises :class:`Terminated` instead, wherever
  the main thread is (what a kill at that point leaves is already safe: see the documentation, Reliability).
- **A request from another thread** (a Prefect cancellation seen by the flow's watcher,
  ``flows/cancellation.py``): :class:`StopRequests` raises :class:`Cancelled` in the main thread only
  at safe points — at a :meth:`~StopRequests.checkpoint` (between stages) or anywhere inside a
  :meth:`~StopRequests.stoppable` region (a stage's body, the wait for the audit's reference models),
  never inside registration. A main thread blocked in a wait (a lock, ``select`` on child processes) is
  woken by :data:`WAKE_SIGNAL`, sent to it alone.

:func:`die_with_parent` makes a child process (the temporary Prefect server, a distributed training
process) end when the process that started it ends, even by SIGKILL, so no child outlives a run.

Exit statuses: 130 for Ctrl-C and for a cancellation, 143 (128 + 15) for SIGTERM.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

WAKE_SIGNAL = signal.SIGUSR1
"""Sent by :meth:`StopRequests.request` to the main thread, to wake it from a blocking wait."""

REDELIVERY_DELAY_S = 0.05
"""How long after a swallowed stop its signal is sent again (:func:`swallowed_stops_delivered_again`)."""


class RunStopped(BaseException):
    """The run was asked to stop from outside. A :class:`BaseException`, like :class:`KeyboardInterrupt`,
    so that no ``except Exception`` on the way out can swallow it."""

    exit_code = 130

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Cancelled(RunStopped):
    """A cancellation request (a Prefect flow run cancelled from its UI, CLI or API)."""


class Terminated(RunStopped):
    """SIGTERM (:func:`termination_raises`)."""

    exit_code = 128 + signal.SIGTERM


def stop_reason(stop: BaseException) -> str:
    """What stopped the run, in words: ``interrupted (Ctrl-C)``, ``terminated (SIGTERM)``, or the request's reason."""
    if isinstance(stop, RunStopped):
        return stop.reason
    if isinstance(stop, KeyboardInterrupt):
        return "interrupted (Ctrl-C)"
    return f"stopped ({type(stop).__name__})"


def exit_code(stop: BaseException) -> int:
    """The process's exit status after ``stop``: 130 (Ctrl-C, cancellation) or 143 (SIGTERM)."""
    return stop.exit_code if isinstance(stop, RunStopped) else 130


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated("terminated (SIGTERM)")


def _signal_of(stop: BaseException) -> int | None:
    """The signal that raised ``stop``, to deliver again: SIGINT, SIGTERM (dpml's or Prefect's
    ``TerminationSignal``, which carries its number) or :data:`WAKE_SIGNAL`; None for other exceptions."""
    if isinstance(stop, KeyboardInterrupt):
        return signal.SIGINT
    if isinstance(stop, Terminated):
        return signal.SIGTERM
    if isinstance(stop, Cancelled):
        return WAKE_SIGNAL
    number = getattr(stop, "signal", None)  # prefect.exceptions.TerminationSignal
    return number if isinstance(number, int) and not isinstance(stop, Exception) else None


@contextlib.contextmanager
def swallowed_stops_delivered_again() -> Iterator[None]:
    """A signal handler's exception raised while the main thread runs a garbage-collection callback or a
    ``__del__`` is swallowed by Python ("Exception ignored in …") and the run goes on as if the signal had
    never come (seen: SIGTERM landing in SQLAlchemy's weakref callback). While inside, such a stop is not
    printed but delivered again, as the same signal to the main thread, to be raised at the next ordinary
    point. Other unraisable exceptions go to the previous hook."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        number = _signal_of(unraisable.exc_value) if unraisable.exc_value is not None else None
        if number is None:
            previous(unraisable)
            return
        current = _CURRENT.get()
        if number == WAKE_SIGNAL:
            if current is None:
                return
            current._raised = False  # noqa: SLF001 - the raise did not happen: let the next wake raise

        def again() -> None:
            # SIGUSR1 with no handler would end the process: a wake goes only while its handler is in place.
            if number != WAKE_SIGNAL or (current is not None and current._installed):  # noqa: SLF001
                signal.pthread_kill(threading.main_thread().ident, number)  # type: ignore[arg-type]

        # From another thread, a moment later: sent from here, the handler would run inside this hook, still
        # inside the collection, and be swallowed again.
        threading.Timer(REDELIVERY_DELAY_S, again).start()

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


@contextlib.contextmanager
def termination_raises() -> Iterator[None]:
    """While inside, SIGTERM raises :class:`Terminated` in the main thread, and a stop swallowed by Python is
    delivered again (:func:`swallowed_stops_delivered_again`); outside the main thread this does nothing.
    The previous handler comes back on the way out.

    Prefect's flow engine puts its own SIGTERM handler in place while a flow runs and, when it fires, marks
    the flow run crashed and sends SIGTERM again to the handler it found — this one."""
    if not _in_main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        with swallowed_stops_delivered_again():
            yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM ignored while inside (the short clean-up after a stop: a second Ctrl-C must not cut
    it short and leave child processes behind); main thread only, else nothing."""
    if not _in_main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


class StopRequests:
    """Requests to stop the run, from any thread, honoured by the main thread at safe points.

    ``with StopRequests() as stops:`` (in the main thread) installs the wake-up handler; another thread
    calls :meth:`request`; the main thread raises :class:`Cancelled` at the next :meth:`checkpoint`, or at
    once when it is inside :meth:`stoppable`. Used from a thread other than the main one (a flow run in a
    worker thread), requests are honoured at checkpoints only.

    Why the two cannot miss each other: :meth:`stoppable` marks the region before it checks for a request,
    and :meth:`request` records the request before it looks for a region; so either the region's check
    sees the request, or the request sees the region and wakes the main thread.
    """

    def __init__(self) -> None:
        self._reason: str | None = None
        self._depth = 0
        self._raised = False
        self._installed = False
        self._previous: object = None
        self._token: contextvars.Token[StopRequests | None] | None = None
        self._hook: contextlib.AbstractContextManager[None] = contextlib.nullcontext()

    def __enter__(self) -> StopRequests:
        if _in_main_thread():
            self._previous = signal.signal(WAKE_SIGNAL, self._on_wake)
            self._installed = True
            self._hook = swallowed_stops_delivered_again()
            self._hook.__enter__()
        self._token = _CURRENT.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _CURRENT.reset(self._token)
        if self._installed:
            self._hook.__exit__(None, None, None)
            signal.signal(WAKE_SIGNAL, self._previous)  # type: ignore[arg-type]
            self._installed = False

    @property
    def requested(self) -> str | None:
        """The reason of the first request, or None."""
        return self._reason

    def request(self, reason: str) -> None:
        """Ask the run to stop (any thread); the first reason is kept."""
        if self._reason is None:
            self._reason = reason
        if self._installed and self._depth > 0:
            signal.pthread_kill(threading.main_thread().ident, WAKE_SIGNAL)  # type: ignore[arg-type]

    def checkpoint(self) -> None:
        """A safe point: raise :class:`Cancelled` if a stop was requested."""
        if self._reason is not None:
            self._raised = True
            raise Cancelled(self._reason)

    @contextlib.contextmanager
    def stoppable(self) -> Iterator[None]:
        """A region the main thread may be stopped anywhere in (a stage's body, a wait)."""
        if not (self._installed and _in_main_thread()):
            self.checkpoint()
            yield
            return
        self._depth += 1
        try:
            self.checkpoint()
            yield
        finally:
            self._depth -= 1

    def _on_wake(self, signum: int, frame: FrameType | None) -> None:
        if self._depth > 0 and self._reason is not None and not self._raised:
            self._raised = True
            raise Cancelled(self._reason)


_CURRENT: contextvars.ContextVar[StopRequests | None] = contextvars.ContextVar("dpml_stop_requests", default=None)


@contextlib.contextmanager
def stoppable() -> Iterator[None]:
    """:meth:`StopRequests.stoppable` of the requests active in this context, or nothing when there are none
    (a stage run by ``dpml stage``, a task in a Dask worker)."""
    current = _CURRENT.get()
    if current is None:
        yield
        return
    with current.stoppable():
        yield


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to send this process SIGKILL when the thread that started it ends (Linux), then
    make sure that ``parent_pid`` has not already gone. Elsewhere: nothing (the caller's ``finally``
    still stops its children; only a SIGKILL of the caller can then leave one behind)."""
    if not sys.platform.startswith("linux"):
        return

    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent ended before the request took effect
        os._exit(1)


_SPENT_NOTE = "dpml-spent: "


def note_spent(stop: BaseException, line: str) -> None:
    """Attach the line saying what the stopped run spent to the exception on its way up (a PEP 678 note),
    for whoever reports it at the top (:func:`spent_line`)."""
    stop.add_note(_SPENT_NOTE + line)


def spent_line(stop: BaseException) -> str | None:
    """The line :func:`note_spent` attached to ``stop`` or to an exception it was raised while handling."""
    seen: set[int] = set()
    current: BaseException | None = stop
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for note in getattr(current, "__notes__", ()):
            if note.startswith(_SPENT_NOTE):
                return note[len(_SPENT_NOTE) :]
        current = current.__cause__ or current.__context__
    return None
