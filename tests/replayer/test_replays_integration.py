"""`replay run`: windows of real recordings re-executed by real rank processes, compared bit for bit."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from replay.store import RunStore
from tests.conftest import corrupt_tensor, error_line, replay_cli, tree_snapshot

# Its in-process 2-rank runs use the worker's warm ranks (tests/conftest.py): its subject is
# what a replay computes and stores, not how ranks start, which tests/launch checks with fresh ones.
pytestmark = pytest.mark.usefixtures("on_rank_pool")


def _final_model(store: RunStore, step: int) -> dict[str, torch.Tensor]:
    return store.read_shard(step, 0)["state"]["replicated"]["model"]


def test_two_rank_window_between_checkpoints_replays_bit_for_bit(store_copy):
    # checkpoints at 0, 10, 20, 30: the window 13..19 starts between two of them
    result = replay_cli("run", str(store_copy), "--from", "13", "--to", "19", "--verify", "--json")
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["verification"]["bitwise"] and answer["verification"]["steps"] == [10, 19]
    assert answer["environment_differences"] == []   # the machine that recorded it: nothing to say
    parent, replay = RunStore.open(store_copy), RunStore.open(answer["replay"])
    assert replay.kind == "replay" and replay.manifest.replay.start_checkpoint == 10
    rec, rep = parent.read_steps(), replay.read_steps()
    assert rep["step"].tolist() == list(range(10, 20))
    for field in ("loss", "rank_loss", "grad_norm", "lr", "sample_ids"):
        assert np.array_equal(rep[field], rec[field][10:20]), field
    # the replay ends with a checkpoint at 20: the same weights the recording committed there
    a, b = _final_model(replay, 20), _final_model(parent, 20)
    assert all(torch.equal(a[k], b[k]) for k in b)

    again = replay_cli("run", str(store_copy), "--from", "13", "--to", "19", "--json")
    assert json.loads(again.stdout)["ran"] is False                       # idempotent: not re-run
    info = json.loads(replay_cli("info", str(store_copy), "--json").stdout)
    assert [(r["id"], r["verification"]["bitwise"]) for r in info["replays"]] == [("steps-13-19", True)]
    # `replay batch` on the replay: its own steps (10..19), each the samples the record has at that step
    rows = json.loads(replay_cli("batch", answer["replay"], "--step", "12", "--json").stdout)
    assert [r["sample_id"] for r in rows] == rec["sample_ids"][12].ravel().tolist()
    assert "it holds steps 10..19" in error_line(replay_cli("batch", answer["replay"], "--step", "5"))


def test_a_plain_replay_that_differs_from_its_record_names_the_first_step_and_exits_5(store_copy):
    # a different recorded value is what a changed environment or kernel would produce: here we change
    # the record itself (the store is a copy), so the replay must name step 15's grad norm
    store = RunStore.open(store_copy, mode="a")
    grad = store.root["steps/grad_norm"]
    grad[15] = grad[15] * (1 + 1e-12)
    result = replay_cli("run", str(store_copy), "--from", "12", "--to", "17", "--verify")
    assert result.returncode == 5, result.stderr
    line = error_line(result)
    assert line.startswith("error: the replay is not bit for bit: first divergence at step 15: grad_norm "), line
    assert "state" not in line   # the state after step 15's update is the record's


def test_a_record_from_a_cpu_with_other_instruction_sets_is_named_as_the_likely_cause(store_copy):
    """Two machines of one model name (a cloud VM's "AMD EPYC" with and without AVX-512) pick other kernels and
    may compute other bits: the instruction sets and torch's CPU capability the record names are compared with
    the replay's, and a difference is said with the replay's verdict, before the step that differs."""
    from replay.store.lease import Lease

    env = RunStore.open(store_copy).manifest.environment
    assert env["cpu_flags"] and env["cpu_capability"], env   # recorded with the run
    other = "amx_bf16" if "amx_bf16" not in env["cpu_flags"] else "avx512_fp16"
    gone = env["cpu_flags"][-1]
    with Lease.acquire(store_copy, "a test"):   # the record as a machine with `other` and without `gone` wrote it
        store = RunStore.open(store_copy, mode="a")
        store.update_manifest(environment={**env, "cpu_flags": [*env["cpu_flags"][:-1], other],
                                           "cpu_capability": "ZVECTOR"})
        store.root["steps/grad_norm"][14] = store.root["steps/grad_norm"][14] * (1 + 1e-12)
    result = replay_cli("run", str(store_copy), "--from", "13", "--to", "14", "--verify")
    assert result.returncode == 5, result.stderr
    said = f"CPU instruction sets: {other} on the recording's CPU only, {gone} on the replay's only"
    assert f"environment differs from the recording: {said}" in result.stderr, result.stderr
    line = error_line(result)
    capability = f"cpu_capability: recorded ZVECTOR, replayed {torch.backends.cpu.get_cpu_capability()}"
    assert capability in line and said in line and line.index(said) < line.index("first divergence at step 14"), line


def test_a_state_that_differs_after_an_update_is_named_by_its_tensors(store_copy):
    # the record's digest of one tensor of rank 1 at step 14 changed: the losses, norms and rates of every step
    # are the record's, so only the digests can tell
    store = RunStore.open(store_copy, mode="a")
    names = store.digests.names
    digests = store.root["steps/state_digest"]
    tensor = names.index("model/transformer.h.1.attn.c_attn.weight")
    row = np.asarray(digests[14])
    row[1, tensor] ^= 1
    digests[14] = row
    result = replay_cli("run", str(store_copy), "--from", "12", "--to", "17", "--json")
    assert result.returncode == 5
    v = json.loads(result.stdout)["verification"]
    assert not v["bitwise"] and v["level"] == "state" and v["tensors"] == len(names)
    d = v["divergence"]
    assert d["step"] == 14 and d["scalars"] == []
    assert d["state"] == {"tensors": ["model/transformer.h.1.attn.c_attn.weight"], "ranks": [1], "of": len(names)}
    assert "first divergence at step 14: the state after the update: 1 of" in error_line(result)


def test_an_attention_change_within_fp32_rounding_is_found_in_the_state_at_the_window(store_copy):
    """In FP32 the emulated FA2 on one layer moves the loss by less than its last bit for a step or more: the
    state after step 13's update differs already, and the verification says so at step 13, naming the tensors."""
    result = replay_cli("run", str(store_copy), "--from", "13", "--to", "15", "--verify", "--json",
                        "--attention", "fa2-emu:br=16,bc=16", "--layers", "1", "--checkpoint-every", "1")
    assert result.returncode == 0, result.stderr   # a counterfactual's divergence is its answer
    answer = json.loads(result.stdout)
    d = answer["verification"]["divergence"]
    assert answer["verification"]["level"] == "state" and d["step"] == 13
    assert "model/transformer.h.1.attn.c_attn.weight" in d["state"]["tensors"] and d["state"]["ranks"] == [0, 1]
    # the digests tell the truth: its checkpoint 14 holds other layer-1 attention weights than the record's state
    # there (a plain replay of step 13 ends with it, bit for bit)
    plain = json.loads(replay_cli("run", str(store_copy), "--from", "13", "--to", "13", "--json").stdout)
    assert plain["verification"]["bitwise"] and plain["verification"]["level"] == "state"
    name = "transformer.h.1.attn.c_attn.weight"
    changed, recorded = RunStore.open(answer["replay"]), RunStore.open(plain["replay"])
    assert not torch.equal(changed.read_model(14, [name])[name], recorded.read_model(14, [name])[name])


@pytest.mark.parametrize("args, expected", [
    (["--from", "25", "--to", "40"], "window 25..40 is outside the record"),
    (["--from", "12", "--to", "11"], "--to 11 is before --from 12"),
    (["--from", "-1", "--to", "3"], "outside the record"),
])
def test_bad_windows_write_nothing(store_copy, args, expected):
    before = tree_snapshot(store_copy)
    assert expected in error_line(replay_cli("run", str(store_copy), *args))
    assert tree_snapshot(store_copy) == before


def test_no_checkpoint_at_or_before_the_window(store_copy):
    import shutil

    shutil.rmtree(store_copy / "checkpoints/00000000")   # e.g. early checkpoints pruned to save disk
    before = tree_snapshot(store_copy)
    assert "no committed checkpoint at or before step 5" in error_line(
        replay_cli("run", str(store_copy), "--from", "5", "--to", "7"))
    assert tree_snapshot(store_copy) == before


def test_corrupted_start_checkpoint_is_named_and_nothing_written(store_copy):
    chunk = corrupt_tensor(store_copy, 10, 0, "/state/replicated/model/transformer.h.0.mlp.c_fc.weight")
    before = tree_snapshot(store_copy)
    line = error_line(replay_cli("run", str(store_copy), "--from", "12", "--to", "14"))
    assert "checkpoint 10 rank 0: array tensors chunk 0 (holding" in line and chunk in line
    assert tree_snapshot(store_copy) == before


@pytest.mark.parametrize("damage, named", [
    (lambda s: (s / "steps/loss/c/0").write_bytes((s / "steps/loss/c/0").read_bytes()[:-9]), "steps/loss is damaged"),
    (lambda s: (s / "steps/sample_ids/c/0/0/0/0").unlink(), "steps/sample_ids is missing 1 of its 1 chunks"),
    (lambda s: (s / "data/tokens/c/0").unlink(), "the embedded data (data/tokens) is not the data the run was"),
    (lambda s: _flip_token(s), "the embedded data (data/tokens) is not the data the run was recorded on"),
], ids=["truncated step log", "missing sample ids", "missing embedded data", "altered embedded data"])
def test_a_damaged_step_log_or_embedded_data_is_named_before_anything_is_written(store_copy, damage, named):
    """What a replay reads besides its checkpoint is checked first: a missing chunk would read as zeros."""
    damage(store_copy)
    before = tree_snapshot(store_copy)
    line = error_line(replay_cli("run", str(store_copy), "--from", "12", "--to", "14"))
    assert named in line and "the store is corrupted there" in line, line
    assert tree_snapshot(store_copy) == before


def _flip_token(store) -> None:
    """One byte of the embedded corpus changed, its chunk's checksum made to match (a copy from elsewhere)."""
    tokens = RunStore.open(store, mode="a").root["data/tokens"]
    data = np.asarray(tokens[:])
    data[1000] ^= 1
    tokens[:] = data


def test_a_damaged_nearest_checkpoint_is_named_and_the_replay_starts_from_the_one_before(store_copy):
    commit = store_copy / "checkpoints" / "00000020" / "zarr.json"
    raw = bytearray(commit.read_bytes())
    raw[raw.index(b'"kind"') + 9] ^= 0x01            # one bit of the commit record's own JSON
    commit.write_bytes(bytes(raw))
    result = replay_cli("run", str(store_copy), "--from", "22", "--to", "23", "--verify", "--json")
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "checkpoint 20 is damaged" in warnings[0] and "from checkpoint 10" in warnings[0]
    answer = json.loads(result.stdout)
    assert answer["warnings"] == [warnings[0].removeprefix("warning: ")]
    assert answer["verification"]["bitwise"] and answer["verification"]["steps"] == [10, 23]


def test_recorded_spike_is_reproduced_by_a_plain_replay(spike_store, tmp_path):
    store_path = tmp_path / "spike"
    shutil.copytree(spike_store, store_path)
    parent = RunStore.open(store_path)
    spike = parent.spikes[0]["step"]
    result = replay_cli("run", str(store_path), "--from", str(spike - 3), "--to", str(spike + 2), "--verify",
                        "--json")
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["verification"]["bitwise"]
    replay = RunStore.open(answer["replay"])
    assert [e["step"] for e in replay.spikes] == [spike]           # the replay's own detector saw it too
    assert f"spike reproduced at [{spike}]" in replay_cli("info", str(store_path)).stdout
    # it started from the pre-spike snapshot the ring flushed, the closest committed state
    snapshot = max(c.step for c in parent.checkpoints() if c.step <= spike - 3)
    assert replay.manifest.replay.start_checkpoint == snapshot


def test_another_backend_on_one_layer_diverges_exactly_at_the_window(store_copy):
    result = replay_cli("run", str(store_copy), "--from", "13", "--to", "15", "--verify", "--json",
                        "--attention", "reference-emu:dtype=bf16", "--layers", "1")
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    v = answer["verification"]
    assert not v["bitwise"] and v["divergence"]["step"] == 13       # the fast-forward 10..12 was exact
    replay = RunStore.open(answer["replay"])
    assert replay.manifest.config.model.attention == "eager;1=reference-emu:dtype=bf16"
    assert replay.manifest.replay.overrides.to_dict() == {"attention": "reference-emu:dtype=bf16", "layers": [1]}
    info = replay_cli("info", str(store_copy))
    assert "diverges at step 13" in info.stdout


def test_skipped_steps_are_not_trained_on_and_the_rest_keep_their_order(store_copy):
    result = replay_cli("run", str(store_copy), "--from", "12", "--to", "17", "--skip", "14-15", "--json")
    assert result.returncode == 0, result.stderr
    replay = RunStore.open(json.loads(result.stdout)["replay"])
    rec, rep = RunStore.open(store_copy).read_steps(), replay.read_steps()
    rows = {s: i for i, s in enumerate(rep["step"])}
    for s in (14, 15):
        assert np.isnan(rep["loss"][rows[s]]) and (rep["sample_ids"][rows[s]] == -1).all()
    for s in (10, 11, 12, 13, 16, 17):   # trained on exactly the recorded samples, in the recorded order
        assert np.array_equal(rep["sample_ids"][rows[s]], rec["sample_ids"][s])
    assert np.array_equal(rep["loss"][: rows[14]], rec["loss"][10:14])      # untouched before the skip
    assert rep["loss"][rows[16]] != rec["loss"][16]                        # two fewer updates show after it
    assert np.array_equal(rep["lr"][rows[16]:], rec["lr"][16:18])           # the schedule moved on as recorded


@pytest.mark.parametrize("args, expected", [
    (["--attention", "flashy"], "unknown attention backend 'flashy'"),
    (["--attention", "sdpa", "--layers", "5"], "layer 5 head 0 is out of range"),
    (["--attention", "sdpa", "--heads", "1"], "--heads needs --layers"),
    (["--fix", "safe-softmax"], "these heads use 'eager'; add --attention fa2-emu"),
    (["--fix", "magic"], "unknown fix 'magic'"),
    (["--skip", "3"], "--skip step 3 is outside the window 12..14"),
    (["--lr-scale", "0"], "--lr-scale must be > 0"),
    (["--name", "../../x"], "is not a replay name"),
])
def test_bad_overrides_write_nothing(store_copy, args, expected):
    before = tree_snapshot(store_copy)
    assert expected in error_line(replay_cli("run", str(store_copy), "--from", "12", "--to", "14", *args))
    assert tree_snapshot(store_copy) == before and not (store_copy.parent / "x").exists()


def test_deepspeed_zero1_window_replays_bit_for_bit(zero1_store, tmp_path):
    store_path = tmp_path / "ds"
    shutil.copytree(zero1_store, store_path)
    result = replay_cli("run", str(store_path), "--from", "5", "--to", "7", "--verify", "--json")
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["verification"]["bitwise"] and answer["verification"]["steps"] == [4, 7]
    replay, parent = RunStore.open(answer["replay"]), RunStore.open(store_path)
    for rank in (0, 1):   # the ZeRO partitions at step 8 equal the recording's, bit for bit
        a = replay.read_shard(8, rank)["state"]["local"]["optimizer"]["single_partition_of_fp32_groups"][0]
        b = parent.read_shard(8, rank)["state"]["local"]["optimizer"]["single_partition_of_fp32_groups"][0]
        assert torch.equal(a, b)


def test_interrupted_replay_is_resumed_or_discarded_never_silently_redone(store_copy, tmp_path):
    window = ["--from", "12", "--to", "19", "--checkpoint-every", "2", "--verify", "--json"]
    # a real SIGKILL of rank 0 once its shard of the replay's checkpoint 16 is written, before the commit:
    # rank 0 commits in order, so 12 and 14 are committed and 16 is not
    killed = replay_cli("run", str(store_copy), *window, env={"REPLAY_FAULT": "before-commit:16:0"})
    assert "rank 0 was killed by signal 9" in error_line(killed)
    before = tree_snapshot(store_copy)
    refused = error_line(replay_cli("run", str(store_copy), *window))
    assert "was interrupted" in refused and "--resume" in refused and "--discard" in refused
    assert tree_snapshot(store_copy) == before
    discarded = shutil.copytree(store_copy, tmp_path / "discarded")

    resumed = replay_cli("run", str(store_copy), *window, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    answer = json.loads(resumed.stdout)
    replay = RunStore.open(answer["replay"])
    assert replay.manifest.resumes[0].from_step == 14              # its own last committed checkpoint
    assert answer["verification"]["bitwise"] and replay.read_steps()["step"].tolist() == list(range(10, 20))

    redone = replay_cli("run", str(discarded), *window, "--discard")
    assert redone.returncode == 0, redone.stderr
    again = json.loads(redone.stdout)
    assert again["verification"]["bitwise"] and RunStore.open(again["replay"]).manifest.resumes == []
