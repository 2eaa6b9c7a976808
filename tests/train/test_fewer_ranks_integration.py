"""A 4-rank DDP run, whose all-reduce order shows in the bits (gloo's ring sums an element over the ranks in
an order set by its place in DDP's bucket): replayed from a checkpoint past step 0 and resumed there, bit for
bit (DDP's rebuilt bucket layout kept: trainer.py `_rebuild_buckets`); replayed on fewer processes (`replay
run --ranks N`, train/fewer_ranks.py), bit for bit against the record; the refusals."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch

from replay.config import Launcher
from replay.store import RunStore
from replay.store.capabilities import Capabilities
from tests.conftest import error_line, killed_and_resumed, made_once, replay_cli

ARGS = ["--nproc", "4", "--steps", "8", "--checkpoint-every", "4", "--set", "micro_batch_size=1"]


@pytest.fixture(scope="module")
def four_rank_store(tmp_path_factory):
    def record(folder):
        result = replay_cli("record", "--store", str(folder / "run"), *ARGS, process=True)
        assert result.returncode == 0, result.stderr
        return folder / "run"

    return made_once(tmp_path_factory, "four_rank", record)


def model_at(store, step: int) -> dict[str, torch.Tensor]:
    return RunStore.open(store).read_subtree(step, 0, ("state", "replicated", "model"))


def assert_same_model(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key].view(torch.int32), b[key].view(torch.int32)), key


def test_a_window_from_a_later_checkpoint_replays_bit_for_bit(four_rank_store):
    result = replay_cli("run", str(four_rank_store), "--from", "4", "--to", "5", "--verify")
    assert result.returncode == 0, result.stderr
    assert "every replayed step equals the record bit for bit" in result.stdout, result.stdout


def test_a_run_resumed_at_a_checkpoint_equals_the_uninterrupted_one(four_rank_store, tmp_path):
    cut = tmp_path / "cut"
    killed_and_resumed(cut, ARGS)
    a, b = RunStore.open(cut), RunStore.open(four_rank_store)
    assert [r.from_step for r in a.manifest.resumes] == [4]
    for field in ("loss", "rank_loss", "grad_norm", "lr"):
        assert np.array_equal(a.read_steps()[field], b.read_steps()[field]), field
    for rank in range(4):   # rank 0's model and optimizer; every rank's RNG states
        assert_same(a.read_shard(8, rank), b.read_shard(8, rank))


def assert_same(a, b, where: str = "") -> None:
    """Two checkpoint trees hold the same values, tensors bit for bit."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}/{i}")
    elif isinstance(a, torch.Tensor):
        bits = (t.reshape(-1).view(torch.uint8) for t in (a, b))
        assert a.dtype == b.dtype and torch.equal(*bits), where
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    else:
        assert a == b, where


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


def test_two_ranks_on_one_process_end_where_the_two_rank_replay_ends(two_rank_store, tmp_path):
    store = tmp_path / "run"   # a copy: the session's recording is every test's, its replays listed by some
    shutil.copytree(two_rank_store, store, ignore=shutil.ignore_patterns("replays"))
    one = replay_cli("run", str(store), "--from", "10", "--to", "11", "--ranks", "1", "--verify")
    assert one.returncode == 0 and "bit for bit" in one.stdout, one.stderr + one.stdout
    full = replay_cli("run", str(store), "--from", "10", "--to", "11", "--name", "full-10-11")
    assert full.returncode == 0, full.stderr
    assert_same_model(model_at(store / "replays" / "steps-10-11-ranks1", 12),
                      model_at(store / "replays" / "full-10-11", 12))


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
