"""Two nodes on this machine: for recordings, two torchrun agents meeting at a c10d rendezvous; for
replays, a Ray cluster of a head and a second node, each with a raylet and resources of its own. Used by
tests/launch/test_multinode_integration.py and benchmarks/bench_multinode.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from replay.launch.local import free_port
from replay.launch.ray_cluster import SYSTEM_CONFIG

REPO = Path(__file__).resolve().parents[1]


def torchrun_two_nodes(*args: str, cwd: Path = REPO, timeout: float = 300) -> None:
    """`torchrun --nnodes 2` twice, each agent standing for a node with one rank."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                                "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-id", "two-nodes",
                                "--rdzv-endpoint", f"127.0.0.1:{port}", *args],
                               cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for node in (0, 1)]
    try:
        outputs = [a.communicate(timeout=timeout)[0] for a in agents]
    finally:
        for a in agents:
            a.kill()
    if any(a.returncode for a in agents):
        raise RuntimeError("torchrun on two nodes failed:\n" + "\n".join(outputs))


def ray_two_nodes(cpus: int = 2) -> Any:
    """A started ray.cluster_utils.Cluster: a head and a second node of `cpus` CPUs each, whose head declares a
    node dead ~3 s after its raylet stops answering. Shut it down with `.shutdown()`."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False, head_node_args={
        "num_cpus": cpus, "include_dashboard": False,
        "_system_config": {**SYSTEM_CONFIG, "health_check_period_ms": 1000, "health_check_failure_threshold": 3}})
    cluster.add_node(num_cpus=cpus)
    cluster.wait_for_nodes(timeout=120)
    return cluster
