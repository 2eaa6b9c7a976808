"""`replay record` end to end: real rank processes (torch.distributed, gloo), a real Zarr store on disk."""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest
import torch

from replay.store import RunStore
from replay.train.data import make_data
from replay.train.model import build_model, lm_loss
from tests.conftest import corrupt_tensor, error_line, replay_cli, tree_snapshot


def test_two_rank_store_array_by_array(two_rank_store):
    store = RunStore.open(two_rank_store)
    m = store.manifest
    cfg = m.config
    assert m.world_size == 2 and m.launcher == "local" and m.status == "complete"
    assert m.environment["torch_threads"] == cfg.threads and m.environment["deterministic_algorithms"]
    tokens = store.read_tokens()
    assert m.data.digest == hashlib.sha256(tokens.tobytes()).hexdigest()

    steps = store.read_steps()
    assert store.n_steps == 30 and steps["step"].tolist() == list(range(30))
    ids = steps["sample_ids"]
    assert ids.shape == (30, 2, 1, 4)                          # (step, rank, micro, sample)
    n_samples = (len(tokens) - 1) // cfg.model.block_size
    assert ids.min() >= 0 and ids.max() < n_samples
    assert len(np.unique(ids)) == ids.size                     # 240 draws of one epoch: never twice
    assert np.array_equal(steps["loss"], steps["rank_loss"].mean(axis=1))
    assert not np.array_equal(steps["rank_loss"][:, 0], steps["rank_loss"][:, 1])  # ranks saw different data
    assert (steps["tokens"] == 8 * cfg.model.block_size).all()
    assert np.isfinite(steps["grad_norm"]).all() and (steps["grad_norm"] > 0).all()
    # lr: linear warmup over 10 steps to 1e-3, then cosine to 1e-4 over the remaining 20
    expected_lr = [1e-3 * (s + 1) / 10 if s < 10 else 1e-4 + 0.45e-3 * (1 + math.cos(math.pi * (s - 10) / 20))
                   for s in range(30)]
    assert np.allclose(steps["lr"], expected_lr, rtol=1e-12)
    assert steps["loss"][-1] < steps["loss"][0] - 0.5          # it trained

    assert [(c.step, c.kind, c.world_size) for c in store.checkpoints()] == [
        (0, "regular", 2), (10, "regular", 2), (20, "regular", 2), (30, "regular", 2)]
    model = build_model(cfg.model, 256, cfg.seed)
    for ckpt in store.checkpoints():
        shard0, shard1 = store.read_shard(ckpt.step, 0), store.read_shard(ckpt.step, 1)
        assert set(shard0["state"]["replicated"]["model"]) == set(model.state_dict())
        assert shard0["state"]["replicated"]["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)
        assert shard1["state"]["replicated"] == {}              # replicated state is written once
        for shard in (shard0, shard1):
            assert set(shard["rng"]) >= {"python", "numpy", "torch"}
    # checkpoint 0 is the initial state: the seeded initialisation, bit for bit
    init = store.read_shard(0, 0)["state"]["replicated"]["model"]
    assert all(torch.equal(init[k], v) for k, v in model.state_dict().items())
    assert steps["step_time"].min() > 0


def test_checkpoint_reloaded_into_a_fresh_model_gives_the_recorded_loss_bitwise(two_rank_store):
    store = RunStore.open(two_rank_store)
    cfg = store.manifest.config
    torch.set_num_threads(cfg.threads)
    data = make_data(cfg, store.read_tokens())
    steps = store.read_steps()
    for step in (10, 20):
        model = build_model(cfg.model, data.vocab_size, seed=12345)   # different init: all comes from the store
        model.load_state_dict(store.read_shard(step, 0)["state"]["replicated"]["model"])
        for rank in (0, 1):
            x, y = data.batch(steps["sample_ids"][step, rank, 0])
            loss = lm_loss(model, x, y).item()
            assert loss == steps["rank_loss"][step, rank], (step, rank)


def test_info_and_batch_read_the_store(two_rank_store):
    info = replay_cli("info", str(two_rank_store), "--json")
    assert info.returncode == 0, info.stderr
    import json

    summary = json.loads(info.stdout)
    assert summary["steps_recorded"] == 30 and [c["step"] for c in summary["checkpoints"]] == [0, 10, 20, 30]

    out = replay_cli("batch", str(two_rank_store), "--step", "7", "--rank", "1", "--json")
    rows = json.loads(out.stdout)
    store = RunStore.open(two_rank_store)
    T = store.manifest.config.model.block_size
    tokens = store.read_tokens()
    assert [r["sample_id"] for r in rows] == store.read_steps()["sample_ids"][7, 1, 0].tolist()
    for r in rows:   # the decoded text is exactly those bytes of the corpus
        sid = r["sample_id"]
        assert r["text"] == bytes(tokens[sid * T: sid * T + T + 1]).decode("utf-8", "replace")


@pytest.mark.parametrize("args, expected", [
    (["--preset", "gpt5"], "unknown preset 'gpt5'"),
    (["--set", "optim.learning_rate=1"], "unknown config key 'optim.learning_rate'"),
    (["--data", "/nonexistent/train.bin"], "data file /nonexistent/train.bin does not exist"),
    (["--attention", "flashy"], "unknown attention backend 'flashy'"),
    (["--attention", "eager;5=fa2-emu"], "targets layer 5, but the model has layers 0..1"),
    (["--nproc", "3"], "batch_size 8 is not a multiple of micro_batch_size x nproc = 12"),
    (["--set", "numerics=ture"], "config key 'numerics' expects true or false, got 'ture'"),
    (["--set", "batch_size=0"], "batch_size must be >= 1, got 0"),
    (["--set", "log_every=0"], "log_every must be >= 1, got 0"),
    (["--attention", "eager;1.3-1=fa2-emu"], "the head range 3-1 runs backwards"),
])
def test_bad_record_input_writes_nothing(tmp_path, args, expected):
    store = tmp_path / "new"
    result = replay_cli("record", "--store", str(store), *args)
    assert expected in error_line(result) and result.stderr.strip() == error_line(result)   # nothing else said
    assert not store.exists()


def test_too_short_data_file(tmp_path):
    data = tmp_path / "train.bin"
    np.arange(300, dtype=np.uint16).tofile(data)
    line = error_line(replay_cli("record", "--store", str(tmp_path / "s"), "--data", str(data)))
    assert "is too short" in line and "300 tokens" in line
    assert not (tmp_path / "s").exists()


def test_non_empty_store_without_resume_is_left_untouched(store_copy):
    before = tree_snapshot(store_copy)
    result = replay_cli("record", "--store", str(store_copy), "--steps", "5")
    assert "not empty" in error_line(result) and result.stderr.strip() == error_line(result)
    assert tree_snapshot(store_copy) == before


def test_resume_on_something_that_is_not_a_run_store(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    assert "is not a replay run store" in error_line(replay_cli("record", "--store", str(tmp_path), "--resume"))
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def _edit_manifest(store_path, **fields) -> None:
    """A manifest as another machine would have written it (a legitimate, checksummed write)."""
    from replay.store.lease import Lease

    with Lease.acquire(store_path, "a test"):
        RunStore.open(store_path, mode="a").update_manifest(**fields)


@pytest.fixture
def killed_copy(store_copy):
    """The reference run as a recording killed after its last commit leaves it: "running"."""
    _edit_manifest(store_copy, status="running")
    return store_copy


def test_a_complete_run_is_not_resumed(store_copy):
    before = tree_snapshot(store_copy)
    line = error_line(replay_cli("record", "--store", str(store_copy), "--resume"))
    assert "is complete: all 30 steps are recorded and there is nothing to resume" in line
    assert tree_snapshot(store_copy) == before


def test_resume_with_another_world_size(killed_copy):
    before = tree_snapshot(killed_copy)
    line = error_line(replay_cli("record", "--store", str(killed_copy), "--resume", "--nproc", "1"))
    assert "recorded with 2" in line
    assert tree_snapshot(killed_copy) == before


def test_resume_names_a_corrupted_checkpoint_tensor_and_changes_nothing(killed_copy):
    chunk = corrupt_tensor(killed_copy, 30, 0, "/state/replicated/model/transformer.h.1.attn.c_attn.weight")
    before = tree_snapshot(killed_copy)
    line = error_line(replay_cli("record", "--store", str(killed_copy), "--resume"))
    assert "checkpoint 30 rank 0: array tensors chunk 0 (holding" in line and chunk in line
    assert tree_snapshot(killed_copy) == before


def test_resume_refuses_a_data_order_this_machine_does_not_recompute(killed_copy):
    import zarr

    ids = zarr.open_array(str(killed_copy / "steps/sample_ids"), mode="r+")
    ids[7, 1, 0, 2] = ids[7, 1, 0, 2] + 1        # as if another numpy had drawn the order
    before = tree_snapshot(killed_copy)
    line = error_line(replay_cli("record", "--store", str(killed_copy), "--resume"))
    assert "the data order recomputed here differs from the recorded one at step 7 (rank 1" in line
    assert tree_snapshot(killed_copy) == before


def test_resume_names_what_differs_in_the_environment(killed_copy):
    env = RunStore.open(killed_copy).manifest.environment
    _edit_manifest(killed_copy, environment={**env, "device": "cuda:0", "cuda": {"gpu": "NVIDIA H100"}})
    before = tree_snapshot(killed_copy)
    line = error_line(replay_cli("record", "--store", str(killed_copy), "--resume"))
    assert "recorded on cuda:0 (NVIDIA H100) and this machine has no CUDA device" in line
    assert tree_snapshot(killed_copy) == before

    _edit_manifest(killed_copy, environment={**env, "packages": {**env["packages"], "numpy": "1.0.0"}})
    result = replay_cli("record", "--store", str(killed_copy), "--resume")   # killed after its last step: none left
    assert result.returncode == 0, result.stderr
    assert "warning: the environment differs from the recording's: numpy: recorded 1.0.0" in result.stderr


def test_spike_preset_spikes_and_flushes_its_pre_spike_snapshot(spike_store):
    store = RunStore.open(spike_store)   # `replay record --preset spike --nproc 2` (tests/conftest.py)
    spikes = store.spikes
    assert len(spikes) >= 1
    losses = store.read_steps()["loss"]
    s = spikes[0]["step"]
    # a genuine jump, measured from the log: the loss leaves the 50 steps before it and within three steps rises
    # above 20 times their median (how many steps the rise takes varies with the CPU's kernels: one on an
    # AVX-512 EPYC, two on one without AVX-512)
    before = losses[s - 50:s]
    assert losses[s] > before.max() and losses[s:s + 3].max() > 20 * np.median(before)
    regular = [c.step for c in store.checkpoints() if c.kind == "regular" and c.step <= s]
    snapshots = [c.step for c in store.checkpoints() if c.kind == "snapshot"]
    # the ring held snapshots taken after the last regular checkpoint; they were written when it fired
    assert snapshots and all(regular[-1] < step <= s + 1 for step in snapshots)
    store.read_shard(snapshots[-1], 1)


def test_record_with_an_attention_plan_trains_on_those_backends(tmp_path):
    plan = "eager;1=fa2-emu:br=16,bc=16;1.1=reference-emu:fix=safe-softmax,beta=7"
    runs = {}
    for name, attention in [("plan", plan), ("eager", "eager")]:
        store_path = tmp_path / name
        result = replay_cli("record", "--store", str(store_path), "--steps", "6", "--precision", "bf16",
                            "--attention", attention)
        assert result.returncode == 0, result.stderr
        runs[name] = RunStore.open(store_path)
    assert runs["plan"].manifest.config.model.attention == \
        "eager;1=fa2-emu:br=16,bc=16;1.1=reference-emu:fix=safe-softmax,beta=7"
    a, b = runs["plan"].read_steps()["loss"], runs["eager"].read_steps()["loss"]
    assert a[0] != b[0] and np.allclose(a, b, atol=0.05)   # other rounding, same model: close, not equal


def test_a_replay_names_no_difference_of_a_variable_torch_sets_for_its_own_caches(tmp_path):
    """torch's code sets some variables of its own as it runs (inductor's cache directory, whenever something asks
    where it is), so a recording command may have them and its replay not: they change no bit, and a replay on
    the recording's machine names no difference of environment (one named would excuse a replay that is not bit
    for bit). One rank: it trains in the `replay record` process itself."""
    store = str(tmp_path / "one")
    made = replay_cli("record", "--store", store, "--steps", "4", "--nproc", "1", "--checkpoint-every", "2",
                      env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}, process=True)
    assert made.returncode == 0, made.stderr
    result = replay_cli("run", store, "--from", "2", "--to", "3", "--verify", "--json", process=True)
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["verification"]["bitwise"] and answer["environment_differences"] == [], answer
