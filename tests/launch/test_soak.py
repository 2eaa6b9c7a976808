"""A fault soak in the suite (tests/soak.py holds the trials; `make soak` runs many more)."""

from __future__ import annotations

import random
import shutil

import pytest

from replay.store import RunStore
from tests.conftest import error_line, replay_cli, tree_snapshot
from tests.soak import kill_trial, random_flips

pytestmark = pytest.mark.slow
SEED = 20261122


# (how, at step, fault hook): the moment of a kill is random but for two, which the suite must always see:
# before the first commit (as the ranks start), and inside a checkpoint write (rank 1 half-way through its
# shard of checkpoint 20, from inside the write: REPLAY_FAULT).
TRIALS = [("group", None, None), ("rank", None, None), ("group", -1, None), ("rank", 20, "shard-half:20:1"),
          ("group", None, None), ("rank", None, None)]


@pytest.mark.parametrize("trial", range(len(TRIALS)))
def test_killed_at_a_random_moment_and_resumed_is_the_uninterrupted_run(two_rank_store, tmp_path, trial):
    how, at_step, fault = TRIALS[trial]
    result = kill_trial(two_rank_store, tmp_path, random.Random(SEED + trial), how, at_step, fault)  # bit for bit
    if at_step == -1:
        assert result.landed == "start-up" and result.resumed_from == 0
    if fault:
        assert "rank 1 was killed by signal 9 (SIGKILL)" in result.error
        assert result.landed == "checkpoint write" and result.resumed_from == 10


def test_flipped_bits_in_a_committed_checkpoint_are_refused_naming_it(two_rank_store, tmp_path):
    store = tmp_path / "run"
    shutil.copytree(two_rank_store, store)
    step = RunStore.open(store).checkpoints()[-2].step
    trials = random_flips(store, step, 12, random.Random(SEED))
    assert len({t.file for t in trials}) >= 3
    bad = [(t.file, t.byte, t.bit, t.message) for t in trials if not t.one_line]
    assert not bad


def test_the_flip_that_was_accepted_before_is_refused_by_replay_run(two_rank_store, tmp_path):
    """An optimizer's stored lr 0.000914 -> 0.001914 in rank 0's JSON: once trained on and reported as a
    divergence; now a corrupted checkpoint, named in one line, and nothing written."""
    store = tmp_path / "run"
    shutil.copytree(two_rank_store, store)
    doc = store / "checkpoints/00000020/rank0/zarr.json"
    raw = bytearray(doc.read_bytes())
    lr = raw.index(b'["lr",0.000') + len(b'["lr",0.00')
    raw[lr] ^= 0x01   # the optimizer's learning rate 0.0009... becomes 0.0019...: still valid JSON
    doc.write_bytes(bytes(raw))
    before = tree_snapshot(store)
    line = error_line(replay_cli("run", str(store), "--from", "20", "--to", "25", "--verify"))
    assert "checkpoint 20 rank 0: its index and non-tensor state" in line and "does not match its checksum" in line
    assert tree_snapshot(store) == before
