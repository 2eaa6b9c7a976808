"""`replay run --ranks N`: a window of a W-rank run replayed on fewer processes (train/fewer_ranks.py), bit for
bit against the record; the ring order checked against a real gloo all-reduce; the refusals."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from replay.config import Launcher
from replay.store import RunStore
from replay.store.capabilities import Capabilities
from tests.conftest import REPO, error_line, made_once, replay_cli


@pytest.fixture(scope="module")
def four_rank_store(tmp_path_factory):
    def record(folder):
        result = replay_cli("record", "--store", str(folder / "run"), "--nproc", "4", "--steps", "8",
                            "--checkpoint-every", "4", "--set", "micro_batch_size=1", process=True)
        assert result.returncode == 0, result.stderr
        return folder / "run"

    return made_once(tmp_path_factory, "four_rank", record)


def model_at(store, step: int) -> dict[str, torch.Tensor]:
    return RunStore.open(store).read_subtree(step, 0, ("state", "replicated", "model"))


def assert_same_model(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key].view(torch.int32), b[key].view(torch.int32)), key


@pytest.mark.parametrize("ranks", [2, 1])
def test_four_recorded_ranks_replay_bit_for_bit_on_fewer_processes(four_rank_store, ranks):
    result = replay_cli("run", str(four_rank_store), "--from", "4", "--to", "7", "--ranks", str(ranks), "--verify")
    assert result.returncode == 0, result.stderr
    assert "bit for bit" in result.stdout, result.stdout
    replay = four_rank_store / "replays" / f"steps-4-7-ranks{ranks}"
    m = RunStore.open(replay).manifest
    assert m.world_size == 4 and m.replay_spec.processes == ranks
    assert RunStore.open(replay).read_steps(["rank_loss"])["rank_loss"].shape[1] == 4
    assert_same_model(model_at(replay, 8), model_at(four_rank_store, 8))   # the record's own checkpoint 8
    for rank in range(4):   # every recorded rank's shard is there, as a 4-rank replay leaves them
        RunStore.open(replay).verify_shard(8, rank)


def test_two_ranks_on_one_process_end_where_the_two_rank_replay_ends(two_rank_store):
    one = replay_cli("run", str(two_rank_store), "--from", "10", "--to", "11", "--ranks", "1", "--verify")
    assert one.returncode == 0 and "bit for bit" in one.stdout, one.stderr + one.stdout
    full = replay_cli("run", str(two_rank_store), "--from", "10", "--to", "11", "--name", "full-10-11")
    assert full.returncode == 0, full.stderr
    assert_same_model(model_at(two_rank_store / "replays" / "steps-10-11-ranks1", 12),
                      model_at(two_rank_store / "replays" / "full-10-11", 12))


def test_the_ring_order_is_gloos():
    """The expected sums come from a real 4-process gloo all_reduce (benchmarks/gloo_order.py)."""
    out = subprocess.run([sys.executable, "benchmarks/gloo_order.py", "--world", "4", "--sizes", "1000", "120576"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "1000 of 1000 elements bit for bit" in out.stdout and "120576 of 120576 elements" in out.stdout, out.stdout


def test_ranks_that_do_not_divide_the_world_are_refused(two_rank_store):
    assert "does not divide the recorded 2 ranks" in error_line(
        replay_cli("run", str(two_rank_store), "--from", "10", "--to", "11", "--ranks", "3"))


def test_deepspeed_and_scripts_of_ones_own_are_refused(two_rank_store):
    m = RunStore.open(two_rank_store).manifest
    ds = Capabilities.of(dataclasses.replace(m, launcher=Launcher.DEEPSPEED)).fewer_ranks_refusal
    custom = Capabilities.of(dataclasses.replace(m, launcher=Launcher.CUSTOM)).fewer_ranks_refusal
    assert ds is not None and "local launcher" in ds
    assert custom is not None and "built-in trainer" in custom
    assert Capabilities.of(m).fewer_ranks_refusal is None
