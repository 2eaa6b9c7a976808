"""One writer per store, end to end: while `replay record` runs, every other writer is refused with one
line naming it; readers go on; once it is killed, the next writer takes the store over and says so."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from replay.store import RunStore
from tests.conftest import REPO, error_line, replay_cli, tree_snapshot


def test_a_running_recording_is_the_only_writer_and_a_dead_one_is_taken_over(tmp_path):
    store = tmp_path / "k"
    proc = subprocess.Popen([sys.executable, "-m", "replay", "record", "--store", str(store), "--steps", "100000",
                             "--nproc", "2", "--checkpoint-every", "25"], cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not (store / "zarr.json").exists() or len(RunStore.open(store).checkpoints()) < 2:
            assert proc.poll() is None, "the recording ended early"
            time.sleep(0.05)
        holder = f"`replay record` (pid {proc.pid} on {socket.gethostname()} since"
        for args in (["record", "--store", str(store), "--resume"], ["run", str(store), "--from", "0", "--to", "1"],
                     ["analyze", str(store)]):
            line = error_line(replay_cli(*args))
            assert f"{store} is being written by {holder}" in line and line.endswith("wait for it or stop it"), args
        info = replay_cli("info", str(store))
        assert info.returncode == 0 and f"writer      {holder}" in info.stdout
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    before = tree_snapshot(store)
    took_over = replay_cli("run", str(store), "--from", "20", "--to", "21", "--verify")
    assert took_over.returncode == 0, took_over.stderr
    assert f"took over the lease of {holder}" in took_over.stderr and "which is no longer running" in took_over.stderr
    assert "bit for bit" in took_over.stdout
    def data(snapshot):
        return {k: v for k, v in snapshot.items() if not k.startswith(("replays/", "leases/"))}
    assert data(tree_snapshot(store)) == data(before) and not (store / "leases").exists()   # released
