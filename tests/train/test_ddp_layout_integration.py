"""A 3-rank DDP run started past step 0 (a replay from a checkpoint, a resumed recording) reduces in the
bucket layout the uninterrupted run had there: DDP's rebuilt one (trainer.py `_rebuild_buckets`). With 3
ranks gloo's ring sums an element in an order set by its place in the bucket, so another layout shows in the
bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replay.store import RunStore
from tests.conftest import error_line, made_once, replay_cli

ARGS = ["--nproc", "3", "--steps", "8", "--checkpoint-every", "4",
        "--set", "batch_size=6", "--set", "micro_batch_size=1"]


@pytest.fixture(scope="module")
def three_rank_store(tmp_path_factory):
    def record(folder):
        result = replay_cli("record", "--store", str(folder / "run"), *ARGS, process=True)
        assert result.returncode == 0, result.stderr
        return folder / "run"

    return made_once(tmp_path_factory, "three_rank", record)


def test_a_window_from_a_later_checkpoint_replays_bit_for_bit(three_rank_store):
    result = replay_cli("run", str(three_rank_store), "--from", "4", "--to", "5", "--verify")
    assert result.returncode == 0, result.stderr
    assert "every replayed step equals the record bit for bit" in result.stdout, result.stdout


def test_a_run_resumed_at_a_checkpoint_equals_the_uninterrupted_one(three_rank_store, tmp_path):
    cut = tmp_path / "cut"
    killed = replay_cli("record", "--store", str(cut), *ARGS, env={"REPLAY_FAULT": "shard-half:8:0"})
    assert "rank 0 was killed by signal 9" in error_line(killed)
    resumed = replay_cli("record", "--store", str(cut), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    a, b = RunStore.open(cut), RunStore.open(three_rank_store)
    assert [r.from_step for r in a.manifest.resumes] == [4]
    for field in ("loss", "rank_loss", "grad_norm", "lr"):
        assert np.array_equal(a.read_steps()[field], b.read_steps()[field]), field
    for rank in range(3):   # rank 0's model and optimizer; every rank's RNG states
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
