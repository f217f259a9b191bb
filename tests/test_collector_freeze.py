"""The training loops leave the process's older objects out of Python's garbage collections while they run
(:func:`dpml.devices.older_objects_left_out_of_collections`): frozen for the steps, put back however the run ends,
the process's own freeze and a disabled collector left as they were, one freeze shared by loops in several threads,
and the garbage the steps make collected as before. Watched from inside the steps through the loss function, which
every engine pass calls (also the clipping plan's probe, before the loop)."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch
from test_noisycgd import _settings as noisycgd_settings
from torch import nn

from dpml.devices import older_objects_left_out_of_collections
from dpml.models.gated import GatedLinear, GatedSpec
from dpml.train.dpsgd import LOSSES, per_example_cross_entropy, train_dpsgd
from dpml.train.noisycgd import train_noisycgd


@pytest.fixture(autouse=True)
def _collector_as_found() -> Iterator[None]:
    """Each test starts with the collector on and nothing frozen, and leaves it so."""
    gc.enable()
    gc.unfreeze()
    yield
    gc.enable()
    gc.unfreeze()


class Cycle:
    """An object in a reference cycle (only a garbage collection frees it), with a flag set when it is freed."""

    def __init__(self) -> None:
        self.me = self
        self.freed = threading.Event()
        weakref.finalize(self, self.freed.set)


def watching(loss: Callable[..., torch.Tensor], on_call: Callable[[], None]) -> Callable[..., torch.Tensor]:
    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        on_call()
        return loss(outputs, targets)

    return loss_fn


def train(loss_fn: Callable[..., torch.Tensor], steps: int = 4) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(64, 4)
    train_dpsgd(
        model,
        x,
        (x[:, 0] > 0).long(),
        sample_rate=1 / steps,
        epochs=1.0,
        clip_norm=1.0,
        noise_multiplier=1.0,
        neighbouring="add-remove",
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        seed=0,
        tune_physical_batch=False,
        loss_fn=loss_fn,
    )


def test_the_heap_from_before_a_run_is_frozen_for_its_steps_only() -> None:
    before = len(gc.get_objects())
    frozen: list[int] = []
    train(watching(per_example_cross_entropy, lambda: frozen.append(gc.get_freeze_count())))
    assert frozen[0] == 0  # the plan's probe, before the loop
    in_steps = [count for count in frozen if count > 0]
    assert len(in_steps) >= 4  # one engine pass a step at least
    assert min(in_steps) >= 0.9 * before  # the process's objects (some freed since)
    assert frozen[-1] > 0  # the last step's
    assert gc.get_freeze_count() == 0 and gc.isenabled()


def test_older_garbage_waits_for_the_end_of_the_run_and_the_steps_garbage_does_not() -> None:
    old = Cycle()
    old_freed = old.freed
    made: list[threading.Event] = []
    seen: dict[str, bool] = {}

    def on_call() -> None:
        nonlocal old
        if not gc.get_freeze_count():
            return
        if old is not None:  # the first call inside the loop: the old cycle becomes garbage
            old = None  # type: ignore[assignment]
            made.append(Cycle().freed)  # garbage the step makes (its only reference dropped at once)
            return
        if "collected" not in seen:
            gc.collect()
            seen["collected"] = True
            seen["old freed in the run"] = old_freed.is_set()
            seen["new freed in the run"] = made[0].is_set()

    train(watching(per_example_cross_entropy, on_call))
    assert seen == {"collected": True, "old freed in the run": False, "new freed in the run": True}
    gc.collect()
    assert old_freed.is_set()  # thawed with the rest after the run


def test_a_run_that_fails_in_a_step_puts_the_heap_back() -> None:
    calls = {"frozen": 0}

    def on_call() -> None:
        if gc.get_freeze_count():
            calls["frozen"] += 1
            if calls["frozen"] == 2:
                raise RuntimeError("a step failed")

    with pytest.raises(RuntimeError, match="a step failed"):
        train(watching(per_example_cross_entropy, on_call))
    assert calls["frozen"] == 2 and gc.get_freeze_count() == 0


def test_a_process_that_froze_its_heap_itself_keeps_its_freeze() -> None:
    gc.freeze()  # as a server does before it forks
    own = gc.get_freeze_count()
    during: list[int] = []
    train(watching(per_example_cross_entropy, lambda: during.append(gc.get_freeze_count())))
    assert gc.get_freeze_count() >= 0.99 * own > 0  # not thawed by the run (a few of its objects freed since)
    assert max(during) <= own  # and nothing of the run's frozen beside it


def test_a_disabled_collector_stays_off_and_nothing_is_frozen() -> None:
    gc.disable()
    during: list[tuple[int, bool]] = []
    train(watching(per_example_cross_entropy, lambda: during.append((gc.get_freeze_count(), gc.isenabled()))))
    assert set(during) == {(0, False)} and not gc.isenabled() and gc.get_freeze_count() == 0


def test_runs_in_two_threads_share_one_freeze_until_the_last_ends() -> None:
    first_in_loop, second_done = threading.Event(), threading.Event()
    after_second: list[int] = []
    errors: list[BaseException] = []

    def first_on_call() -> None:
        if gc.get_freeze_count() and not first_in_loop.is_set():
            first_in_loop.set()
            assert second_done.wait(120)
            after_second.append(gc.get_freeze_count())

    def run(on_call: Callable[[], None], done: threading.Event | None = None) -> None:
        try:
            train(watching(per_example_cross_entropy, on_call))
        except BaseException as error:  # noqa: BLE001 (reported by the test's thread)
            errors.append(error)
        finally:
            if done is not None:
                done.set()

    first = threading.Thread(target=run, args=(first_on_call,))
    first.start()
    assert first_in_loop.wait(120)
    second = threading.Thread(target=run, args=(lambda: None, second_done))
    second.start()
    second.join(120)
    first.join(120)
    assert not errors
    assert after_second and after_second[0] > 0  # the second run's end left the first's steps frozen
    assert gc.get_freeze_count() == 0


def test_nested_blocks_thaw_once_at_the_outermost_end() -> None:
    with older_objects_left_out_of_collections():
        outer = gc.get_freeze_count()
        with older_objects_left_out_of_collections():
            assert gc.get_freeze_count() >= outer > 0
        assert gc.get_freeze_count() >= outer
    assert gc.get_freeze_count() == 0


def test_noisycgd_steps_run_frozen_too() -> None:
    frozen: list[int] = []
    settings = noisycgd_settings(batch_size=10, epochs=2, n_gates=2)
    model = GatedLinear(GatedSpec(in_features=6, n_gates=2, n_classes=3, gate_seed=0))
    x = torch.randn(30, 6)
    x = x / x.norm(dim=1, keepdim=True)
    train_noisycgd(
        model,
        x,
        torch.randint(0, 3, (30,)),
        settings=settings,
        loss_fn=watching(LOSSES["cross_entropy"], lambda: frozen.append(gc.get_freeze_count())),
        partition_seed=0,
        noise_seed=1,
    )
    assert len(frozen) >= 6 and min(frozen) > 0  # every pass of its 2 epochs × 3 batches
    assert gc.get_freeze_count() == 0
