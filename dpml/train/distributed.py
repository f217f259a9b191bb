"""DP-SGD across processes with torch.distributed: the same mechanism, computed by N processes.

Step t of a distributed run (:func:`dpml.train.dpsgd.run_dpsgd_steps`):

- every process draws the same global Poisson sample B_t (one sampler seeded with the run's seed,
  which the launcher hands to every process);
- process r clips its share B_t[r::N] (:func:`dpml.train.dpsgd.share_of_batch`);
- the lead (rank 0) alone draws the noise N(0, σ²C² I), from the generator a single process would use;
- one all-reduce sums the N partial clipped sums and the noise, so every process holds
  ĝ_t = (Σ_{i∈B_t} clip_C(∇ℓ_i) + N(0, σ²C² I)) / (q n) and takes the same optimizer step.

The released mechanism is therefore exactly the single-process one (same sample, same sensitivity C,
one noise draw per step): its certificate does not depend on N. Only the summation order of floats
differs from one process.

Two ways to start the processes:

- :func:`spawn` — dpml launches N processes on this machine (gloo on CPU, NCCL with one GPU per
  process), joined over TCP on 127.0.0.1, and returns rank 0's result;
- under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` set; one or several machines through
  torchrun's rendezvous), :func:`from_environment` joins the process group torchrun describes.
"""

from __future__ import annotations

import copy
import datetime
import os
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dpml.devices import pick_device

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
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
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
        raise ValueError(f"{key} = {world_size}: this machine has {torch.cuda.device_count()} GPU(s) and a "
                         "distributed GPU run takes one per process; lower it, or train on the CPU")


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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _process_main(rank: int, world_size: int, port: int, backend: str, threads: int, result_path: str,
                  worker: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """One spawned process: join the group, run ``worker(collective, *args)``, rank 0 saves the result.
    A module among ``args`` is copied first: spawning passes tensors in shared memory, and N processes
    stepping one shared set of weights would apply every update N times."""
    torch.set_num_threads(threads)
    args = tuple(copy.deepcopy(a) if isinstance(a, torch.nn.Module) else a for a in args)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=TIMEOUT)
    try:
        result = worker(Collective(rank, world_size), *args)
        if rank == 0:
            torch.save(result, result_path)
    finally:
        dist.destroy_process_group()


def check_picklable(key: str, world_size: int, remedy: str = "train in one process", **objects: Any) -> None:
    """What :func:`spawn` sends to its processes must pickle (tensors go by shared memory, as they will):
    refused before any spend, naming the object, rather than failing once the run has started."""
    from multiprocessing.reduction import ForkingPickler

    for name, value in objects.items():
        try:
            ForkingPickler.dumps(value)
        except Exception as error:
            raise ValueError(f"{key} = {world_size}: the {name} goes to each process by pickling and cannot be "
                             f"pickled ({type(error).__name__}: {error}); define its class or function at module "
                             f"level in an importable file, or {remedy}") from error


def spawn(world_size: int, device: str, worker: Callable[..., Any], *args: Any) -> Any:
    """Run ``worker(collective, *args)`` in ``world_size`` new processes on this machine; return rank 0's
    result. ``worker`` and ``args`` must be picklable (a module-level function; the processes start
    fresh). A process that fails makes this raise, with that process's traceback."""
    import torch.multiprocessing as mp

    if world_size < 2:
        raise ValueError(f"world_size = {world_size}: spawn needs at least 2 processes")
    threads = max(1, (os.cpu_count() or 1) // world_size)
    with tempfile.TemporaryDirectory(prefix="dpml-distributed-") as work:
        result_path = str(Path(work) / "rank0.pt")
        mp.start_processes(_process_main, args=(world_size, free_port(), backend_for(device), threads, result_path,
                                                worker, args),
                           nprocs=world_size, join=True, start_method="spawn")
        return torch.load(result_path, weights_only=False)
