"""A store written before checksums covered every byte (schema 1, recorded by the replay of commit 5bc7809
and kept in tests/data: the `schema1` fixture, tests/store/conftest.py) still opens, reads and names a
corrupted tensor; its run is not continued in the new format (it replays: test_schema1_integration.py)."""

from __future__ import annotations

import json

import pytest
import torch

from replay.errors import ChecksumError
from replay.store import RunStore
from tests.conftest import error_line, replay_cli, tree_snapshot


def _as_recorded(now: dict, recorded: dict) -> dict:
    """The config as read now, restricted to the keys the old store recorded (settings added since are
    left out; the test checks their defaults apart)."""
    return {k: _as_recorded(now[k], v) if isinstance(v, dict) else now[k] for k, v in recorded.items()}


def test_it_opens_and_reads_as_recorded(schema1):
    store = RunStore.open(schema1)
    m = store.manifest
    assert store.schema == 1 and m.kind == "run" and m.world_size == 1 and m.config.model.n_embd == 32
    assert [c.step for c in store.checkpoints()] == [0, 2, 4] and store.n_steps == 4
    raw = json.loads((schema1 / "zarr.json").read_text())["attributes"]
    assert _as_recorded(m.config.to_dict(), raw["config"]) == raw["config"] and m.data.digest == raw["data"]["digest"]
    assert m.config.spike.min_delta == 0.0   # a setting added since: its default, the rule the run had
    state = store.read_shard(4, 0)["state"]["replicated"]
    assert state["model"]["transformer.wte.weight"].shape == (256, 32) and state["optimizer"]["state"]
    info = json.loads(replay_cli("info", str(schema1), "--json").stdout)
    assert info["schema"] == 1 and info["steps_recorded"] == 4


def test_a_corrupted_tensor_is_named(schema1):
    store = RunStore.open(schema1)
    entry = store.shard_index(2, 0)["/state/replicated/model/transformer.h.0.attn.c_attn.weight"]
    chunk = schema1 / "checkpoints/00000002/rank0/tensors/c/0"
    data = bytearray(chunk.read_bytes())
    data[entry["offset"] + 5] ^= 0x10
    chunk.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="checkpoint 2 rank 0: tensor state/replicated/model/transformer.h.0.attn"):
        store.read_shard(2, 0)
    assert torch.is_tensor(store.read_shard(4, 0)["state"]["replicated"]["model"]["lm_head.weight"])


def test_its_run_is_not_continued(schema1):
    before = tree_snapshot(schema1)
    line = error_line(replay_cli("record", "--store", str(schema1), "--resume"))
    assert "written by an older replay (store schema 1)" in line and "record it again" in line
    assert tree_snapshot(schema1) == before
