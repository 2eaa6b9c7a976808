"""`replay compare`: weight distances between two real runs at their common checkpoints."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.stats

from replay.analysis.results import analysis_status, read_distances
from replay.store import RunStore
from tests.conftest import error_line, replay_cli, tree_snapshot

# Its in-process 2-rank runs use the worker's warm ranks (tests/conftest.py): its subject is
# the distances between what they record, not how ranks start, which tests/launch checks with fresh ones.
pytestmark = pytest.mark.usefixtures("on_rank_pool")


@pytest.fixture(scope="module")
def other_seed(tmp_path_factory):
    """The reference run's recipe with another seed (one rank: the world size does not matter here)."""
    store = tmp_path_factory.mktemp("compare") / "seed7"
    result = replay_cli("record", "--store", str(store), "--steps", "20", "--checkpoint-every", "10",
                        "--set", "seed=7")
    assert result.returncode == 0, result.stderr
    return store


def test_compare_two_seeds(store_copy, other_seed, ray_local):
    result = replay_cli("compare", str(store_copy), str(other_seed), "--json", "--workers", "2")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["steps"] == [0, 10, 20] and out["computed"] == 3
    a, b = RunStore.open(store_copy), RunStore.open(other_seed)
    wa = a.read_shard(10, 0)["state"]["replicated"]["model"]
    wb = b.read_shard(10, 0)["state"]["replicated"]["model"]
    for j, tensor in enumerate(out["tensors"]):
        key = tensor.removeprefix("/state/replicated/model/")
        x, y = wa[key].double().numpy().ravel(), wb[key].double().numpy().ravel()
        assert out["max_abs"][1][j] == pytest.approx(np.abs(y - x).max(), rel=1e-12)
        assert out["wasserstein"][1][j] == pytest.approx(scipy.stats.wasserstein_distance(x, y), rel=1e-9, abs=1e-15)
    # different initialisations: far apart at step 0 already (biases and LayerNorms start equal)
    assert max(out["relative"][0]) > 0.5
    stored = out["table"]
    assert (store_copy / stored / "zarr.json").is_file()

    table = replay_cli("compare", str(store_copy), str(other_seed))
    assert table.returncode == 0, table.stderr
    assert "wasserstein" in table.stdout and len(table.stdout.splitlines()) == 6, table.stdout
    again = replay_cli("compare", str(store_copy), str(other_seed), "--json")
    assert again.returncode == 0, again.stderr
    again = json.loads(again.stdout)
    assert again["computed"] == 0 and again["reused"] == 3 and again["wasserstein"] == out["wasserstein"]


def test_compare_refuses_different_models(store_copy, tmp_path):
    small = tmp_path / "small"
    assert replay_cli("record", "--store", str(small), "--steps", "1", "--set", "model.n_embd=32").returncode == 0
    before = tree_snapshot(store_copy)
    assert "hold different models" in error_line(replay_cli("compare", str(store_copy), str(small)))
    assert "two different stores" in error_line(replay_cli("compare", str(store_copy), str(store_copy)))
    assert tree_snapshot(store_copy) == before


def test_a_store_compared_before_it_is_analysed_is_analysed_and_keeps_its_distances(store_copy, other_seed,
                                                                                     ray_local):
    """`compare` makes the analysis group for its distances; `analyze` then makes its metrics table in it (it
    once took the group for a finished table and failed with KeyError: 'n_layer')."""
    compared = json.loads(replay_cli("compare", str(store_copy), str(other_seed), "--json").stdout)
    result = replay_cli("analyze", str(store_copy), "--json")
    assert result.returncode == 0, result.stderr
    assert analysis_status(store_copy)["checkpoints"] == [0, 10, 20, 30]
    assert read_distances(store_copy)[compared["table"].split("/")[-1]]["step"].tolist() == [0, 10, 20]
