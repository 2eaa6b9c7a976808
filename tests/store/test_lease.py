"""The store's lease (store/lease.py): one writer at a time, with real processes holding and dying."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from replay.errors import StoreError
from replay.store.lease import Lease, holder_of, lease_file, require

HOLD = """
import sys, time
from replay.store.lease import Lease
lease = Lease.acquire(sys.argv[1], "a test holder")
print(lease.token, flush=True)
time.sleep(600)
"""


def _holder_process(store) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(store)], stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def _foreign_lease(store, heartbeat_age: float) -> dict:
    """A lease written by a process on another host (as a shared filesystem would show it)."""
    path = lease_file(store)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"command": "replay record", "pid": 4242, "host": "node-b", "since": time.time() - 3600,
           "token": "f" * 32, "start": 123}
    path.write_text(json.dumps(doc))
    beat = time.time() - heartbeat_age
    os.utime(path, (beat, beat))
    return doc


@pytest.mark.integration   # starts processes
def test_a_second_writer_is_refused_with_the_holder_named(tmp_path):
    proc, token = _holder_process(tmp_path)
    try:
        with pytest.raises(StoreError) as e:
            Lease.acquire(tmp_path, "replay run")
        message = str(e.value)
        assert f"is being written by `a test holder` (pid {proc.pid} on {socket.gethostname()} since" in message
        assert message.endswith("wait for it or stop it")
        assert holder_of(tmp_path).token == token
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.integration   # starts processes
def test_a_dead_holder_on_this_host_is_taken_over_and_reported(tmp_path):
    proc, token = _holder_process(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    notes = []
    with Lease.acquire(tmp_path, "replay record --resume", report=notes.append) as lease:
        assert len(notes) == 1 and f"took over the lease of `a test holder` (pid {proc.pid}" in notes[0]
        assert "no longer running" in notes[0]
        assert lease.holder.took_over["token"] == token
        assert json.loads(lease_file(tmp_path).read_text())["took_over"]["pid"] == proc.pid
    assert not lease_file(tmp_path).exists() and not (tmp_path / "leases").exists()


def test_another_host_with_a_fresh_heartbeat_holds_it(tmp_path):
    _foreign_lease(tmp_path, heartbeat_age=5)
    with pytest.raises(StoreError, match=r"`replay record` \(pid 4242 on node-b since .*last heartbeat 5 s ago"):
        Lease.acquire(tmp_path, "replay bisect")


def test_another_host_without_a_heartbeat_for_the_timeout_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.setenv("REPLAY_LEASE_TIMEOUT", "30")
    _foreign_lease(tmp_path, heartbeat_age=31)
    notes = []
    with Lease.acquire(tmp_path, "replay analyze", report=notes.append) as lease:
        assert "pid 4242 on node-b" in notes[0] and "(no heartbeat for 31 s)" in notes[0]
        assert lease.holder.took_over["host"] == "node-b"


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
        _foreign_lease(tmp_path, heartbeat_age=0)
        with pytest.raises(StoreError, match="lost its lease to `replay record` \\(pid 4242 on node-b"):
            lease.check()
        with pytest.raises(StoreError, match="is now held by `replay record` \\(pid 4242 on node-b"):
            require(lease.spec)
    finally:
        lease.release()
    assert lease_file(tmp_path).exists()   # not its own any more: left alone


@pytest.mark.integration   # starts processes
def test_many_processes_taking_over_one_dead_lease_leave_exactly_one_holder(tmp_path):
    _foreign_lease(tmp_path, heartbeat_age=3600)
    race = """
import sys, time
from replay.errors import StoreError
from replay.store.lease import Lease
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
try:
    Lease.acquire(sys.argv[1], "racer", report=lambda m: None)
    print("won", flush=True)
    sys.stdin.read()   # held until every racer has answered
except StoreError as e:
    print("refused", flush=True)
"""
    go = time.time() + 2.0   # they all start at once, after their imports
    procs = [subprocess.Popen([sys.executable, "-c", race, str(tmp_path), str(go)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(6)]
    answers = [p.stdout.readline().strip() for p in procs]
    for p in procs:
        p.communicate(timeout=60)
    assert sorted(answers) == ["refused"] * 5 + ["won"], answers


def test_the_same_process_takes_its_own_lease_again(tmp_path):
    with Lease.acquire(tmp_path, "replay demo") as outer:
        with Lease.acquire(tmp_path, "replay record") as inner:
            assert inner is outer
        outer.check()
        assert lease_file(tmp_path).exists()
    assert not lease_file(tmp_path).exists()


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
