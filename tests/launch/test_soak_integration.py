"""A fault soak in the suite (tests/soak.py holds the trials; `make soak` runs many more)."""

from __future__ import annotations

import random
import shutil

from replay.store import RunStore
from tests.conftest import error_line, replay_cli, tree_snapshot
from tests.soak import chained_kills, random_flips

SEED = 20261122


# One recording, killed twice (the whole process group, then one rank), each launch resuming the last, at
# the two moments the suite must always see: as the ranks start (before the first commit), and inside a
# checkpoint write (rank 1 half-way through its shard of checkpoint 20: REPLAY_FAULT). Kills at random
# moments are `make soak`'s: 30 independent recordings, one rank or the whole group.
PLAN = [("group", -1, None), ("rank", 20, "shard-half:20:1")]


def test_killed_twice_and_resumed_is_the_uninterrupted_run(two_rank_store, tmp_path):
    trials = chained_kills(two_rank_store, tmp_path, PLAN, random.Random(SEED))   # asserts bit for bit
    assert trials[0].landed == "start-up"
    assert "rank 1 was killed by signal 9 (SIGKILL)" in trials[1].error and trials[1].landed == "checkpoint write"
    assert [t.how for t in trials] == [how for how, _, _ in PLAN]


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
