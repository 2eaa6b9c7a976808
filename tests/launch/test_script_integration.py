"""A user's script kept up between replays (launch/script.py `ScriptServer`, recorder/serving.py): the
examples' nanoGPT script (one process) recorded, then replays handed to its running process one after another,
each compared bit for bit with the record or with the same replay started afresh; a script that keeps state of
its own is found out by its state after a step and started afresh; its ranks die with the process keeping them."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from replay.launch.script import ScriptRanks, ScriptServer
from replay.replayer.replays import ReplayRequest, run
from replay.store import RunStore
from replay.store.overrides import Overrides
from tests.conftest import REPO, assert_gone, error_line, replay_cli, tensors_equal, wait_for_descendants

EXAMPLE = REPO / "examples" / "nanogpt"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
FIELDS = ["sample_ids", "loss", "grad_norm", "lr", "state_digest"]
# a plain window, a counterfactual, then a plain window after it (the running script's state was the counterfactual's)
REQUESTS = [ReplayRequest(8, 12), ReplayRequest(5, 10, overrides=Overrides(lr_scale=0.5)), ReplayRequest(12, 15)]
# a window that skips the step of its checkpoint: what the script draws ahead of its first step is the next step's
SKIPPING = ReplayRequest(8, 10, overrides=Overrides(skip=[8]))


def _stateful(script: Path) -> Path:
    """The example with a counter of its own that sets the learning rate: right after a fresh start (it starts
    from the loop's first step), wrong in a script kept up (it goes on counting from the last replay)."""
    text = EXAMPLE.joinpath("train.py").read_text()
    text = text.replace("with loop if record else nullcontext():",
                        "tokens_seen = None\nwith loop if record else nullcontext():")
    text = text.replace("        lr = get_lr(iter_num)\n",
                        "        if tokens_seen is None:\n            tokens_seen = iter_num * batch_size\n"
                        "        lr = get_lr(tokens_seen // batch_size)\n        tokens_seen += batch_size\n")
    assert "tokens_seen += batch_size" in text, "the example's learning-rate line moved: update this test"
    script.write_text(text)
    return script


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict[str, Path]:
    """The example and its stateful variant, each recorded for 16 steps with checkpoints every 4."""
    root = tmp_path_factory.mktemp("served")
    subprocess.run([sys.executable, str(EXAMPLE / "prepare.py"), "--out", str(root / "data"), "--bytes", "100000"],
                   check=True, capture_output=True)
    stores = {}
    for name, script in (("example", EXAMPLE / "train.py"), ("stateful", _stateful(root / "stateful.py"))):
        stores[name] = root / name
        done = subprocess.run([sys.executable, str(script), f"--data_dir={root / 'data'}", f"--store={stores[name]}",
                               "--max_iters=16", "--checkpoint_every=4"], cwd=root, env=ENV, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    return stores


def _copy(store: Path, to: Path) -> Path:
    shutil.copytree(store, to)
    return to


def _same_replays(a: Path, b: Path) -> None:
    """Two replays of the same request: every step's record and their last checkpoint, bit for bit."""
    x, y = RunStore.open(a), RunStore.open(b)
    assert x.manifest.status == y.manifest.status == "complete"
    rx, ry = x.read_steps(FIELDS), y.read_steps(FIELDS)
    assert rx["step"].tolist() == ry["step"].tolist()
    assert [f for f in FIELDS if rx[f].shape != ry[f].shape or rx[f].tobytes() != ry[f].tobytes()] == []   # NaN too
    last = x.checkpoints()[-1].step
    assert last == y.checkpoints()[-1].step
    assert tensors_equal(x.read_shard(last, 0)["state"], y.read_shard(last, 0)["state"])


def test_replays_handed_to_the_running_script_equal_fresh_starts(recorded, tmp_path):
    """The plain windows equal the record at the level of the state (so, a fresh start); the counterfactuals, which
    no record holds, equal their fresh starts bit for bit; the plain window after one is untouched by it."""
    served, fresh = _copy(recorded["example"], tmp_path / "served"), _copy(recorded["example"], tmp_path / "fresh")
    command = RunStore.open(served).manifest.command
    with ScriptServer(command) as server:
        pids = []
        results = []
        for req in [*REQUESTS, SKIPPING]:
            results.append(run(served, req, ranks=server))
            pids.append(server.pids)
            assert server.refused is None
    assert len(set(map(tuple, pids))) == 1 and len(pids[0]) == 1   # one process served all four
    assert [r.verification.bitwise for r in results[:3]] == [True, False, True]
    assert all(r.verification.level == "state" for r in results)
    assert results[1].verification.divergence.step == 5   # the counterfactual's first step
    for req, result in ((REQUESTS[1], results[1]), (SKIPPING, results[3])):
        _same_replays(result.location, run(fresh, req, ranks=ScriptRanks(command)).location)


def test_a_script_keeping_state_of_its_own_is_started_afresh_and_said(recorded, tmp_path):
    served = _copy(recorded["stateful"], tmp_path / "served")
    command = RunStore.open(served).manifest.command
    with ScriptServer(command) as server:
        first = run(served, REQUESTS[0], ranks=server)    # the script's first replay: a fresh start
        assert server.refused is None and first.verification.bitwise
        kept = server.pids
        second = run(served, ReplayRequest(4, 6), ranks=server)
        assert "state of its own" in server.refused and "after step 4" in server.refused
        assert second.verification.bitwise and second.verification.level == "state"   # run on a fresh start
        third = run(served, REQUESTS[2], ranks=server)   # every later replay starts it afresh too
        assert server.refused is None and server.pids == [] and third.verification.bitwise
    assert kept and not any(_cmd(pid) for pid in kept)


def _cmd(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


KEEPER = """
import sys, time
from replay.launch.script import ScriptServer
from replay.replayer.replays import ReplayRequest, run
from replay.store import RunStore
server = ScriptServer(RunStore.open(sys.argv[1]).manifest.command)
run(sys.argv[1], ReplayRequest(8, 12), ranks=server)
print("served", flush=True)
time.sleep(600)
"""


def test_the_running_script_dies_with_the_process_that_keeps_it(recorded, tmp_path):
    store = _copy(recorded["example"], tmp_path / "run")
    keeper = subprocess.Popen([sys.executable, "-c", KEEPER, str(store)], env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        assert keeper.stdout.readline().strip() == "served"   # the script now waits for its next replay
        # the script's rank: a fresh process, or one forked from the script's fork server (its command line)
        found = wait_for_descendants(keeper.pid, lambda cmds: any("train.py" in c for c in cmds)
                                     or sum("replay.launch.forkserver" in c for c in cmds) >= 2)
        os.kill(keeper.pid, signal.SIGKILL)
        keeper.wait()
        assert_gone(found, within=2.0)
    finally:
        keeper.kill()


def test_a_script_rank_failing_on_a_full_disk_is_named_in_the_commands_one_line(recorded, small_disk):
    """The rank's own error (replay's: the disk is full) reaches the launcher over its pipe, so the `replay run`
    line says what happened, not only that a rank exited."""
    disk = small_disk(16 * 1024)
    store = _copy(recorded["example"], disk.path / "run")
    disk.fill(64)
    result = replay_cli("run", str(store), "--from", "8", "--to", "12")
    assert result.returncode == 2
    assert error_line(result).startswith("error: the training script failed: rank 0: cannot write") \
        and "no space left" in error_line(result), result.stderr
