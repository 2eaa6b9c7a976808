import json

import numpy as np
import pytest
import torch

from replay.errors import ChecksumError, StoreError
from replay.store import STEP_FIELDS, RunStore
from tests.conftest import tensors_equal


def _rows(k, world=2, start=0):
    return {"loss": np.arange(start, start + k, dtype=float), "rank_loss": np.ones((k, world)),
            "grad_norm": np.ones(k), "lr": np.ones(k), "tokens": np.ones(k), "step_time": np.ones(k),
            "sample_ids": np.arange(k * world * 4).reshape(k, world, 1, 4)}


def test_create_refuses_a_non_empty_directory(tmp_path):
    (tmp_path / "x").write_text("keep me")
    with pytest.raises(StoreError, match="not empty"):
        RunStore.create(tmp_path, {})
    assert (tmp_path / "x").read_text() == "keep me"


def test_open_refuses_what_is_not_a_run_store(tmp_path):
    with pytest.raises(StoreError, match="does not exist"):
        RunStore.open(tmp_path / "nothing")
    (tmp_path / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    with pytest.raises(StoreError, match="not a replay run store"):
        RunStore.open(tmp_path)


def test_step_log_appends_in_order_and_truncates(tmp_path):
    store = RunStore.create(tmp_path / "s", {})
    store.append_steps(0, _rows(3))
    store.append_steps(3, _rows(2, start=3))
    with pytest.raises(StoreError, match="ends at step 5"):
        store.append_steps(7, _rows(1))
    steps = RunStore.open(tmp_path / "s").read_steps()
    assert steps["loss"].tolist() == [0, 1, 2, 3, 4]
    assert set(STEP_FIELDS) <= set(steps)
    store.truncate_steps(2)
    assert RunStore.open(tmp_path / "s").read_steps()["loss"].tolist() == [0, 1]


def test_checkpoint_is_invisible_until_committed_and_round_trips(tmp_path):
    store = RunStore.create(tmp_path / "s", {})
    tree = {"w": torch.randn(4, 4).bfloat16(), "opt": {"state": {0: {"step": torch.tensor(1.0)}}}}
    store.write_shard(10, 0, tree)
    store.write_shard(10, 1, {"rng": torch.arange(5, dtype=torch.uint8)})
    assert store.checkpoints() == []                      # both shards done, but no commit yet
    store.commit_checkpoint(10, "regular", world_size=2)
    assert [c.step for c in store.checkpoints()] == [10]
    assert tensors_equal(store.read_shard(10, 0), tree)


def test_commit_waits_for_every_rank(tmp_path):
    store = RunStore.create(tmp_path / "s", {})
    store.write_shard(5, 0, {"w": torch.ones(2)})
    with pytest.raises(StoreError, match="rank 1 never finished"):
        store.commit_checkpoint(5, "regular", world_size=2, timeout=0.2)
    assert store.checkpoints() == []
    with pytest.raises(StoreError, match="no committed checkpoint"):
        store.rewind(verify_world_size=2)


def test_rewind_cuts_back_to_the_last_committed_checkpoint(tmp_path):
    store = RunStore.create(tmp_path / "s", {})
    store.append_steps(0, _rows(7))
    for step in (0, 5):
        store.write_shard(step, 0, {"w": torch.full((2,), float(step))})
        store.commit_checkpoint(step, "regular", 1)
    store.write_shard(7, 0, {"w": torch.ones(2)})          # crashed before its commit
    store.add_spike({"step": 6, "loss": 9.0})
    assert store.rewind(verify_world_size=1) == 5
    assert store.n_steps == 5 and store.spikes == [] and [c.step for c in store.checkpoints()] == [0, 5]
    assert not (tmp_path / "s/checkpoints/00000007").exists()


def _flip_a_byte(shard_dir, at):
    chunk = next(p for p in (shard_dir / "tensors").rglob("*") if p.is_file() and p.name != "zarr.json")
    data = bytearray(chunk.read_bytes())
    data[at] ^= 0xFF
    chunk.write_bytes(bytes(data))


def test_corrupted_tensor_is_named_on_read(tmp_path):
    store = RunStore.create(tmp_path / "s", {})
    store.write_shard(0, 0, {"model": {"h.0.weight": torch.randn(8, 8), "h.1.weight": torch.randn(8, 8)}})
    store.commit_checkpoint(0, "regular", 1)
    offset = store.shard_index(0, 0)["/model/h.1.weight"]["offset"]
    _flip_a_byte(tmp_path / "s/checkpoints/00000000/rank0", offset + 17)
    with pytest.raises(ChecksumError, match="tensor model/h.1.weight does not match its checksum"):
        store.read_shard(0, 0)
    # the intact tensor alone still reads, by its byte range
    assert store.read_shard(0, 0, keys=["/model/h.0.weight"])["/model/h.0.weight"].shape == (8, 8)


def test_single_tensors_read_by_byte_range(tmp_path):
    store = RunStore.create(tmp_path / "s", {})
    tree = {f"w{i}": torch.randn(64, 64) for i in range(6)}
    store.write_shard(3, 0, tree)
    store.commit_checkpoint(3, "regular", 1)
    got = store.read_shard(3, 0, keys=["/w4", "/w2"])
    assert set(got) == {"/w4", "/w2"} and torch.equal(got["/w4"], tree["w4"])
    with pytest.raises(StoreError, match="no tensor /w9"):
        store.read_shard(3, 0, keys=["/w9"])
