import json
import shutil

import numpy as np
import pytest
import torch
import zarr

from replay.config import RunConfig
from replay.errors import ChecksumError, StoreError
from replay.store import STEP_FIELDS, RunStore, chunks
from replay.store.integrity import seal
from replay.store.location import Location
from replay.store.run_store import check_empty, check_outside_stores, enclosing_store
from tests.conftest import new_store, tensors_equal


def _rows(k, world=2, start=0):
    return {"loss": np.arange(start, start + k, dtype=float), "rank_loss": np.ones((k, world)),
            "grad_norm": np.ones(k), "lr": np.ones(k), "tokens": np.ones(k), "step_time": np.ones(k),
            "sample_ids": np.arange(k * world * 4).reshape(k, world, 1, 4)}


def test_create_refuses_a_non_empty_directory(tmp_path):
    (tmp_path / "x").write_text("keep me")
    with pytest.raises(StoreError, match="not empty"):
        new_store(tmp_path)
    assert (tmp_path / "x").read_text() == "keep me"


def test_open_refuses_what_is_not_a_run_store(tmp_path):
    with pytest.raises(StoreError, match="does not exist"):
        RunStore.open(tmp_path / "nothing")
    (tmp_path / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    with pytest.raises(StoreError, match="not a replay run store"):
        RunStore.open(tmp_path)


def test_step_log_appends_in_order_and_truncates(tmp_path):
    store = new_store(tmp_path / "s")
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
    store = new_store(tmp_path / "s")
    tree = {"w": torch.randn(4, 4).bfloat16(), "opt": {"state": {0: {"step": torch.tensor(1.0)}}}}
    store.write_shard(10, 0, tree)
    store.write_shard(10, 1, {"rng": torch.arange(5, dtype=torch.uint8)})
    assert store.checkpoints() == []                      # both shards done, but no commit yet
    store.commit_checkpoint(10, "regular", world_size=2)
    assert [c.step for c in store.checkpoints()] == [10]
    assert tensors_equal(store.read_shard(10, 0), tree)


def test_commit_waits_for_every_rank(tmp_path):
    store = new_store(tmp_path / "s")
    store.write_shard(5, 0, {"w": torch.ones(2)})
    with pytest.raises(StoreError, match="rank 1 never finished"):
        store.commit_checkpoint(5, "regular", world_size=2, timeout=0.2)
    assert store.checkpoints() == []
    assert store.rewind(verify_world_size=2) is None                  # back to nothing: resume starts over
    assert store.uncommitted_checkpoints() == [] and store.n_steps == 0


def test_rewind_cuts_back_to_the_last_committed_checkpoint(tmp_path):
    store = new_store(tmp_path / "s")
    store.append_steps(0, _rows(7))
    for step in (0, 5):
        store.write_shard(step, 0, {"w": torch.full((2,), float(step))})
        store.commit_checkpoint(step, "regular", 1)
    store.write_shard(7, 0, {"w": torch.ones(2)})          # crashed before its commit
    store.add_spike({"step": 6, "loss": 9.0})
    assert store.rewind(verify_world_size=1) == 5
    assert store.n_steps == 5 and store.spikes == [] and [c.step for c in store.checkpoints()] == [0, 5]
    assert not (tmp_path / "s/checkpoints/00000007").exists()


def _flip(path, at, mask=0x01):
    data = bytearray(path.read_bytes())
    data[at] ^= mask
    path.write_bytes(bytes(data))


def test_a_damaged_chunk_is_named_with_the_tensors_it_holds(tmp_path, monkeypatch):
    monkeypatch.setattr(chunks, "CHUNK_BYTES", 4096)   # 16 KiB tensors: several chunks each
    store = new_store(tmp_path / "s")
    store.write_shard(0, 0, {"model": {"h.0.weight": torch.randn(64, 64), "h.1.weight": torch.randn(64, 64)}})
    store.commit_checkpoint(0, "regular", 1)
    index = store.shard_index(0, 0)
    chunk = index["/model/h.1.weight"]["offset"] // 4096 + 1          # inside h.1.weight
    _flip(tmp_path / f"s/checkpoints/00000000/rank0/tensors/c/{chunk}", 17)
    with pytest.raises(ChecksumError, match=rf"checkpoint 0 rank 0: array tensors chunk {chunk} \(holding "
                                            r"model/h.1.weight\) does not match its checksum"):
        store.read_shard(0, 0)
    # the intact tensor alone still reads: its chunks are whole
    assert store.read_shard(0, 0, keys=["/model/h.0.weight"])["/model/h.0.weight"].shape == (64, 64)


def test_checkpoint_chunks_are_a_zarr_array_that_zarr_verifies(tmp_path):
    store = new_store(tmp_path / "s")
    tree = {"w": torch.randn(100, 3), "b": torch.arange(7)}
    store.write_shard(4, 0, tree)
    store.commit_checkpoint(4, "regular", 1)
    arr = zarr.open_array(str(tmp_path / "s/checkpoints/00000004/rank0/tensors"), mode="r")
    index = store.shard_index(4, 0)
    w = arr[index["/w"]["offset"]: index["/w"]["offset"] + index["/w"]["nbytes"]].view(np.float32).reshape(100, 3)
    assert np.array_equal(w, tree["w"].numpy())
    _flip(tmp_path / "s/checkpoints/00000004/rank0/tensors/c/0", 3)
    with pytest.raises(ValueError, match="checksum"):   # zarr's own crc32c codec refuses it too
        arr[:]


def test_a_flipped_bit_in_a_shards_json_is_refused(tmp_path):
    """One bit of the optimizer's lr in rank 0's JSON: 0.000914 -> 0.001914 would still parse."""
    store = new_store(tmp_path / "s")
    store.write_shard(20, 0, {"optimizer": {"param_groups": [{"lr": 0.000914}]}, "w": torch.ones(3)})
    store.commit_checkpoint(20, "regular", 1)
    doc = tmp_path / "s/checkpoints/00000020/rank0/zarr.json"
    _flip(doc, doc.read_bytes().index(b"0.000914") + 4)
    assert b"0.001914" in doc.read_bytes()
    with pytest.raises(ChecksumError, match="checkpoint 20 rank 0: its index and non-tensor state .* does not "
                                            "match its checksum"):
        store.read_shard(20, 0)


def test_a_damaged_commit_record_is_named_and_never_discarded(tmp_path):
    store = new_store(tmp_path / "s")
    for step in (0, 5):
        store.write_shard(step, 0, {"w": torch.full((2,), float(step))})
        store.commit_checkpoint(step, "regular", 1)
    commit = tmp_path / "s/checkpoints/00000005/zarr.json"
    _flip(commit, commit.read_bytes().index(b'"regular"') + 3)
    assert [c.step for c in store.checkpoints()] == [0]
    assert [step for step, _ in store.damaged_checkpoints()] == [5]
    with pytest.raises(ChecksumError, match="checkpoint 5: its commit record .* does not match its checksum"):
        store.read_shard(5, 0)
    with pytest.raises(ChecksumError, match="resuming would discard it"):
        store.rewind(verify_world_size=1)
    assert commit.exists()


def test_the_manifest_and_step_log_are_checksummed(tmp_path):
    store = new_store(tmp_path / "s", config=RunConfig.from_dict({"optim": {"lr": 0.003}}))
    store.append_steps(0, _rows(3))
    root = tmp_path / "s/zarr.json"
    _flip(root, root.read_bytes().index(b"0.003") + 4)             # 0.003 -> 0.002: still valid JSON
    with pytest.raises(ChecksumError, match="the manifest"):
        RunStore.open(tmp_path / "s")
    _flip(root, root.read_bytes().index(b"0.002") + 4)             # undone
    chunk = tmp_path / "s/steps/loss/c/0"
    _flip(chunk, 2)
    with pytest.raises(ChecksumError, match="steps/loss is damaged"):
        RunStore.open(tmp_path / "s").read_steps(["loss"])


def test_single_tensors_read_by_byte_range(tmp_path):
    store = new_store(tmp_path / "s")
    tree = {f"w{i}": torch.randn(64, 64) for i in range(6)}
    store.write_shard(3, 0, tree)
    store.commit_checkpoint(3, "regular", 1)
    got = store.read_shard(3, 0, keys=["/w4", "/w2"])
    assert set(got) == {"/w4", "/w2"} and torch.equal(got["/w4"], tree["w4"])
    with pytest.raises(StoreError, match="no tensor /w9"):
        store.read_shard(3, 0, keys=["/w9"])


def test_tensors_read_are_private_copies_on_write_of_the_files(tmp_path):
    store = new_store(tmp_path / "s")
    tree = {"w": torch.randn(300, 300), "b": torch.ones(5)}
    store.write_shard(1, 0, tree)
    store.commit_checkpoint(1, "regular", 1)
    first = store.read_shard(1, 0)
    first["w"].mul_(2)                                   # what an optimizer step does to a restored state
    assert torch.equal(store.read_shard(1, 0)["w"], tree["w"])   # the file did not change (nor its checksum)
    second = store.read_shard(1, 0)
    shutil.rmtree(tmp_path / "s/checkpoints")            # a rewind or a discarded replay removes files
    assert torch.equal(second["w"], tree["w"]) and torch.equal(first["w"], tree["w"] * 2)


def test_a_missing_part_of_the_record_is_named_with_the_store_before_anything_is_written(tmp_path):
    store = new_store(tmp_path / "s")
    store.append_steps(0, _rows(3))
    shutil.rmtree(tmp_path / "s" / "steps" / "sample_ids")
    for read in (lambda: store.read_steps(["sample_ids"]), store.verify_records, lambda: store.rewind(1)):
        with pytest.raises(ChecksumError, match=r"s: the step log's sample_ids \(steps/sample_ids\) is missing: the "
                                                "store is damaged there; restore the store from a copy"):
            read()
    assert store.read_steps(["state_digest"])["state_digest"].size == 0   # optional: older stores lack it
    shutil.rmtree(tmp_path / "s" / "spikes")
    with pytest.raises(ChecksumError, match="s: spikes is missing"):
        _ = store.spikes
    (tmp_path / "s" / "steps" / "zarr.json").write_text("{not json")
    with pytest.raises(ChecksumError, match=r"steps/zarr.json is damaged \(Expecting"):
        _ = store.n_steps


@pytest.mark.parametrize("change, says", [
    (lambda a: a["config"]["model"].update(rope=True), "has field 'config.model.rope', unknown to this version"),
    (lambda a: a.update(rope_scaling=2), "has field 'rope_scaling', unknown to this version"),
    (lambda a: a.update(resumes=[{"from_step": 0, "time": 0, "node": "b"}]), "unexpected keyword argument 'node'"),
    (lambda a: a.pop("world_size"), "has no field 'world_size'"),
])
def test_a_manifest_this_version_cannot_read_says_to_upgrade(tmp_path, change, says):
    new_store(tmp_path / "s")
    doc = json.loads((tmp_path / "s" / "zarr.json").read_text())
    change(doc["attributes"])
    doc["attributes"] = seal({k: v for k, v in doc["attributes"].items() if k != "crc32c"})   # as a replay wrote it
    (tmp_path / "s" / "zarr.json").write_text(json.dumps(doc))
    with pytest.raises(StoreError, match="s was written by a newer replay") as e:
        RunStore.open(tmp_path / "s")
    assert says in str(e.value) and str(e.value).endswith("upgrade replay to read it")


def test_a_new_runs_location_inside_a_store_is_refused(tmp_path):
    new_store(tmp_path / "s")
    for inside in ("s/replays/mine", "s/checkpoints", "s/a/b/c"):
        with pytest.raises(StoreError, match=f"lies inside the run store {tmp_path / 's'}"):
            check_outside_stores(Location.parse(tmp_path / inside))
    check_outside_stores(Location.parse(tmp_path / "t"))
    assert enclosing_store(Location.parse(tmp_path / "s")) is None


def test_a_used_location_says_what_it_holds(tmp_path):
    store = new_store(tmp_path / "s")
    with pytest.raises(StoreError, match="it holds a run: pass --resume to continue it, or choose a new --store"):
        check_empty(Location.parse(tmp_path / "s"))
    store.update_manifest(status="complete")
    with pytest.raises(StoreError, match="it holds a complete run: choose a new --store"):
        check_empty(Location.parse(tmp_path / "s"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("")
    with pytest.raises(StoreError, match="it holds a folder of other files: choose a new --store"):
        check_empty(Location.parse(tmp_path / "other"))
    with pytest.raises(StoreError, match="is a file: choose a new --store"):
        check_empty(Location.parse(tmp_path / "other" / "notes.txt"))


def test_a_step_logs_chunk_of_zeros_is_stored_so_that_a_missing_one_is_damage(tmp_path):
    """Zarr leaves out a chunk that holds only its fill value, and reads a missing one as that value: the step
    log stores every chunk (a loop that logs no tokens writes zeros), so one gone is refused, not read as zeros."""
    store = new_store(tmp_path / "run")
    rows = _rows(3)
    rows["tokens"] = np.zeros(3, dtype=np.int64)
    store.append_steps(0, rows)
    store.verify_records()
    (tmp_path / "run/steps/tokens/c/0").unlink()
    with pytest.raises(ChecksumError, match=r"steps/tokens is missing 1 of its 1 chunks: the store is corrupted"):
        store.verify_records()


def test_bisect_sessions_cut_short_or_damaged_are_left_out_and_written_over(tmp_path):
    """A session group whose first write was cut short (no document yet) or whose document is damaged is left
    out, not a KeyError; the bisect that runs it again writes it whole."""
    store = new_store(tmp_path / "run")
    store.write_bisect_session("spike-5-steps-a", {"id": "spike-5-steps-a", "status": "complete"})
    store.root.create_group("bisect/spike-5-steps-b")                      # made, its document never written
    damaged = tmp_path / "run/bisect/spike-5-steps-c/zarr.json"
    damaged.parent.mkdir()
    damaged.write_text('{"zarr_format": 3, "node_type": "group", "attributes": {"id": "spike-5-st')
    assert [d["id"] for d in store.bisect_sessions()] == ["spike-5-steps-a"]
    store.write_bisect_session("spike-5-steps-c", {"id": "spike-5-steps-c", "status": "running"})
    again = RunStore.open(tmp_path / "run").bisect_sessions()
    assert [d["id"] for d in again] == ["spike-5-steps-a", "spike-5-steps-c"]


def test_a_store_is_created_over_the_temporary_file_of_a_creation_killed_before_its_manifest(tmp_path):
    """A kill inside the first write of a store (a bisect's probe replay, say) leaves Zarr's temporary file."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "zarr.0123abcd.partial").write_text('{"zarr_fo')
    new_store(tmp_path / "run")
    assert RunStore.open(tmp_path / "run").n_steps == 0


def test_a_store_is_created_where_only_empty_folders_are_left(tmp_path):
    """What a removed store can leave (an object store's server may list its prefixes for a while)."""
    (tmp_path / "run" / "steps" / "loss").mkdir(parents=True)
    new_store(tmp_path / "run")
    assert RunStore.open(tmp_path / "run").n_steps == 0
