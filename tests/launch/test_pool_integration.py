"""Warm ranks (launch/pool.py), forked from the pool's fork server: replays one after another in the same rank
processes stay bit for bit, and a rank that dies fails its replay and leaves the next one a fresh pool. (A Ray
node's pool starts fresh ranks: tests/launch/test_multinode_integration.py.)"""

from __future__ import annotations

import pytest

from replay.errors import ReplayError
from replay.launch.pool import RankPool
from replay.processes import descendants
from replay.replayer.replays import ReplayRequest, run
from replay.store import RunStore
from replay.store.overrides import Overrides
from replay.store.verification import STATE


def test_replays_on_warm_ranks_are_bit_for_bit_one_after_another(store_copy):
    with RankPool(2) as pool:
        # counterfactuals first (another attention function registered with transformers, a scoped update):
        # nothing of them may carry over into the plain windows after them
        for overrides in (Overrides(attention="fa2-emu:br=16,bc=16", layers=[1]),
                          Overrides(lr_scale=0.5, units=[[1, 0]])):
            changed = run(store_copy, ReplayRequest(12, 14, overrides=overrides), ranks=pool)
            v = changed.verification   # on the state after every update (its digests), not on the losses only
            assert changed.created and not v.bitwise and v.level == STATE, v
            assert v.divergence is not None and v.divergence.step == 12 and v.divergence.state is not None, v
        pids = [p.pid for p in pool._procs]
        for start, stop in [(13, 19), (20, 25), (12, 14)]:
            plain = run(store_copy, ReplayRequest(start, stop), ranks=pool)
            assert plain.created and plain.verification.bitwise, (start, stop, plain.verification)
        assert [p.pid for p in pool._procs] == pids   # the same processes served every replay
        assert pool._own_forks is not None and set(pids) <= set(descendants(pool._own_forks.pid))   # forked


def test_a_rank_that_dies_fails_the_replay_and_the_next_starts_a_fresh_pool(store_copy, monkeypatch):
    monkeypatch.setenv("REPLAY_FAULT", "shard-half:15:1")   # rank 1 SIGKILLed writing the final checkpoint
    with RankPool(2) as pool:
        with pytest.raises(ReplayError, match=r"rank 1 died \(exit code -9\)"):
            run(store_copy, ReplayRequest(12, 14), ranks=pool)
        assert not pool.alive and not pool._procs
        monkeypatch.delenv("REPLAY_FAULT")
        again = run(store_copy, ReplayRequest(12, 14, resume=True), ranks=pool)
        assert again.created and again.verification.bitwise
        assert RunStore.open(again.location).manifest.status == "complete"
