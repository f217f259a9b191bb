"""DP-SGD across processes (``dpml/train/distributed.py``): N gloo processes end where one process ends.

One global Poisson sample per step, each process clips its share, the clipped sums are all-reduced
and rank 0 alone adds the noise: with the same seeds the parameters equal one process's to float
rounding. A second noise draw, a process that samples its own batch or N processes stepping shared
weights would each move them far more than that, and so would a wrong seed (checked as a control).
Real processes throughout: spawned by dpml, and launched by torchrun in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dpml

from dpml.config import load
from dpml.ledger.ledger import Ledger
from dpml.train.distributed import Collective, spawn
from dpml.train.dpsgd import train_dpsgd
from dpml.train.registry import trainer_for
from tests.conftest import small_params, write_params
from tests.test_api import SETTINGS, Blobs, largest_difference, moved, network

ROOT = Path(__file__).resolve().parents[1]


def tensor_run(collective: Collective | None, seed: int = 7) -> dict[str, torch.Tensor]:
    """DP-SGD on in-memory tensors: the whole run, or one process's part of it."""
    model, data = network(), Blobs(200)
    train_dpsgd(
        model,
        data.x,
        data.y,
        sample_rate=0.2,
        epochs=2,
        clip_norm=1.0,
        noise_multiplier=1.0,
        neighbouring="add-remove",
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        seed=seed,
        physical_batch_size=16,
        collective=collective,
    )
    return {k: v.detach() for k, v in model.state_dict().items()}


def largest_state_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_two_processes_end_with_the_parameters_of_one() -> None:
    one = tensor_run(None)
    two = spawn(2, "cpu", tensor_run)
    assert largest_state_difference(one, network().state_dict()) > 0.05
    assert largest_state_difference(one, two) < 1e-5
    assert largest_state_difference(one, tensor_run(None, seed=8)) > 0.01  # the control: another seed


@pytest.mark.exhaustive  # CI runs it after the default suite, which stays near 20 min on 2 cores
def test_the_python_api_on_two_processes_trains_what_one_trains() -> None:
    """The model and the data set go to the processes by pickling (shared memory for tensors): each
    process must step its own copy, or every update would be applied twice."""
    alone, together = network(), network()
    single = dpml.train_private(alone, Blobs(), **SETTINGS)
    spread = dpml.train_private(together, Blobs(), world_size=2, **SETTINGS)
    assert moved(alone) > 0.05
    assert largest_difference(alone, together) < 1e-5
    assert spread.history["world_size"] == 2 and spread.epsilon == single.epsilon


def test_the_pipeline_trainer_runs_distributed_with_train_world_size(tmp_path: Path) -> None:
    def config(world_size: int) -> Any:
        params = small_params(tmp_path, train={"world_size": world_size, "epochs": 2, "sample_rate": 0.2})
        return load(write_params(tmp_path / f"params{world_size}.yaml", params))

    data = Blobs(200)
    x, y = data.x.numpy(), data.y.numpy()
    runs = {}
    for world_size in (1, 2):
        cfg = config(world_size)
        runs[world_size] = trainer_for(cfg).fit(cfg, x, y, 3, noise_multiplier=1.0, seed=0, noise_seed=11)
    one, two = runs[1], runs[2]
    assert two.history["world_size"] == 2 and two.mechanism == one.mechanism
    assert largest_difference(one.model, two.model) < 1e-5
    fresh = trainer_for(config(1)).build_model(config(1), 10, 3, 0)
    assert largest_difference(one.model, fresh) > 0.05


def test_a_trainer_that_runs_in_one_process_refuses_train_world_size(tmp_path: Path) -> None:
    params = small_params(tmp_path, train={"world_size": 2, "algorithm": "noisycgd"})
    with pytest.raises(Exception, match=r"train.world_size = 2: this trainer runs in one process"):
        load(write_params(tmp_path / "params.yaml", params))


TORCHRUN_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import dpml
    from tests.test_api import SETTINGS, Blobs, network

    model = network()
    result = dpml.train_private(model, Blobs(), ledger=sys.argv[1], epsilon_budget=float(sys.argv[2]),
                                lineage="blobs", **SETTINGS)
    if torch.distributed.get_rank() == 0:
        torch.save({k: v.detach() for k, v in model.state_dict().items()}, sys.argv[3])
        print("SPEND", result.spend_id, result.history["world_size"])
""")


def torchrun(tmp_path: Path, budget: float) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
            str(tmp_path / "ledger.sqlite"),
            str(budget),
            str(tmp_path / "rank0.pt"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )


@pytest.mark.exhaustive  # ≈45 s: two torchrun launches; CI runs it with the exhaustive set
def test_under_torchrun_rank_0_charges_once_and_a_refusal_stops_every_rank(tmp_path: Path) -> None:
    done = torchrun(tmp_path, budget=3.5)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SPEND 1 2" in done.stdout
    alone = network()
    dpml.train_private(alone, Blobs(), **SETTINGS)
    together = network()
    together.load_state_dict(torch.load(tmp_path / "rank0.pt"))
    assert largest_difference(alone, together) < 1e-5
    ledger = Ledger(tmp_path / "ledger.sqlite", 1e-4)
    assert len(ledger.spends()) == 1  # one run, one spend: rank 1 charged nothing
    before = (tmp_path / "rank0.pt").read_bytes()
    refused = torchrun(tmp_path, budget=3.5)  # a second run would compose to ε ≈ 3.85 > 3.5
    assert refused.returncode != 0
    assert "BudgetExceeded" in refused.stderr and "rank 0 refused the run" in refused.stderr
    assert len(ledger.spends()) == 1 and (tmp_path / "rank0.pt").read_bytes() == before
    assert np.isfinite(ledger.total("blobs"))


def test_what_cannot_reach_the_processes_is_refused_before_the_spend(tmp_path: Path) -> None:
    class LocalData(Blobs):  # defined in a function: the processes could not unpickle it
        pass

    ledger_path = tmp_path / "ledger.sqlite"
    with pytest.raises(ValueError, match=r"world_size = 2: the dataset goes to each process by pickling"):
        dpml.train_private(
            network(), LocalData(), world_size=2, ledger=ledger_path, epsilon_budget=10.0, lineage="blobs", **SETTINGS
        )
    assert not ledger_path.exists() or Ledger(ledger_path, 1e-4).spends() == []
