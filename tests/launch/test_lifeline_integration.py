"""Every process the tool starts dies with the process that started it (lifeline.py): real SIGKILLs,
then every process of that run is checked by pid (and start time, so a reused pid cannot pass)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from replay.store import RunStore
from tests.conftest import REPO, assert_gone, wait_for_descendants


def _start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A `replay` command in its own process group (so that the test can kill the group)."""
    return subprocess.Popen([sys.executable, "-m", "replay", *args], cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})})


def _ranks(n: int):
    return lambda cmdlines: sum("replay.launch.worker" in c for c in cmdlines) >= n


def _forked(n: int):
    """A fork server (launch/forkserver.py) and `n` ranks forked from it (which show the server's command line)."""
    return lambda cmdlines: sum("replay.launch.forkserver" in c for c in cmdlines) >= n + 1


def _server(cmdlines: list[str]) -> bool:
    return any("replay.launch.forkserver" in c for c in cmdlines)


# How each kind of local rank starts: fresh processes (REPLAY_RANKS=fresh), or forked from the command's fork
# server (the default), killed while the server imports (no rank yet) or while its ranks train.
STARTS = {"fresh": ({"REPLAY_RANKS": "fresh"}, _ranks(2)), "forked": ({}, _forked(2))}


def _kill_alone(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


# The whole process group killed: tests/launch/test_soak_integration.py, whose every kill checks that nothing is left.
@pytest.mark.parametrize("start, moment", [("fresh", "start-up"), ("fresh", "training"), ("forked", "start-up"),
                                           ("forked", "training")])
def test_ranks_die_with_their_record_killed_alone(tmp_path, start, moment):
    store = tmp_path / "run"
    env, started = STARTS[start]
    proc = _start("record", "--store", str(store), "--steps", "100000", "--nproc", "2", "--checkpoint-every", "5",
                  env=env)
    try:
        # start-up: fresh ranks are still importing torch; the fork server is, before it forks any rank
        found = wait_for_descendants(proc.pid, started if start == "fresh" else _server)
        if moment == "training":
            while len(RunStore.open(store).checkpoints()) < 2:
                time.sleep(0.05)
                found = wait_for_descendants(proc.pid, started)
        _kill_alone(proc)
        assert_gone(found, within=2.0)
    finally:
        _cleanup(proc)


def test_a_warm_pool_dies_with_the_ray_worker_that_holds_it(ray_local):
    import ray

    from replay.bisect.probes import ProbeWorker

    actor = ray.remote(num_cpus=1)(ProbeWorker).remote(2)
    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
    ranks = wait_for_descendants(pid, _forked(2))   # its pool's fork server and the 2 ranks forked from it
    os.kill(pid, signal.SIGKILL)
    assert_gone(ranks, within=2.0)
    ray.kill(actor)


def test_a_killed_bisect_leaves_no_rank(spike_store, tmp_path):
    """Its 2 ranks fill this machine's 2 cores, so its probes run in its own process (bisect/probes.py LocalProbes)
    on one warm pool; on a machine where more fit, on Ray actors (the test above)."""
    store = tmp_path / "spike"
    shutil.copytree(spike_store, store)
    proc = _start("bisect", str(store), "--fix", "lr-scale=0.5", "--by", "steps", "--workers", "1")
    try:
        found = wait_for_descendants(proc.pid, _forked(2))
        _kill_alone(proc)
        assert_gone(found, within=2.0)
    finally:
        _cleanup(proc)


def test_a_killed_analysis_leaves_no_ray_process(spike_store, tmp_path):
    store = tmp_path / "spike"
    shutil.copytree(spike_store, store)
    proc = _start("analyze", str(store))
    try:
        found = wait_for_descendants(proc.pid, lambda cmds: any("raylet" in c for c in cmds)
                                     and any("Agent" in c for c in cmds))
        _kill_alone(proc)
        assert_gone(found, within=2.0)   # the GCS, raylet, agents and workers of its local cluster
    finally:
        _cleanup(proc)


def _cleanup(proc: subprocess.Popen) -> None:
    """Whatever a failed assertion left behind."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
