"""`replay record` and `replay run --verify` on a CUDA GPU: BF16 autocast, every attention kind, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replay.store import RunStore
from tests.conftest import replay_cli

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU: records on cuda:0 with nccl-free single-rank training")]

SMALL = ["--set", "model.n_layer=2", "--set", "model.n_head=4", "--set", "model.n_embd=256",
         "--set", "model.block_size=256", "--set", "device=cuda"]


@pytest.mark.parametrize("attention", ["eager", "sdpa", "triton-fa2", "fa2-emu:keys=decreasing"])
def test_a_cuda_recording_replays_bit_for_bit(tmp_path, attention):
    store = tmp_path / "run"
    result = replay_cli("record", "--store", store, "--steps", "16", "--checkpoint-every", "8", "--precision", "bf16",
                        "--attention", attention, *SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    run = RunStore.open(store)
    env = run.manifest.environment
    assert env["device"] == "cuda:0" and env["cuda"]["gpu"] == torch.cuda.get_device_name(0)
    assert env["deterministic_algorithms"] and not env["tf32"]
    losses = run.read_steps(["loss"])["loss"]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]

    replayed = replay_cli("run", store, "--from", "8", "--to", "15", "--verify")
    assert replayed.returncode == 0, replayed.stderr[-3000:]
    assert "bit for bit" in replayed.stdout
    # and the comparison can fail: the same window at another learning rate differs from the record
    changed = replay_cli("run", store, "--from", "8", "--to", "15", "--lr-scale", "1.5", "--name", "lr")
    assert changed.returncode == 0, changed.stderr[-3000:]
    other = RunStore.open(store / "replays" / "lr").read_steps(["loss"])["loss"]
    assert other[0] == losses[8] and not np.array_equal(other, losses[8:])
