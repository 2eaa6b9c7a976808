"""Ranks forked from a fork server (launch/forkserver.py): replays on them are bit for bit the record, each job
in new ranks of the same server; a rank's own error reaches this process's stderr and its exit code or signal
the failure, as a fresh rank's do. (That they die with the command: test_lifeline_integration.py.)"""

from __future__ import annotations

import json

import pytest

from replay.errors import ReplayError
from replay.launch.forkserver import ForkServer
from replay.launch.job import RankJob
from replay.processes import descendants
from replay.replayer.replays import ReplayRequest, run
from replay.store import RunStore
from replay.store.location import Location
from replay.store.overrides import Overrides
from replay.store.verification import STATE


def test_replays_forked_from_one_server_are_bit_for_bit_each_in_new_ranks(store_copy):
    with ForkServer() as server:
        assert server.wait_ready(), server.refused   # it imported, and is one thread: it forks
        plain = run(store_copy, ReplayRequest(12, 14), ranks=server)
        assert plain.created and plain.verification.bitwise, plain.verification
        first_ranks = server.forked
        # a counterfactual in between (another attention function registered with transformers): nothing of it
        # may reach the ranks forked after it
        changed = run(store_copy, ReplayRequest(12, 14, overrides=Overrides(attention="fa2-emu:br=16,bc=16",
                                                                            layers=[1])), ranks=server)
        v = changed.verification
        assert not v.bitwise and v.level == STATE and v.divergence.step == 12, v
        again = run(store_copy, ReplayRequest(13, 19), ranks=server)
        assert again.created and again.verification.bitwise, again.verification
        assert len(server.forked) == 2 and not set(server.forked) & set(first_ranks)   # new ranks for every job
        assert server.alive and not descendants(server.pid)   # the server outlives its jobs; no rank does


def test_a_forked_ranks_own_error_and_exit_code_reach_this_process(store_copy, capfd):
    lease = json.dumps({"file": str(store_copy / "no-such-lease"), "token": "t"})
    with ForkServer() as server:
        with pytest.raises(ReplayError, match=r"^rank \d exited with code 2, then rank \d exited with code 2; their "
                                              "own messages are above"):
            server.run(RankJob(Location.parse(store_copy), lease, False, 2))
        err = capfd.readouterr().err
        for rank in (0, 1):   # each printed its own line, as a fresh rank does, to this process's stderr
            assert f"rank {rank}: the lease this process writes under ({store_copy / 'no-such-lease'}) is no " \
                   "longer held" in err, err


def test_a_forked_rank_killed_fails_the_replay_and_the_next_resumes_on_the_same_server(store_copy, monkeypatch):
    monkeypatch.setenv("REPLAY_FAULT", "shard-half:15:1")   # rank 1 SIGKILLed writing the final checkpoint
    with ForkServer() as server:
        with pytest.raises(ReplayError, match=r"^rank 1 was killed by signal 9 \(SIGKILL\)"):
            run(store_copy, ReplayRequest(12, 14), ranks=server)
        monkeypatch.delenv("REPLAY_FAULT")
        pid = server.pid
        again = run(store_copy, ReplayRequest(12, 14, resume=True), ranks=server)
        assert again.created and again.verification.bitwise, again.verification
        assert RunStore.open(again.location).manifest.status == "complete" and server.pid == pid
