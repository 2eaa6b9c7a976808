"""The lease's logic (store/lease.py) in this process, in milliseconds: holders that are real processes of
this machine (this one, its parent, a pid no process can have, or this pid with another start time, which is
what a reused pid looks like), their lease files written as a holder writes them. Holders that are other
processes, holding and dying: test_lease_integration.py."""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from replay.errors import StoreError
from replay.processes import start_time
from replay.store.lease import Holder, Lease, current_spec, holder_of, lease_file, require, writing


def _no_such_pid() -> int:
    """A pid above the kernel's limit: no process has it, now or later."""
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


def _living_holder(store: Path, scope: str = "run") -> Holder:
    holder = holder_of(store, scope)
    assert holder is not None, f"nobody living holds {lease_file(store, scope)}"
    return holder


def _written_by(store: Path, pid: int, start: int | None, host: str | None = None, scope: str = "run",
                heartbeat_age: float = 0.0) -> Holder:
    """The lease file a holder `pid` (started at `start`) would have written; its heartbeat `heartbeat_age` old."""
    holder = Holder(command="replay record", pid=pid, host=host or socket.gethostname(), since=time.time() - 60,
                    token=f"{pid:032x}"[-32:], start=start)
    path = lease_file(store, scope)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(holder)))
    beat = time.time() - heartbeat_age
    os.utime(path, (beat, beat))
    return holder


def test_a_living_holder_on_this_host_refuses_a_second_writer_and_keeps_its_lease(tmp_path):
    parent = os.getppid()
    holder = _written_by(tmp_path, parent, start_time(parent))
    before = lease_file(tmp_path).read_bytes()
    with pytest.raises(StoreError, match=rf"is being written by `replay record` \(pid {parent} on "
                                         rf"{socket.gethostname()} since .*: wait for it or stop it$"):
        Lease.acquire(tmp_path, "replay run")
    assert lease_file(tmp_path).read_bytes() == before
    assert holder_of(tmp_path) == holder


@pytest.mark.parametrize("gone", ["pid-not-running", "pid-reused"])
def test_a_dead_holder_on_this_host_is_taken_over_and_reported(tmp_path, gone):
    mine = start_time(os.getpid())
    assert mine is not None
    pid, start = (_no_such_pid(), 1) if gone == "pid-not-running" else (os.getpid(), mine + 1)
    dead = _written_by(tmp_path, pid, start)
    assert holder_of(tmp_path) is None
    notes: list[str] = []
    with Lease.acquire(tmp_path, "replay record --resume", report=notes.append) as lease:
        assert notes == [f"{tmp_path}: took over the lease of {dead.describe()}, which is no longer running"]
        on_disk = json.loads(lease_file(tmp_path).read_text())
        assert on_disk["token"] == lease.token != dead.token and on_disk["pid"] == os.getpid()
        assert on_disk["took_over"] == asdict(dead)
        assert _living_holder(tmp_path).token == lease.token
    assert not (tmp_path / "leases").exists()


def test_a_heartbeat_older_than_the_timeout_is_what_makes_a_holder_on_another_host_dead(tmp_path, monkeypatch):
    monkeypatch.setenv("REPLAY_LEASE_TIMEOUT", "30")
    fresh = _written_by(tmp_path, 4242, 99, host="node-b", heartbeat_age=29)
    assert holder_of(tmp_path) == fresh
    with pytest.raises(StoreError, match=r"pid 4242 on node-b since .*; last heartbeat 29 s ago: wait for it"):
        Lease.acquire(tmp_path, "replay run")
    _written_by(tmp_path, 4242, 99, host="node-b", heartbeat_age=31)
    assert holder_of(tmp_path) is None
    notes: list[str] = []
    with Lease.acquire(tmp_path, "replay run", report=notes.append):
        assert notes[0].endswith("which is no longer running (no heartbeat for 31 s)")


def test_a_takeover_left_half_done_by_a_dead_process_does_not_block_the_next(tmp_path):
    dead = _written_by(tmp_path, _no_such_pid(), 1)
    marker = lease_file(tmp_path).with_name(f"run.json.takeover-{dead.token}")
    marker.write_text(json.dumps(asdict(Holder("replay run", _no_such_pid(), socket.gethostname(), 0.0, "e" * 32, 1))))
    with Lease.acquire(tmp_path, "replay record", report=lambda _: None) as lease:
        assert lease.holder.took_over is not None and lease.holder.took_over["token"] == dead.token
        assert not marker.exists()


def test_a_damaged_lease_file_is_named_and_left_alone(tmp_path):
    path = lease_file(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text('{"command": "replay rec')
    with pytest.raises(StoreError, match=f"the lease file {path} is damaged .*if no command is writing the store, "
                                         "delete it"):
        Lease.acquire(tmp_path, "replay run")
    assert path.read_text() == '{"command": "replay rec'


def test_release_counts_the_acquisitions_of_this_process(tmp_path):
    outer = Lease.acquire(tmp_path, "replay demo")
    inner = Lease.acquire(tmp_path, "replay record")
    assert inner is outer
    inner.release()
    assert _living_holder(tmp_path).token == outer.token
    outer.release()
    assert holder_of(tmp_path) is None and not (tmp_path / "leases").exists()
    again = Lease.acquire(tmp_path, "replay run")
    assert again is not outer and again.token != outer.token
    again.release()


def test_a_child_writes_only_while_its_holders_lease_is_held_with_that_token(tmp_path):
    with pytest.raises(StoreError, match=f"nobody holds the lease of {tmp_path}: its writer is gone"):
        current_spec(tmp_path)
    lease = Lease.acquire(tmp_path, "replay record")
    spec = lease.spec
    assert json.loads(current_spec(tmp_path)) == json.loads(spec) == {"file": str(lease.path), "token": lease.token}
    require(spec)
    lease.release()
    with pytest.raises(StoreError, match=r"\(.*run\.json\) is no longer held: the command that started it is gone"):
        require(spec)


def test_a_holder_that_lost_its_file_stops_at_its_next_check(tmp_path):
    lease = Lease.acquire(tmp_path, "replay record")
    try:
        lease.check()
        lease.path.unlink()
        with pytest.raises(StoreError, match="lost its lease to nobody \\(the lease file was removed\\)"):
            lease.check()
    finally:
        lease.release()


def test_writing_a_replay_holds_the_runs_lease_and_the_replays_own(tmp_path):
    (tmp_path / "zarr.json").write_text("{}")   # what makes tmp_path a run store for `writing`
    replay = tmp_path / "replays" / "steps-3-4"
    with writing(replay, "replay run") as lease:
        assert lease.path == lease_file(tmp_path, "replays/steps-3-4")
        assert _living_holder(tmp_path).pid == _living_holder(tmp_path, "replays/steps-3-4").pid == os.getpid()
    assert holder_of(tmp_path) is None and holder_of(tmp_path, "replays/steps-3-4") is None


def test_a_helper_writing_under_a_lease_that_is_gone_is_refused_before_taking_anything(tmp_path):
    lease = Lease.acquire(tmp_path, "replay bisect")
    spec = lease.spec
    lease.release()
    with pytest.raises(StoreError, match="is no longer held"):
        with writing(tmp_path, "probe", under=spec):
            pass
    assert not (tmp_path / "leases").exists()


def test_the_holder_heartbeats_and_a_takeover_is_noticed(tmp_path, monkeypatch):
    monkeypatch.setenv("REPLAY_LEASE_TIMEOUT", "0.6")   # heartbeat every 0.1 s
    lease = Lease.acquire(tmp_path, "replay record")
    try:
        before = os.stat(lease.path).st_mtime
        time.sleep(0.35)
        assert os.stat(lease.path).st_mtime > before
        lease.check()
        # The holder is considered dead by a process on another host (say it was frozen): a new lease
        # replaces its file. Its next check refuses to go on writing.
        os.unlink(lease.path)
        _written_by(tmp_path, 4242, 123, host="node-b")
        with pytest.raises(StoreError, match="lost its lease to `replay record` \\(pid 4242 on node-b"):
            lease.check()
        with pytest.raises(StoreError, match="is now held by `replay record` \\(pid 4242 on node-b"):
            require(lease.spec)
    finally:
        lease.release()
    assert lease_file(tmp_path).exists()   # not its own any more: left alone


def test_a_lease_on_a_new_directory_leaves_nothing_behind(tmp_path):
    store = tmp_path / "new"
    lease = Lease.acquire(store, "replay record")
    assert lease_file(store).exists()
    lease.release()
    assert not store.exists()


def test_replays_have_leases_of_their_own(tmp_path):
    with Lease.acquire(tmp_path, "replay bisect"):
        a = Lease.acquire(tmp_path, "probe a", scope="replays/steps-1-2")
        b = Lease.acquire(tmp_path, "probe b", scope="replays/steps-3-4")
        assert a is not b and a.path != b.path and lease_file(tmp_path).exists()
        a.release(), b.release()
        assert not (tmp_path / "leases" / "replays").exists()
