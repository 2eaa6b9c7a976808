"""Runs recorded on two nodes (two torchrun agents on this machine, a c10d rendezvous), replayed and bisected
on a real two-node Ray cluster (a head and a second node, each with its own raylet and resources): ranks on
placement groups with the recorded layout, a node's raylet killed in the middle of a replay and of a probe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from replay.processes import alive, descendants
from replay.store import RunStore
from tests.bisect.planted import RECORD_ARGS, plant_degenerate_samples
from tests.conftest import REPO, error_line, replay_cli, tree_snapshot
from tests.twonodes import ray_two_nodes, torchrun_two_nodes

SPIKE, POSITIONS = 37, [1, 6]
NANOGPT = REPO / "examples" / "nanogpt"


@pytest.fixture(scope="module")
def cluster():
    c = ray_two_nodes()
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory) -> tuple[Path, list[int]]:
    """The built-in trainer on two nodes, two samples of random tokens planted at step 37: a real spike."""
    root = tmp_path_factory.mktemp("two-nodes")
    ids = plant_degenerate_samples(root / "train.bin", SPIKE, POSITIONS)
    args = list(RECORD_ARGS)
    del args[args.index("--nproc"):args.index("--nproc") + 2]   # the agents say how many ranks
    torchrun_two_nodes("-m", "replay", "record", "--store", str(root / "run"), "--data", str(root / "train.bin"),
                       *args, "--set", "threads=1")
    return root / "run", ids


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return replay_cli(*args, timeout=timeout, process=True)


def _pause_in(args: list[str], marks: Path, step: int) -> subprocess.Popen:
    """`replay ARGS` in a process of its own, once both ranks are paused inside checkpoint `step`."""
    env = {**os.environ, "REPLAY_FAULT": f"shard-pause:{step}:0,shard-pause:{step}:1", "REPLAY_FAULT_ONCE": str(marks)}
    command = subprocess.Popen([sys.executable, "-m", "replay", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (marks / "paused").exists():
        if command.poll() is not None or time.monotonic() > deadline:
            command.kill()
            raise AssertionError(command.communicate()[1])
        time.sleep(0.1)
    return command


def _rank_processes(cluster) -> dict[int, int]:
    """The rank actors on the cluster's nodes, and their ranks."""
    from ray._private import ray_constants

    raylet = ray_constants.PROCESS_TYPE_RAYLET
    raylets = [node.all_processes[raylet][0].process.pid for node in cluster.list_all_nodes()]
    return {pid: start for r in raylets for pid, start in descendants(r).items() if _ours(pid)}


def _kill_raylet(node) -> None:
    """SIGKILL a node's raylet, and wait for what it ran (the Ray workers, their ranks) to go with it."""
    from ray._private import ray_constants

    raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process
    ours = {pid: start for pid, start in descendants(raylet.pid).items() if _ours(pid)}
    raylet.kill()
    deadline = time.monotonic() + 30
    while any(alive(pid, start) for pid, start in ours.items()):
        assert time.monotonic() < deadline, "the node's workers outlived its raylet"
        time.sleep(0.1)


def _ours(pid: int) -> bool:
    """A rank actor or one of its ranks."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"NodeRanks" in command or b"replay.launch.worker" in command


def test_a_two_node_recording_replays_bit_for_bit_on_nodes_as_recorded(two_node_run, cluster):
    store, _ = two_node_run
    recorded = RunStore.open(store)   # each agent's process a rank; rank 0 prepared the store for both
    assert recorded.manifest.world_size == 2 and recorded.manifest.status == "complete" and recorded.n_steps == 48
    assert [c.step for c in recorded.checkpoints()] == [0, 10, 20, 30, 40, 48]
    ids = recorded.read_steps()["sample_ids"]
    assert ids.shape == (48, 2, 1, 4) and len(np.unique(ids)) == ids.size
    placement = recorded.manifest.placement
    assert placement is not None and len(placement.nodes) == 2 and sorted(placement.rank_nodes) == [0, 1]
    assert "nodes       2: " in replay_cli("info", str(store)).stdout

    result = _cli("run", str(store), "--from", "30", "--to", "33", "--verify", "--ray-address", cluster.address,
                  "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["verification"]["bitwise"] and out["verification"]["steps"] == [30, 33]
    replayed = RunStore.open(out["replay"]).manifest.placement
    cluster_nodes = {node.node_id for node in cluster.list_all_nodes()}
    ran_on = {name.rpartition("/")[2] for name in replayed.nodes}
    assert len(replayed.nodes) == 2 and replayed.rank_nodes == placement.rank_nodes
    assert all(any(node.startswith(short) for node in cluster_nodes) for short in ran_on)   # two distinct Ray nodes


def test_a_nanogpt_script_recorded_on_two_nodes_replays_on_the_cluster_and_not_without_it(cluster, tmp_path):
    data = tmp_path / "data"
    done = subprocess.run([sys.executable, str(NANOGPT / "prepare.py"), "--out", str(data), "--bytes", "100000"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    store = tmp_path / "run"
    torchrun_two_nodes(str(NANOGPT / "train.py"), f"--data_dir={data}", f"--store={store}", "--max_iters=12",
                       "--checkpoint_every=4", cwd=tmp_path)
    m = RunStore.open(store).manifest
    assert m.command.launcher == "torchrun" and len(m.placement.nodes) == 2

    refused = error_line(_cli("run", str(store), "--from", "4", "--to", "7"))
    assert "2 nodes" in refused and "--ray-address" in refused
    assert not (store / "replays").exists()

    result = _cli("run", str(store), "--from", "4", "--to", "7", "--verify", "--ray-address", cluster.address, "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["verification"]["bitwise"] and out["verification"]["steps"] == [4, 7]
    assert len(RunStore.open(out["replay"]).manifest.placement.nodes) == 2


def test_bisect_probes_on_placement_groups_retry_a_probe_whose_node_is_lost(two_node_run, cluster, tmp_path):
    """The data bisect of the two-node run, its probes on placement groups with the recorded layout; the
    first probe loses a node half-way through its checkpoint, and runs again on a new group once the
    cluster has a second node again. The answer is the planted samples."""
    store, planted = two_node_run
    bisect = _pause_in(["bisect", str(store), "--by", "data", "--json", "--ray-address", cluster.address], tmp_path, 48)
    try:
        worker = next(iter(cluster.worker_nodes))
        _kill_raylet(worker)
        cluster.remove_node(worker, allow_graceful=False)
        (tmp_path / "go").touch()
        cluster.add_node(num_cpus=2)
        out, err = bisect.communicate(timeout=300)
    finally:
        bisect.kill()
    assert bisect.returncode == 0, err
    session = json.loads(out)
    assert session["verdict"]["samples"] == [[SPIKE, i] for i in planted]
    retried = [p for p in session["probes"].values() if "retried_after" in p]
    # the probe paused in checkpoint 48 (the baseline or a data probe, whichever got there first), with any
    # probe beside it on the lost node
    assert retried and all("lost node" in p["retried_after"] for p in retried)
    assert "probes run on 2 Ray worker(s), each on a placement group of its own" in err   # two groups at once


def test_a_node_lost_mid_replay_fails_it_in_one_line_and_a_packed_rerun_completes(two_node_run, cluster, tmp_path):
    """Both ranks pause while writing the replay's end checkpoint; the second node's raylet is killed (its
    rank dies with it), then the pause ends. The replay names the node and keeps nothing of itself; run
    again it says the layout no longer fits, and with --pack it completes bit for bit on the node left."""
    store, _ = two_node_run
    before = tree_snapshot(store)
    args = ["run", str(store), "--from", "30", "--to", "33", "--name", "lost", "--verify",
            "--ray-address", cluster.address]
    replay = _pause_in(args, tmp_path, 34)
    try:
        worker = next(iter(cluster.worker_nodes))
        _kill_raylet(worker)
        (tmp_path / "go").touch()
        _, err = replay.communicate(timeout=180)
    finally:
        replay.kill()
    line = error_line(subprocess.CompletedProcess(args, replay.returncode, "", err))
    assert "lost node" in line and worker.node_ip_address in line and "rank(s) " in line
    assert "nothing of it is kept" in line
    assert not (store / "replays" / "lost").exists()
    assert {k: v for k, v in tree_snapshot(store).items() if not k.startswith("replays/")} == \
        {k: v for k, v in before.items() if not k.startswith("replays/")}

    no_room = error_line(_cli(*args))   # one node left: the recorded layout does not fit, and says so at once
    assert "no room" in no_room and "--pack" in no_room
    assert not (store / "replays" / "lost").exists()

    packed = _cli(*args, "--pack", "--json")   # as the line says: the ranks share the node left
    assert packed.returncode == 0, packed.stderr
    out = json.loads(packed.stdout)
    assert out["verification"]["bitwise"] and len(RunStore.open(out["replay"]).manifest.placement.nodes) == 1
    cluster.remove_node(worker, allow_graceful=False)


def test_every_rank_dies_with_the_replay_that_started_it(two_node_run, cluster, tmp_path):
    """SIGKILL of `replay run` in the middle of a cluster replay: the cluster ends its job, the job's actors
    go, and their ranks follow them. (Last here: the killed command's lease stays behind, for the next
    writer to take over.)"""
    store, _ = two_node_run
    before = set(_rank_processes(cluster))
    replay = _pause_in(["run", str(store), "--from", "30", "--to", "33", "--name", "orphaned", "--pack",
                        "--ray-address", cluster.address], tmp_path, 34)
    started = {pid: start for pid, start in _rank_processes(cluster).items() if pid not in before}
    assert len(started) >= 4   # two actors, two ranks
    replay.kill()
    replay.wait()
    deadline = time.monotonic() + 60
    while any(alive(pid, start) for pid, start in started.items()):
        assert time.monotonic() < deadline, "a rank outlived the replay that started it"
        time.sleep(0.2)
