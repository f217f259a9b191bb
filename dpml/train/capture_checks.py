"""What a CUDA graph cannot hold, seen in one eager pass before any capture (:mod:`dpml.train.captured`): a
synchronising call (a value read on the host, a copy from pageable host memory), and a host tensor taken to the device
or brought back (a replay would read the host's memory again, by then reused)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class HostTensorsOnTheDevice(TorchDispatchMode):
    """The operators that take a host tensor (other than a 0-dimensional scalar, which a kernel takes by value) to
    another device, or bring one back (``operations``). A graph captures a copy from pinned host memory as a copy from
    that address: its replays would read whatever the host holds there by then. A 0-dimensional host tensor made
    beside a device's outputs is not counted either: efficient attention's random seed and offset, made on the host
    and unused without dropout (a pass with dropout draws random numbers, and runs eagerly for that); a value read
    back from the device is a synchronisation, which :func:`synchronisations` sees. (Counted, it sent every model
    with PyTorch's memory-efficient attention, timm's ViT among them, to the eager pass.)"""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.operations: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        given = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        made = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        host_in = any(t.device.type == "cpu" and t.dim() > 0 for t in given)
        device_in = any(t.device.type != "cpu" for t in given)
        device_out = any(t.device.type != "cpu" for t in made)
        host_out = any(t.device.type == "cpu" and t.dim() > 0 for t in made)
        if host_in and device_out or device_in and host_out:
            self.operations.append(str(func))
        return out


@contextlib.contextmanager
def synchronisations() -> Iterator[list[str]]:
    """The synchronising CUDA calls made within the block (a value read on the host, a copy from pageable host
    memory), as ``torch.cuda.set_sync_debug_mode("warn")`` reports them: none may happen inside a capture."""
    mode = torch.cuda.get_sync_debug_mode()
    found: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(mode)
    found += synchronising_calls(str(w.message) for w in caught)


SYNC_WARNING = "called a synchronizing CUDA operation"
"""What ``torch.cuda.set_sync_debug_mode("warn")`` warns at each synchronising call (c10's warn_or_error_on_sync)."""


def synchronising_calls(messages: Iterable[str]) -> list[str]:
    """The warnings among ``messages`` that report a synchronising call: :data:`SYNC_WARNING`, not the warning that
    switching the mode on gives once a process ("Synchronization debug mode is a prototype feature and does not yet
    detect all synchronizing operations"), which a looser match read as a wait and so ran every model's first
    setting eagerly on a GPU (the trainer's first capture in a process: every family of the issue-46 table, each in
    its own process, and the speed table's first dpml row per process)."""
    return [message.splitlines()[0] for message in messages if message.startswith(SYNC_WARNING)]
