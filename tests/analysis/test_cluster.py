"""Analysis on a real multi-node Ray cluster: a head and a worker node (two raylets) started by the test
on this machine, reached through --ray-address, as a user would reach a cluster."""

from __future__ import annotations

import json

import pytest

from tests.conftest import replay_cli


@pytest.fixture
def two_node_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes(timeout=120)
    yield cluster
    cluster.shutdown()


def test_analyze_runs_on_both_nodes_of_a_cluster(two_node_cluster, replayed_copy):
    result = replay_cli("analyze", str(replayed_copy), "--ray-address", two_node_cluster.address, "--json",
                        timeout=300)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["computed"] == 7 and out["nodes"] == 2      # work items ran on the head and on the worker node
    again = json.loads(replay_cli("analyze", str(replayed_copy), "--ray-address", two_node_cluster.address,
                                  "--json").stdout)
    assert (again["computed"], again["already_done"]) == (0, 7)
