"""DCP interop, in process: a recorded checkpoint exported (store/dcp.py) and read back by DCP's own `dcp.load`;
recordings started from DCP directories (recorder/dcp.py) that DCP wrote itself, in OLMo-core's and
torchtitan's layouts, or that `export` wrote (the round trip, bit for bit); the refusals, in one line."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from replay.errors import ReplayError, StoreError, UsageError
from replay.recorder import Loop
from replay.recorder.dcp import load_dcp
from replay.store import RunStore
from replay.store.dcp import export, quiet_single_process
from replay.store.sharding import Piece, ShardedTensor, Sharding
from tests.conftest import new_store, tensors_equal
from tests.recorder.models import OneBlock


def _parts(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = OneBlock(16)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _record(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 2) -> RunStore:
    with Loop(path, model, optimizer, total_steps=steps, checkpoint_every=1) as loop:
        for step in loop.steps():
            loop.sample_ids(torch.tensor([step]))
            loss = model(torch.tensor([[1, 2, 3, step]])).logsumexp(-1).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            loop.log(loss=loss)
    return RunStore.open(path)


def _state(store: RunStore, step: int) -> dict:
    return store.read_shard(step, 0)["state"]["replicated"]


@pytest.fixture
def recorded(tmp_path) -> RunStore:
    return _record(tmp_path / "run", *_parts())


def test_an_export_loads_with_dcp_into_a_fresh_model_bit_for_bit(recorded, tmp_path):
    exported = export(recorded.location, 2, tmp_path / "dcp", *_parts(seed=1))
    assert exported.optimizer and exported.tensors == 5
    model, optimizer = _parts(seed=2)
    model_state, optimizer_state = get_state_dict(model, optimizer)   # DCP's own layout, filled by dcp.load
    with quiet_single_process():
        dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp_path / "dcp")
    names = list(model_state)
    assert tensors_equal(model_state, recorded.read_model(2, names))
    # the optimizer's state by parameter name: parameter i of the run's optimizer is named parameter i
    saved = _state(recorded, 2)["optimizer"]
    params = [n for n, _ in model.named_parameters()]
    assert sorted(optimizer_state["state"]) == sorted(params)
    assert all(tensors_equal(optimizer_state["state"][n], saved["state"][i]) for i, n in enumerate(params))
    assert optimizer_state["param_groups"][0]["lr"] == saved["param_groups"][0]["lr"] == 1e-2


def test_without_the_model_and_optimizer_objects_the_model_alone_is_exported(recorded, tmp_path):
    exported = export(recorded.location, 1, tmp_path / "dcp")
    assert not exported.optimizer and "model only" in exported.line() and "optimizer objects" in exported.line()
    model, _ = _parts(seed=3)
    state = {"model": model.state_dict()}
    with quiet_single_process():
        dcp.load(state, checkpoint_id=tmp_path / "dcp")
    assert tensors_equal(state["model"], _state(recorded, 1)["model"])


def test_a_sharded_checkpoint_exports_its_whole_tensors(tmp_path):
    whole, bias = torch.arange(12.0).view(4, 3), torch.tensor([5.0, 6.0])
    store = new_store(tmp_path / "run")
    sharding = Sharding("fsdp2", {"w": ShardedTensor([4, 3], 0, [Piece(0, 3), Piece(3, 1)])})
    store.update_manifest(world_size=2, sharding=sharding)
    for rank, piece in enumerate((whole[:3], whole[3:])):
        replicated = {"model": {"b": bias}} if rank == 0 else {}
        store.write_shard(0, rank, {"state": {"replicated": replicated, "local": {"model": {"w": piece}}}})
    store.commit_checkpoint(0, "regular", 2)
    exported = export(store.location, 0, tmp_path / "dcp", *_parts())   # objects given: still no optimizer
    assert not exported.optimizer and "fsdp2-sharded" in exported.why_not
    state = {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(2)}}
    with quiet_single_process():
        dcp.load(state, checkpoint_id=tmp_path / "dcp")
    assert torch.equal(state["model"]["w"], whole) and torch.equal(state["model"]["b"], bias)


def test_the_round_trip_starts_a_recording_whose_checkpoint_0_is_the_exported_one(recorded, tmp_path):
    export(recorded.location, 2, tmp_path / "dcp", *_parts(seed=1))
    model, optimizer = _parts(seed=4)
    loaded = load_dcp(tmp_path / "dcp", model, optimizer)
    assert loaded.optimizer and loaded.tensors == 5
    new = _record(tmp_path / "new", model, optimizer, steps=1)
    assert tensors_equal(_state(new, 0), _state(recorded, 2))   # model, AdamW's moments and steps, its lr
    assert new.manifest.init_from == str((tmp_path / "dcp").resolve())


@pytest.mark.parametrize("layout", ["olmo-core", "torchtitan"])
def test_a_recording_starts_from_what_dcp_saved_of_a_plain_model(tmp_path, layout):
    source, _ = _parts(seed=5)
    saved = source.state_dict()
    with quiet_single_process():
        dcp.save({"model": saved} if layout == "olmo-core" else saved, checkpoint_id=tmp_path / "dcp")
    model, optimizer = _parts(seed=6)
    assert not load_dcp(tmp_path / "dcp", model).optimizer
    new = _record(tmp_path / "new", model, optimizer, steps=1)
    assert tensors_equal(_state(new, 0)["model"], saved)
    assert new.manifest.init_from == str((tmp_path / "dcp").resolve())


def test_a_dcp_metadata_that_would_run_code_is_refused_without_running_it(tmp_path):
    from tests.store.test_foreign import Evil

    source, _ = _parts(seed=5)
    with quiet_single_process():
        dcp.save({"model": source.state_dict()}, checkpoint_id=tmp_path / "dcp")
    marker = tmp_path / "ran"
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(Evil(marker)))
    with pytest.raises(StoreError, match="is not DCP metadata: pathlib.Path.touch is not part of DCP's metadata"):
        load_dcp(tmp_path / "dcp", _parts(seed=6)[0])
    assert not marker.exists()


def test_a_recording_not_loaded_from_dcp_names_no_origin(recorded):
    assert recorded.manifest.init_from is None


def test_refusals_are_one_line(recorded, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    cases = [
        (lambda: export(recorded.location, 5, tmp_path / "a"), StoreError, "no committed checkpoint at step 5 "
         r"\(committed: 0, 1, 2\)"),
        (lambda: export(recorded.location, 1, tmp_path / "full"), UsageError, "is not an empty directory"),
        (lambda: load_dcp(tmp_path / "full", *_parts()), UsageError, "is not a DCP checkpoint directory"),
    ]
    export(recorded.location, 1, tmp_path / "model-only")
    cases += [
        (lambda: load_dcp(tmp_path / "model-only", *_parts()), UsageError, "holds no optimizer state"),
        (lambda: load_dcp(tmp_path / "model-only", torch.nn.Linear(2, 2)), UsageError,
         "does not hold the model's weight and 1 more"),
    ]
    for call, kind, message in cases:
        with pytest.raises(kind, match=message) as error:
            call()
        assert issubclass(error.type, ReplayError) and "\n" not in str(error.value)
