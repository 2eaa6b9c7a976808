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
from replay.store.lease import Lease, holder_of, lease_file
from tests.store.test_lease import _written_by

HOLD = """
import sys, time
from replay.store.lease import Lease
lease = Lease.acquire(sys.argv[1], "a test holder")
print(lease.token, flush=True)
time.sleep(600)
"""


def _holder_process(store) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(store)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


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


def test_many_processes_taking_over_one_dead_lease_leave_exactly_one_holder(tmp_path):
    _written_by(tmp_path, 4242, 123, host="node-b", heartbeat_age=3600)
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


CHURN = """
import sys
from replay.store.lease import Lease
from replay.store.location import Location
store, me, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
for i in range(rounds):   # as a bisect's probes do: a replay's own lease taken, its folder made and removed
    lease = Lease.acquire(store, "a probe", scope=f"replays/{me}-{i}")
    replay = Location.parse(store) / "replays" / f"{me}-{i}"
    (replay / "zarr.json").write(b"{}")
    replay.remove_tree()
    lease.release()
print("done", flush=True)
"""


ANALYSE = """
import sys
from replay.store.lease import require
from replay.store.location import Location
store, spec, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
for i in range(rounds):   # as an analysis task does: its lease checked before each write, a retried item redone
    require(spec)
    item = Location.parse(store) / "analysis" / f"item-{i % 5}"
    item.remove_tree()
    (item / "done").write(b"1")
print("done", flush=True)
"""


def test_writers_of_replays_racing_their_leases_and_removals_never_trip_over_each_other(tmp_path):
    """Three processes take and release replay leases and make and remove replays side by side in one store (a
    released lease removes the shared lease folder once empty, while another writer is about to create its
    lease in it), while an analysis task writes and redoes items under the run's lease, checking it before
    each write: every one of them finishes, and the store holds no lease afterwards."""
    (tmp_path / "zarr.json").write_text("{}")
    with Lease.acquire(tmp_path, "replay analyze (a test)") as run_lease:
        procs = [subprocess.Popen([sys.executable, "-c", CHURN, str(tmp_path), f"w{n}", "150"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in range(3)]
        procs.append(subprocess.Popen([sys.executable, "-c", ANALYSE, str(tmp_path), run_lease.spec, "300"],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outcomes = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], [err[-2000:] for _, err in outcomes]
    assert all(out.strip() == "done" for out, _ in outcomes)
    assert sorted(p.name for p in (tmp_path / "analysis").iterdir()) == [f"item-{i}" for i in range(5)]
    assert not (tmp_path / "leases").exists() or not any((tmp_path / "leases").rglob("*.json"))
