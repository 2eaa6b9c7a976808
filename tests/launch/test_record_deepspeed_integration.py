"""`replay record --launcher deepspeed`: a real DeepSpeed engine on 2 CPU ranks (gloo)."""

from __future__ import annotations

import numpy as np
import torch

from replay.store import RunStore
from tests.conftest import DS_ARGS, killed_and_resumed, replay_cli


def test_zero1_optimizer_partitions_are_in_the_store(zero1_store):
    store = RunStore.open(zero1_store)
    assert store.manifest.launcher == "deepspeed" and store.n_steps == 12
    for ckpt in store.checkpoints()[1:]:
        model = store.read_shard(ckpt.step, 0)["state"]["replicated"]["model"]
        params = [v for k, v in model.items() if k != "lm_head.weight"]   # lm_head is tied to wte
        flat = torch.cat([p.reshape(-1) for p in params])
        parts = [store.read_shard(ckpt.step, r)["state"]["local"]["optimizer"] for r in (0, 1)]
        assert [p["partition_count"] for p in parts] == [[2], [2]]
        fp32 = [p["single_partition_of_fp32_groups"][0] for p in parts]
        # each rank holds a different half; together they are the FP32 master weights of the whole model
        assert abs(fp32[0].numel() - fp32[1].numel()) <= 1 and not torch.equal(fp32[0][:100], fp32[1][:100])
        assert torch.equal(torch.cat(fp32)[: flat.numel()], flat)
        moments = [p["base_optimizer_state"]["state"][0]["exp_avg_sq"] for p in parts]
        assert [m.numel() for m in moments] == [f.numel() for f in fp32] and all((m > 0).any() for m in moments)


def test_zero1_killed_and_resumed_matches_the_uninterrupted_run(zero1_store, tmp_path):
    store_path = tmp_path / "killed"
    killed_and_resumed(store_path, DS_ARGS)
    a, b = RunStore.open(store_path), RunStore.open(zero1_store)
    assert a.manifest.resumes[0].from_step in (0, 4)
    for field in ("loss", "rank_loss", "grad_norm", "lr", "sample_ids"):
        assert np.array_equal(a.read_steps()[field], b.read_steps()[field]), field
    for rank in (0, 1):
        sa = a.read_shard(12, rank)["state"]["local"]["optimizer"]["single_partition_of_fp32_groups"][0]
        sb = b.read_shard(12, rank)["state"]["local"]["optimizer"]["single_partition_of_fp32_groups"][0]
        assert torch.equal(sa, sb)


def test_zero2_bf16_records(tmp_path):
    store_path = tmp_path / "zero2"
    result = replay_cli("record", "--store", str(store_path), "--steps", "4", "--nproc", "2", "--launcher",
                        "deepspeed", "--zero-stage", "2", "--precision", "bf16", "--checkpoint-every", "2")
    assert result.returncode == 0, result.stderr
    store = RunStore.open(store_path)
    assert [c.step for c in store.checkpoints()] == [0, 2, 4]
    model = store.read_shard(4, 0)["state"]["replicated"]["model"]
    assert model["transformer.h.0.attn.c_attn.weight"].dtype == torch.bfloat16   # DeepSpeed's BF16 weights
    master = store.read_shard(4, 1)["state"]["local"]["optimizer"]["single_partition_of_fp32_groups"][0]
    assert master.dtype == torch.float32 and np.isfinite(store.read_steps()["loss"]).all()
