"""What each kind of recorded run can do (store/capabilities.py), from real manifests of each kind."""

from __future__ import annotations

import json

import pytest

from replay.config import Launcher, build_config
from replay.store import RunStore
from replay.store.capabilities import Capabilities
from replay.store.manifest import CommandInfo, DataInfo, Manifest

DATA = DataInfo(embedded=True, path=None, bytes=16384, method="sha256", digest="0" * 64)


def _builtin(launcher: str, nproc: int = 2, zero_stage: int = 0) -> Manifest:
    cfg = build_config(nproc=nproc, launcher=launcher, zero_stage=zero_stage)
    return Manifest(kind="run", config=cfg, world_size=nproc, launcher=cfg.launcher, data=DATA, created=0.0)


def _script(launcher: str, world_size: int, local_world_size: int | None, attention: str = "sdpa") -> Manifest:
    """A loop of the user's own as replay.recorder.Loop records it: with its command; None: the Recorder API's,
    without one."""
    cfg = build_config(sets=[f"model.attention={attention}"])
    command = None if local_world_size is None else CommandInfo(
        argv=["train.py"], cwd="/work", launcher=launcher, world_size=world_size, files={"train.py": "0" * 64},
        local_world_size=local_world_size)
    return Manifest(kind="run", config=cfg, world_size=world_size, launcher="custom", data=DATA, created=0.0,
                    command=command)


KINDS = {
    "local": _builtin("local"),
    "zero1": _builtin("deepspeed", zero_stage=1),
    "zero2": _builtin("deepspeed", zero_stage=2),
    "torchrun": _script("torchrun", 2, 2),
    "python": _script("python", 1, 1),
    "multi-node": _script("torchrun", 4, 2),
    "recorder-api": _script("python", 1, None),
}


@pytest.mark.parametrize(("kind", "builtin", "relaunches_script", "relaunchable", "warm_ranks"), [
    ("local", True, False, True, True),
    ("zero1", True, False, True, False),
    ("zero2", True, False, True, False),
    ("torchrun", False, True, True, False),
    ("python", False, True, True, False),
    ("multi-node", False, True, True, False),
    ("recorder-api", False, False, False, False),
])
def test_who_starts_the_run_again(kind, builtin, relaunches_script, relaunchable, warm_ranks):
    caps = Capabilities.of(KINDS[kind])
    assert (caps.builtin, caps.relaunches_script, caps.relaunchable, caps.warm_ranks) == \
        (builtin, relaunches_script, relaunchable, warm_ranks)


@pytest.mark.parametrize(("kind", "world_size", "nodes", "sharded", "zero_stage"), [
    ("local", 2, 1, False, 0),
    ("zero1", 2, 1, True, 1),
    ("zero2", 2, 1, True, 2),
    ("torchrun", 2, 1, False, 0),
    ("python", 1, 1, False, 0),
    ("multi-node", 4, 2, False, 0),
    ("recorder-api", 1, 1, False, 0),
])
def test_how_the_ranks_are_spread(kind, world_size, nodes, sharded, zero_stage):
    caps = Capabilities.of(KINDS[kind])
    assert (caps.world_size, caps.nodes, caps.multi_node, caps.sharded, caps.zero_stage) == \
        (world_size, nodes, nodes > 1, sharded, zero_stage)


def test_a_command_recorded_before_local_world_size_counts_as_one_node():
    m = _script("torchrun", 2, 0)   # stores written before CommandInfo.local_world_size existed
    assert Capabilities.of(m).nodes == 1 and not Capabilities.of(m).multi_node


@pytest.mark.parametrize(("kind", "drop", "scope_lr", "precision"), [
    ("local", True, True, True),
    ("zero1", False, False, False),
    ("zero2", False, False, False),
    ("torchrun", False, False, True),
    ("python", False, False, True),
])
def test_which_overrides_each_kind_can_replay(kind, drop, scope_lr, precision):
    caps = Capabilities.of(KINDS[kind])
    assert (caps.can_drop_samples, caps.can_scope_lr, caps.can_change_precision) == (drop, scope_lr, precision)
    for can, reason in ((caps.can_drop_samples, caps.drop_refusal), (caps.can_scope_lr, caps.scoped_lr_refusal),
                        (caps.can_change_precision, caps.precision_refusal)):
        assert (reason is None) == can


def test_refusals_name_what_is_missing_and_what_to_do_instead():
    ds, script = Capabilities.of(KINDS["zero1"]), Capabilities.of(KINDS["torchrun"])
    assert "DeepSpeed scales the loss itself" in ds.drop_refusal and "use --skip" in ds.drop_refusal
    assert "needs the built-in trainer" in script.drop_refusal and "use --skip" in script.drop_refusal
    assert "DeepSpeed partitions" in ds.scoped_lr_refusal
    assert "use --lr-scale on the whole model" in script.scoped_lr_refusal
    assert "optimizer state layout" in ds.precision_refusal


def test_only_a_scripts_attention_can_be_one_replay_cannot_run_per_head():
    assert Capabilities.of(KINDS["local"]).attention_refusal is None
    assert Capabilities.of(KINDS["zero1"]).attention_refusal is None
    refusal = Capabilities.of(_script("torchrun", 2, 2, attention="flash_attention_2")).attention_refusal
    assert "'flash_attention_2'" in refusal and "attn_implementation='sdpa'" in refusal


def test_the_launcher_is_stored_as_the_string_it_always_was(tmp_path):
    """Launcher is a str enum: manifests written with it hold the same JSON as before it existed, and read back
    as the enum."""
    m = KINDS["zero1"]
    doc = m.to_dict()
    assert type(doc["launcher"]) is str and type(doc["config"]["launcher"]) is str
    assert (doc["launcher"], doc["config"]["launcher"]) == ("deepspeed", "deepspeed")
    store = RunStore.create(tmp_path / "run", m)
    raw = json.loads((tmp_path / "run" / "zarr.json").read_text())["attributes"]
    assert raw["launcher"] == "deepspeed" and raw["config"]["launcher"] == "deepspeed"
    again = store.manifest
    assert again.launcher is Launcher.DEEPSPEED and again.config.launcher is Launcher.DEEPSPEED
    assert again.to_dict() == doc
    assert Capabilities.of(again) == store.capabilities == Capabilities.of(m)


def test_a_launcher_given_as_its_string_is_the_enum():
    assert KINDS["torchrun"].launcher is Launcher.CUSTOM
