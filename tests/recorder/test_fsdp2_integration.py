"""A user's loop over a model sharded with FSDP2 (fully_shard) on 2 gloo ranks: each rank checkpoints its own
pieces, a replay restores them bit for bit, a killed recording resumes to the same run, attention overrides
reach the sharded blocks, and the analysis reads whole weights assembled from the pieces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from replay.store import RunStore
from tests.conftest import REPO, replay_cli
from tests.head_norms import assert_fused_head_norms

SCRIPT = """
import os
import sys
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from replay.recorder import Loop


class CausalSelfAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn, self.c_proj, self.n_head = torch.nn.Linear(16, 48), torch.nn.Linear(16, 16), 2

    def forward(self, h):
        b, t, _ = h.shape
        q, k, v = (y.view(b, t, 2, 8).transpose(1, 2) for y in self.c_attn(h).split(16, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, 16))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = torch.nn.LayerNorm(16), CausalSelfAttention(), torch.nn.LayerNorm(16)
        self.mlp = torch.nn.Sequential()
        self.mlp.add_module("c_fc", torch.nn.Linear(16, 36))
        self.mlp.add_module("gelu", torch.nn.GELU())
        self.mlp.add_module("c_proj", torch.nn.Linear(36, 16))

    def forward(self, h):
        h = h + self.attn(self.ln_1(h))
        return h + self.mlp(self.ln_2(h))


class GPT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = torch.nn.ModuleDict({"wte": torch.nn.Embedding(32, 16),
                                                "h": torch.nn.ModuleList([Block(), Block()]),
                                                "ln_f": torch.nn.LayerNorm(16)})
        self.lm_head = torch.nn.Linear(16, 32, bias=False)

    def forward(self, x):
        h = self.transformer.wte(x)
        for block in self.transformer.h:
            h = block(h)
        return self.lm_head(self.transformer.ln_f(h))


dist.init_process_group("gloo")
torch.manual_seed(0)   # the same whole model on every rank, then each keeps its pieces
model = GPT()
mixed = "--mp" in sys.argv and os.environ.get("NO_MP") != "1"   # NO_MP: a script changed since its record
bf16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if mixed else {}
policy = MixedPrecisionPolicy(**bf16)
for block in model.transformer.h:
    fully_shard(block, mp_policy=policy)
fully_shard(model, mp_policy=policy)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = torch.randint(0, 32, (2048,), generator=torch.Generator().manual_seed(1))
torch.manual_seed(100 + dist.get_rank())   # each rank draws its own batches
loop = Loop(sys.argv[1], model, optimizer, total_steps=18, checkpoint_every=6, layout="nanogpt",
            resume=os.environ.get("RESUME") == "1")
with loop:
    for step in loop.steps():
        ix = loop.sample_ids(torch.randint(len(data) - 9, (4,)))
        x = torch.stack([data[i:i + 8] for i in ix.tolist()])
        y = torch.stack([data[i + 1:i + 9] for i in ix.tolist()])
        loss = F.cross_entropy(model(x).float().view(-1, 32), y.view(-1))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
        optimizer.step()
        optimizer.zero_grad()
        loop.log(loss=loss, grad_norm=norm)
full = {name: t.full_tensor() for name, t in model.state_dict().items()}   # a collective: on every rank
if dist.get_rank() == 0 and os.environ.get("SAVE"):
    torch.save(full, os.environ["SAVE"])
dist.destroy_process_group()
"""


def _torchrun(tmp: Path, store: Path, *flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    script = tmp / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(store), *flags], cwd=tmp, env=full_env, capture_output=True, text=True,
                          timeout=180)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> tuple[Path, Path]:
    """One recording for the module: its store and the whole weights the script gathered at its end."""
    tmp = tmp_path_factory.mktemp("fsdp2")
    done = _torchrun(tmp, tmp / "run", env={"SAVE": str(tmp / "full.pt")})
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp / "run", tmp / "full.pt"


def _bits(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8)


def test_each_rank_checkpoints_its_pieces_and_the_manifest_says_where_they_lie(recorded):
    store_path, full_path = recorded
    store = RunStore.open(store_path)
    sharding = store.manifest.sharding
    assert sharding is not None and sharding.kind == "fsdp2" and sharding.details["mesh"] == [0, 1]
    assert "mixed_precision" not in sharding.details
    spec = sharding.tensors["transformer.h.0.attn.c_attn.weight"]   # [48, 16]: 24 rows each
    assert (spec.shape, spec.dim, [(p.offset, p.length) for p in spec.pieces]) == ([48, 16], 0, [(0, 24), (24, 24)])
    full = torch.load(full_path)
    assert set(sharding.tensors) == set(full)   # every parameter is sharded (the model has no buffers)
    for rank in range(2):   # no whole model anywhere: each shard holds its rank's rows only
        own = store.read_shard(18, rank)["state"]
        assert own["replicated"] == ({"model": {}} if rank == 0 else {})
        piece = own["local"]["model"]["transformer.h.0.attn.c_attn.weight"]
        assert torch.equal(piece, full["transformer.h.0.attn.c_attn.weight"][24 * rank:24 * (rank + 1)])
        exp_avg = own["local"]["optimizer"]["state"][0]["exp_avg"]   # the embedding's, [32, 16]: 16 rows each
        assert exp_avg.shape == (16, 16)
    whole = store.read_model(18, list(full))
    for name, t in full.items():
        assert torch.equal(whole[name], t), name
    assert store.model_shapes(18) == {name: list(t.shape) for name, t in full.items()}   # what compare reads


def test_a_replay_restores_the_pieces_bit_for_bit(recorded):
    store, _ = recorded
    result = replay_cli("run", str(store), "--from", "7", "--to", "13", "--verify", process=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bit for bit" in result.stdout


def test_a_killed_recording_resumes_to_the_same_run(recorded, tmp_path):
    store, full_path = recorded
    cut = tmp_path / "cut"
    killed = _torchrun(tmp_path, cut, env={"REPLAY_FAULT": "before-commit:12:0"})
    assert killed.returncode != 0
    assert [c.step for c in RunStore.open(cut).checkpoints()] == [0, 6]
    resumed = _torchrun(tmp_path, cut, env={"RESUME": "1"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = RunStore.open(store), RunStore.open(cut)
    assert [r.from_step for r in b.manifest.resumes] == [6]
    for name in ("loss", "grad_norm", "sample_ids"):
        x, y = a.read_steps([name])[name], b.read_steps([name])[name]
        assert np.array_equal(_bits(x), _bits(y)), name
    names = list(torch.load(full_path))
    x, y = a.read_model(18, names), b.read_model(18, names)
    for name in names:
        assert torch.equal(x[name], y[name]), name


def test_an_attention_override_reaches_the_sharded_blocks_and_diverges_at_from(recorded):
    """Steps 6 and 7 as recorded, bit for bit; from step 8 on, each rank's pieces of the state after every
    update are others (their digests: a loss may round to the recorded value, the state tells)."""
    store, _ = recorded
    result = replay_cli("run", str(store), "--from", "8", "--to", "10", "--attention", "reference-emu:dtype=bf16",
                        "--layers", "0", "--name", "emu", "--json", process=True)
    assert result.returncode == 0, result.stderr[-3000:]
    v = json.loads(result.stdout)["verification"]
    assert not v["bitwise"] and v["level"] == "state" and v["divergence"]["step"] == 8
    assert v["divergence"]["state"]["ranks"] == [0, 1]   # each rank's own pieces
    replay = RunStore.open(store / "replays" / "emu")
    assert replay.first_step == 6   # from checkpoint 6: steps 6 and 7 as recorded, then the window 8..10
    fields = ["loss", "state_digest"]
    recorded_steps = RunStore.open(store).read_steps(fields, start=6, stop=11)
    replayed = replay.read_steps(fields)
    assert replayed["step"].tolist() == recorded_steps["step"].tolist() == list(range(6, 11))
    for name in fields:
        assert np.array_equal(_bits(replayed[name][:2]), _bits(recorded_steps[name][:2])), name
    moved = (replayed["state_digest"][2:] != recorded_steps["state_digest"][2:]).any(axis=2)   # (step, rank)
    assert moved.all(), moved


def test_the_spectral_norms_of_the_analysis_are_those_of_the_gathered_weights(recorded):
    from replay.analysis import jobs, tasks

    store_path, full_path = recorded
    full = torch.load(full_path)
    items, _ = jobs.plan_metrics(RunStore.open(store_path, mode="a"))
    item = next(i for i in items if i.ckpt.step == 18)
    values = tasks.compute_metrics(item)
    for layer in range(2):   # c_attn [3 * 16 out, 16 in], c_proj [16 out, 16 in]
        assert_fused_head_norms(values, layer, full[f"transformer.h.{layer}.attn.c_attn.weight"],
                                full[f"transformer.h.{layer}.attn.c_proj.weight"], n_head=2)


def test_a_mixed_precision_run_replays_bit_for_bit_and_its_policy_is_checked(tmp_path):
    store = tmp_path / "mp"
    done = _torchrun(tmp_path, store, "--mp")
    assert done.returncode == 0, done.stderr[-3000:]
    sharding = RunStore.open(store).manifest.sharding
    assert sharding is not None
    assert sharding.details["mixed_precision"] == {"param_dtype": "torch.bfloat16", "reduce_dtype": "torch.float32"}
    result = replay_cli("run", str(store), "--from", "7", "--to", "12", "--verify", process=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bit for bit" in result.stdout
    changed = replay_cli("run", str(store), "--from", "7", "--to", "8", "--name", "fp32", env={"NO_MP": "1"},
                         process=True)
    assert changed.returncode != 0
    assert ("the script shards its model with mixed precision none, the record with {'param_dtype': "
            "'torch.bfloat16', 'reduce_dtype': 'torch.float32'}") in changed.stderr, changed.stderr[-3000:]
