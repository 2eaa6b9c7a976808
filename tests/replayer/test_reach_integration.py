"""Overrides prove they reached their target: a replay counts the calls each override replaced, keeps the counts
in its manifest, and stops, keeping nothing, when an override reached nothing (recorder/overrides.py).

The script is minGPT's shape (its attention computed by hand: q @ k^T, masked_fill, softmax, dropout, @ v,
which no `--attention` can reach), and the changes that make it reachable: with --call, the documented one,
replay's `causal_attention` (the run's bits unchanged), with --sdpa, one call of
torch.nn.functional.scaled_dot_product_attention instead, and with --flex, flex attention through replay's
`flex_attention` call (kernels/flex.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from replay.launch.script import ScriptServer
from replay.store import RunStore
from tests.conftest import REPO, error_line, replay_cli, tensors_equal, tree_snapshot

SCRIPT = """
import math
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, create_mask
from replay.kernels.explicit import causal_attention
from replay.kernels.flex import flex_attention
from replay.recorder import Loop

DEVICE = "cuda" if "--cuda" in sys.argv else "cpu"
N_EMBD = 32 if DEVICE == "cuda" else 16   # flex attention's Triton kernels on a GPU: heads of 16 at least
CAUSAL = create_block_mask(lambda b, h, q, k: q >= k, None, None, 8, 8, device=DEVICE,
                           BLOCK_SIZE=4 if DEVICE == "cpu" else 128)

def cpu_flex(q, k, v, block_mask, **_):   # torch's flex attention has no backward on a CPU: a stand-in kernel
    return F.scaled_dot_product_attention(q, k, v, attn_mask=create_mask(block_mask.mask_mod, None, None, 8, 8))

FLEX = torch.compile(torch.nn.attention.flex_attention.flex_attention) if DEVICE == "cuda" else cpu_flex

class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd=N_EMBD, n_head=2, block_size=8):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.attn_dropout, self.n_head, self.n_embd = nn.Dropout(0.1), n_head, n_embd
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if "--sdpa" in sys.argv:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0, is_causal=True)
        elif "--flex" in sys.argv:
            y = flex_attention(q, k, v, block_mask=CAUSAL, kernel=FLEX)
        elif "--call" in sys.argv:
            y = causal_attention(q, k, v, dropout=self.attn_dropout)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = self.attn_dropout(F.softmax(att, dim=-1))
            y = att @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

class GPT(nn.Module):
    def __init__(self, vocab=32, n_embd=N_EMBD):
        super().__init__()
        self.wte, self.attn, self.lm_head = nn.Embedding(vocab, n_embd), CausalSelfAttention(), nn.Linear(n_embd, vocab)

    def forward(self, idx):
        return self.lm_head(self.attn(self.wte(idx)))

torch.manual_seed(0)
model = GPT().to(DEVICE)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = torch.randint(0, 32, (64, 9)).to(DEVICE)
with Loop(sys.argv[1], model, optimizer, total_steps=6, checkpoint_every=2) as loop:
    for step in loop.steps():
        ix = loop.sample_ids(torch.randint(0, 64, (4,)))
        x, y = data[ix.to(DEVICE), :8], data[ix.to(DEVICE), 1:]
        loss = F.cross_entropy(model(x).view(-1, 32), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loop.log(loss=loss)
"""

COUNTERFACTUAL = ["--from", "2", "--to", "3", "--attention", "reference-emu:dtype=bf16", "--layers", "0"]


def _record(tmp_path: Path, *flags: str) -> Path:
    tmp_path.mkdir(exist_ok=True)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    store = tmp_path / "run"
    done = subprocess.run([sys.executable, str(script), str(store), *flags], cwd=tmp_path, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert done.returncode == 0, done.stderr
    return store


def test_an_attention_override_that_reaches_no_call_stops_the_replay_in_one_line_and_keeps_nothing(tmp_path):
    store = _record(tmp_path)
    before = tree_snapshot(store)
    result = replay_cli("run", str(store), *COUNTERFACTUAL, "--verify")
    assert result.returncode == 2
    line = error_line(result)
    assert "reached no attention call of layer(s) 0 in step 2, the window's first" in line
    assert "never called torch.nn.functional.scaled_dot_product_attention" in line
    assert "it called masked_fill, matmul, softmax" in line and "nothing of the replay is kept" in line
    assert "y = causal_attention(q, k, v, dropout=<that nn.Dropout>)" in line
    assert "rank 0:" not in result.stderr   # said once, by the command
    assert not (store / "replays").exists() or not any((store / "replays").iterdir())
    assert tree_snapshot(store) == before


def test_after_the_documented_change_the_override_reaches_every_call_and_diverges_at_from(tmp_path):
    store = _record(tmp_path, "--sdpa")
    with ScriptServer(RunStore.open(store).manifest.command) as served:   # the script started once for both
        plain = json.loads(replay_cli("run", str(store), "--from", "2", "--to", "3", "--json", ranks=served).stdout)
        result = replay_cli("run", str(store), *COUNTERFACTUAL, "--json", ranks=served)
    assert plain["verification"]["bitwise"] and plain["reached"] is None   # nothing to reach
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    d = answer["verification"]["divergence"]
    assert answer["verification"]["level"] == "state" and d["step"] == 2 and d["state"]["tensors"]
    reached = answer["reached"]
    assert reached["counters"] == ["attention 0.0 reference-emu:dtype=bf16", "attention 0.1 reference-emu:dtype=bf16"]
    assert reached["steps"] == [2, 3] and reached["counts"] == [[1, 1], [1, 1]] and reached["refused"] is None
    assert reached["path"] == [{"layer": 0, "backend": "reference-emu:dtype=bf16", "heads": [0, 1], "calls": 2}]
    manifest = RunStore.open(answer["replay"]).manifest.replay_spec
    assert manifest.reached is not None and manifest.reached.totals() == {c: 2 for c in reached["counters"]}
    info = replay_cli("info", str(store)).stdout
    assert "reached: 4 attention calls on reference-emu:dtype=bf16 over 2 head(s) (0.0, 0.1)" in info
    assert "attention path (rank 0): layer 0 heads 0-1: reference-emu:dtype=bf16 (2 calls each)" in info


def test_the_documented_call_records_the_run_bit_for_bit_and_the_override_reaches_it(tmp_path):
    hand, call = _record(tmp_path / "hand"), _record(tmp_path / "call", "--call")
    a, b = RunStore.open(hand), RunStore.open(call)
    assert [c.step for c in a.checkpoints()] == [c.step for c in b.checkpoints()] == [0, 2, 4, 6]
    for step in (2, 4, 6):   # every tensor of the state: model, AdamW's moments, torch's RNG state
        left, right = a.read_shard(step, 0), b.read_shard(step, 0)
        for tree in (left, right):   # the script seeds torch's generator alone: Python's and numpy's start anew
            del tree["rng"]["python"], tree["rng"]["numpy"]
        assert left["rng"] and left["state"]
        assert tensors_equal(left, right), step
    with ScriptServer(RunStore.open(call).manifest.command) as served:   # the script started once for both
        result = replay_cli("run", str(call), *COUNTERFACTUAL, "--json", ranks=served)
        plain = json.loads(replay_cli("run", str(call), "--from", "2", "--to", "3", "--json", ranks=served).stdout)
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["verification"]["divergence"]["step"] == 2
    assert answer["reached"]["path"] == [{"layer": 0, "backend": "reference-emu:dtype=bf16", "heads": [0, 1],
                                          "calls": 2}]
    assert plain["verification"]["bitwise"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: torch's flex attention trains on one only")])])
def test_flex_attention_through_replays_call_is_reached_by_the_override_and_diverges_at_from(tmp_path, device):
    store = _record(tmp_path, "--flex", *(["--cuda"] if device == "cuda" else []))   # on a CPU, a stand-in kernel
    with ScriptServer(RunStore.open(store).manifest.command) as served:   # the script started once for both
        plain = json.loads(replay_cli("run", str(store), "--from", "2", "--to", "3", "--json", ranks=served).stdout)
        result = replay_cli("run", str(store), *COUNTERFACTUAL, "--json", ranks=served)
    assert plain["verification"]["bitwise"] and plain["verification"]["level"] == "state"
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    divergence = answer["verification"]["divergence"]
    assert divergence["step"] == 2 and divergence["state"]["tensors"]
    assert answer["reached"]["path"] == [{"layer": 0, "backend": "reference-emu:dtype=bf16", "heads": [0, 1],
                                          "calls": 2}]
