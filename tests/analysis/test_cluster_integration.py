"""Analysis on a real multi-node Ray cluster: a head and a worker node (two raylets) started by the test
on this machine, reached through --ray-address, as a user would reach a cluster; a store on disk and one in
an S3 bucket (tests/s3server.py)."""

from __future__ import annotations

import json

import pytest

from replay.launch.ray_cluster import SYSTEM_CONFIG
from tests.conftest import error_line, replay_cli, tree_snapshot


@pytest.fixture(scope="module")
def two_node_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 1, "include_dashboard": False, "_system_config": SYSTEM_CONFIG})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes(timeout=120)
    yield cluster
    cluster.shutdown()


def test_analyze_runs_on_both_nodes_of_a_cluster(two_node_cluster, replayed_copy):
    # in a process of its own: this one may hold the session's cluster, which `analyze` would reuse
    result = replay_cli("analyze", str(replayed_copy), "--ray-address", two_node_cluster.address, "--json",
                        timeout=300, process=True)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["computed"] == 7 and out["nodes"] == 2      # work items ran on the head and on the worker node


def test_a_clusters_workers_read_a_store_in_a_bucket_with_the_drivers_configuration(two_node_cluster, s3_store):
    """The cluster's raylets started before the test set the AWS_* variables: its workers reach the bucket
    with what the driver hands them (launch/ray_cluster.py worker_options), reading each checkpoint there."""
    recorded = replay_cli("record", "--store", str(s3_store), "--steps", "8", "--checkpoint-every", "2",
                          process=True)
    assert recorded.returncode == 0, recorded.stderr
    result = replay_cli("analyze", str(s3_store), "--ray-address", two_node_cluster.address, "--json",
                        timeout=300, process=True)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["computed"] == 5 and out["nodes"] == 2     # checkpoints 0, 2, 4, 6, 8, on both nodes


def test_another_cluster_than_the_one_this_process_holds_is_refused(ray_local, replayed_copy):
    """In a process already connected to a cluster (a notebook, this suite), --ray-address naming another
    one is an error, not a silent analysis on the wrong cluster."""
    before = tree_snapshot(replayed_copy)
    line = error_line(replay_cli("analyze", str(replayed_copy), "--ray-address", "127.0.0.1:1"))
    assert ray_local in line and "127.0.0.1:1" in line
    assert tree_snapshot(replayed_copy) == before
