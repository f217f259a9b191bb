"""DP-SGD across processes with torch.distributed: the same mechanism, computed by N processes.

Step t of a distributed run (:func:`dpml.train.dpsgd.run_dpsgd_steps`):

- every process draws the same global Poisson sample B_t (one sampler seeded with the run's seed,
  which the launcher hands to every process);
- process r clips its share B_t[r::N] (:func:`dpml.train.steps.share_of_batch`);
- the lead (rank 0) alone draws the noise N(0, σ²C² I), from the generator a single process would use;
- one all-reduce sums the N partial clipped sums and the noise, so every process holds
  ĝ_t = (Σ_{i∈B_t} clip_C(∇ℓ_i) + N(0, σ²C² I)) / (q n) and takes the same optimizer step.

The released mechanism is therefore exactly the single-process one (same sample, same sensitivity C,
one noise draw per step): its certificate does not depend on N. Only the summation order of floats
differs from one process.

Two ways to start the processes:

- :func:`spawn` — dpml launches N processes on this machine (gloo on CPU, NCCL with one GPU per
  process), joined through a rendezvous store it holds on 127.0.0.1 and a port the system picks, and
  returns rank 0's result; the processes never outlive the call (nor the launching process);
- under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` set; one or several machines through
  torchrun's rendezvous), :func:`from_environment` joins the process group torchrun describes.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import os
import pickle
import signal
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
import multiprocessing
from multiprocessing import resource_tracker
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dpml.devices import pick_device
from dpml.interrupts import die_with_parent

TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class Collective:
    """This process's place in a distributed run."""

    rank: int
    world_size: int

    @property
    def lead(self) -> bool:
        """Rank 0: draws the noise, writes results, charges the ledger."""
        return self.rank == 0

    def sum_in_place(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Σ over processes of each tensor, in place, by one all-reduce of one flat buffer."""
        flat = torch.cat([t.reshape(-1).to(tensors[0].dtype) for t in tensors])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        return tensors

    def all_agree(self, ok: bool, device: torch.device | str = "cpu") -> bool:
        """True on every process when ``ok`` is true on every process (a barrier with a verdict)."""
        flag = torch.tensor([1.0 if ok else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item() == 1.0)

    def broadcast_int(self, value: int, device: torch.device | str = "cpu") -> int:
        """The lead's ``value`` on every process (the run's secret seed: the processes must share it)."""
        box = torch.tensor([value if self.lead else 0], dtype=torch.int64, device=device)
        dist.broadcast(box, src=0)
        return int(box.item())


def backend_for(device: str) -> str:
    """NCCL for GPUs, gloo for CPUs."""
    return "nccl" if device.startswith("cuda") else "gloo"


def process_device(device: str, rank: int) -> str:
    """One GPU per process (cuda:rank, modulo the GPUs of this machine); the CPU stays the CPU."""
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", rank))
        return f"cuda:{local % max(torch.cuda.device_count(), 1)}"
    return device


def check_world_size(world_size: int, device: str, key: str = "train.world_size") -> None:
    """One GPU per process: a distributed run on GPUs needs ``world_size`` of them on this machine."""
    if device.startswith("cuda") and world_size > torch.cuda.device_count():
        raise ValueError(
            f"{key} = {world_size}: this machine has {torch.cuda.device_count()} GPU(s) and a "
            "distributed GPU run takes one per process; lower it, or train on the CPU"
        )


def from_environment() -> Collective | None:
    """Under torchrun (``WORLD_SIZE`` > 1 in the environment): join its process group (``env://``)."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return None
    if not dist.is_initialized():
        device = str(pick_device())
        if device == "cuda":  # NCCL: each process on its own GPU (torchrun's LOCAL_RANK) before the group forms
            torch.cuda.set_device(process_device(device, int(os.environ.get("RANK", "0"))))
        dist.init_process_group(backend_for(device), init_method="env://", timeout=TIMEOUT)
    return Collective(dist.get_rank(), dist.get_world_size())


def _process_main(rank: int, world_size: int, port: int, backend: str, threads: int, work: str, parent: int) -> None:
    """One spawned process: tie its life to the launcher's (``parent``), read its task from ``work``, join the
    group through the launcher's store on ``port``, run ``worker(collective, *args)``, rank 0 saves the
    result. A module among ``args`` is copied first: tensors come in shared memory, and N processes stepping
    one shared set of weights would apply every update N times."""
    die_with_parent(parent)
    _own_launch_environment(rank)
    torch.set_num_threads(threads)
    worker, args = pickle.loads((Path(work) / f"task-{rank}.pickle").read_bytes())
    args = tuple(copy.deepcopy(a) if isinstance(a, torch.nn.Module) else a for a in args)
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, timeout=TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=TIMEOUT)
    try:
        result = worker(Collective(rank, world_size), *args)
        if rank == 0:
            torch.save(result, Path(work) / "rank0.pt")
    finally:
        dist.destroy_process_group()


TORCHRUN_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


def _own_launch_environment(rank: int) -> None:
    """A process started by :func:`spawn` inherits its launcher's environment, which may be a torchrun job's:
    its variables would then describe another group (``LOCAL_RANK`` picks the GPU, :func:`process_device`).
    At this process's edge they are removed, and ``LOCAL_RANK`` says where this process is in its own group."""
    for name in TORCHRUN_VARIABLES:
        os.environ.pop(name, None)
    os.environ["LOCAL_RANK"] = str(rank)  # one machine: the local rank is the rank


def _end(processes: list[Any]) -> None:
    """Stop a distributed run's processes at once (SIGKILL: they hold nothing worth saving) and reap them."""
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join()


@contextlib.contextmanager
def _interrupts_withheld_from_children() -> Iterator[None]:
    """Processes started inside the block have SIGINT blocked for life (a signal mask survives fork and exec):
    a terminal's Ctrl-C reaches the whole process group, and a child caught while still starting would print
    a traceback. They are stopped by their launcher (:func:`_end`) or die with it instead."""
    resource_tracker.ensure_running()  # started later, it would unblock SIGINT in this thread (its own launch does)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def check_picklable(key: str, world_size: int, remedy: str = "train in one process", **objects: Any) -> None:
    """What :func:`spawn` sends to its processes must pickle (tensors go by shared memory, as they will):
    refused before any spend, naming the object, rather than failing once the run has started."""
    for name, value in objects.items():
        try:
            ForkingPickler.dumps(value)
        except Exception as error:
            raise ValueError(
                f"{key} = {world_size}: the {name} goes to each process by pickling and cannot be "
                f"pickled ({type(error).__name__}: {error}); define its class or function at module "
                f"level in an importable file, or {remedy}"
            ) from error


def spawn(world_size: int, device: str, worker: Callable[..., Any], *args: Any) -> Any:
    """Run ``worker(collective, *args)`` in ``world_size`` new processes on this machine; return rank 0's
    result. ``worker`` and ``args`` must be picklable (a module-level function; the processes start
    fresh). A process that fails makes this raise, with that process's traceback.

    The processes meet at a rendezvous store that this process opens on a port the system picks, and holds
    open until they have finished: concurrent distributed runs on one machine (the audit's reference models
    in parallel Dask workers) never share or race for a port. Each reads its task from a file (written
    before it starts), so starting one never waits on the others and a process killed while its children
    start leaves them nothing half-read. They never outlive this call: an exception here (Ctrl-C,
    SIGTERM, a cancellation, a failed process) kills every one of them before it propagates, and each dies
    with this process should it be killed outright (:func:`dpml.interrupts.die_with_parent`).
    Starting processes needs a process that may have children: a daemonic one (a Dask worker started with
    ``distributed.worker.daemon: true``) is refused with a message saying so."""
    if world_size < 2:
        raise ValueError(f"world_size = {world_size}: spawn needs at least 2 processes")
    if multiprocessing.current_process().daemon:
        raise RuntimeError(
            f"world_size = {world_size}: this process is daemonic (a Dask worker started with "
            "distributed.worker.daemon: true) and cannot start the training processes; start the "
            "workers non-daemonic, or train in one process"
        )

    threads = max(1, (os.cpu_count() or 1) // world_size)
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    with tempfile.TemporaryDirectory(prefix="dpml-distributed-") as work:
        for rank in range(world_size):  # one pickle each: a tensor's shared memory is handed over once per pickle
            (Path(work) / f"task-{rank}.pickle").write_bytes(ForkingPickler.dumps((worker, args)))
        with _interrupts_withheld_from_children():
            context = mp.start_processes(
                _process_main,
                args=(world_size, store.port, backend_for(device), threads, work, os.getpid()),
                nprocs=world_size,
                join=False,
                start_method="spawn",
            )
        try:
            while not context.join():
                pass
        except BaseException:
            _end(context.processes)
            raise
        finally:
            del store
        return torch.load(Path(work) / "rank0.pt", weights_only=False)
