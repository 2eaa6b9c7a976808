"""A DeepSpeed engine in a user's loop (`Loop(store, engine, optimizer)`, recorder/zero.py) on 2 CPU ranks
(gloo): ZeRO-3, whose every rank checkpoints its own partitions of the parameters and of the optimizer, and
ZeRO-2, whose module is whole on every rank. Recorded once per stage; each test replays or resumes it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from replay.analysis.metrics import weight_metrics
from replay.analysis.names import HEAD_MATRICES
from replay.errors import StoreError
from replay.processes import descendants, start_time
from replay.store import RunStore
from tests.conftest import REPO, assert_gone, replay_cli

SCRIPT = '''import contextlib
import os
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ["TORCHDYNAMO_DISABLE"] = "1"   # DeepSpeed's optimizer check imports torch.compile's stack (3 s a rank)
import deepspeed
import deepspeed.ops
import torch
import torch.nn.functional as F

from replay.recorder import Loop

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False   # no C++ build of an op training never calls
deepspeed.init_distributed(dist_backend="gloo")
store, stage, gathered = sys.argv[1], int(sys.argv[2]), sys.argv[3]
VOCAB, WIDTH, HEADS, T = 32, 16, 2, 8


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn, self.c_proj, self.n_head = torch.nn.Linear(WIDTH, 3 * WIDTH), torch.nn.Linear(WIDTH, WIDTH), HEADS

    def forward(self, h):
        b, t, _ = h.shape
        q, k, v = (y.view(b, t, HEADS, -1).transpose(1, 2) for y in self.c_attn(h).split(WIDTH, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(a.transpose(1, 2).reshape(b, t, WIDTH))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.mlp = Attention(), torch.nn.Module()
        self.mlp.c_fc, self.mlp.c_proj = torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, h):
        h = h + self.attn(h)
        return h + self.mlp.c_proj(F.gelu(self.mlp.c_fc(h)))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = torch.nn.Module()
        self.transformer.wte, self.transformer.h = torch.nn.Embedding(VOCAB, WIDTH), torch.nn.ModuleList([Block()])
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        h = self.transformer.wte(x)
        for block in self.transformer.h:
            h = block(h)
        return self.head(h)


torch.manual_seed(0)
data = torch.randint(0, VOCAB, (64, T + 1))
model = Model()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.1 * s))
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "zero_optimization": {"stage": stage, "reduce_bucket_size": 1 << 16, "allgather_bucket_size": 1 << 16},
          "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30}   # buckets of the model's size, not 2 GB
if stage == 3:   # the biases stay whole between steps (ZeRO-3's persistent parameters), the weights do not
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 64
with contextlib.redirect_stdout(sys.stderr):
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                           config=config)
slow = float(os.environ.get("SLOW_STEP", "0"))   # seconds a step: a run the test kills half way
with Loop(store, engine, optimizer, scheduler=scheduler, total_steps=8, checkpoint_every=2, layout="nanogpt",
          resume=os.environ.get("RESUME") == "1") as loop:
    for step in loop.steps():
        ids = loop.sample_ids(torch.randint(0, len(data), (2,)))
        x, y = data[ids, :-1], data[ids, 1:]
        loss = F.cross_entropy(engine(x).reshape(-1, VOCAB), y.reshape(-1))
        engine.backward(loss)
        engine.step()
        norm = engine.get_global_grad_norm()
        loop.log(loss=loss, grad_norm=float(norm) if norm is not None else float("nan"))
        time.sleep(slow)
if not loop.replaying:
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        whole = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    if torch.distributed.get_rank() == 0:
        torch.save(whole, gathered)
torch.distributed.destroy_process_group()   # as torch asks: gloo's threads left at exit can abort it (SIGABRT)
'''
STEPS, WIDTH, HEADS = 8, 16, 2


def _torchrun(folder: Path, store: str, stage: int, popen: bool = False, **env: str):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py", store,
           str(stage), f"{store}.pt"]
    full = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env}
    if popen:
        return subprocess.Popen(cmd, cwd=folder, env=full, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    done = subprocess.run(cmd, cwd=folder, env=full, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """The script, and its ZeRO-3 recording `zero3` (with the weights it gathered at the end, zero3.pt)."""
    folder = tmp_path_factory.mktemp("zero")
    (folder / "train.py").write_text(SCRIPT)
    _torchrun(folder, "zero3", 3)
    return folder


def _same(a: RunStore, b: RunStore, fields=("loss", "rank_loss", "grad_norm", "lr", "sample_ids")) -> None:
    for name in fields:
        x, y = np.asarray(a.read_steps([name])[name]), np.asarray(b.read_steps([name])[name])
        assert x.shape == y.shape and np.array_equal(x.view(np.uint8), y.view(np.uint8)), name


def test_zero3_keeps_each_ranks_partitions_and_the_manifest_says_where_they_lie(recorded):
    store = RunStore.open(recorded / "zero3")
    assert store.manifest.status == "complete" and [c.step for c in store.checkpoints()] == [0, 2, 4, 6, 8]
    sharding = store.manifest.sharding
    assert sharding is not None and sharding.kind == "zero3"
    spec = sharding.tensors["transformer.h.0.attn.c_attn.weight"]
    assert spec.shape == [3 * WIDTH, WIDTH] and spec.dim is None
    assert [(p.offset, p.length) for p in spec.pieces] == [(0, 384), (384, 384)]   # 768 elements, half each
    for rank in (0, 1):
        index = store.shard_index(STEPS, rank)
        piece = index["/state/local/model/transformer.h.0.attn.c_attn.weight"]
        assert piece["shape"] == [384]
        assert not any(k.startswith("/state/replicated/model/") for k in index)   # no whole parameter anywhere
    gathered = torch.load(recorded / "zero3.pt")
    whole = store.read_model(STEPS, list(gathered))
    for name, tensor in gathered.items():   # what the script gathered at the end, assembled from the partitions
        assert torch.equal(whole[name], tensor), name


def _heads(q_k_v_o: dict[str, np.ndarray]) -> np.ndarray:
    """[matrix, head] largest singular values of each head's slice, by a plain SVD."""
    hd = WIDTH // HEADS
    out = np.zeros((len(HEAD_MATRICES), HEADS))
    for i, name in enumerate(HEAD_MATRICES):
        m = q_k_v_o[name].astype(np.float64)
        for h in range(HEADS):
            part = m[:, h * hd:(h + 1) * hd] if name != "o" else m[h * hd:(h + 1) * hd, :]
            out[i, h] = np.linalg.svd(part, compute_uv=False)[0]
    return out


def _matrices(c_attn: torch.Tensor, c_proj: torch.Tensor) -> dict[str, np.ndarray]:
    """W_Q, W_K, W_V, W_O as (in, out) from nn.Linear weights (out, in)."""
    qkv = c_attn.double().numpy().T
    return {"q": qkv[:, :WIDTH], "k": qkv[:, WIDTH:2 * WIDTH], "v": qkv[:, 2 * WIDTH:],
            "o": c_proj.double().numpy().T}


def test_per_head_spectral_norms_of_the_assembled_weights_are_the_gathered_ones(recorded):
    store = RunStore.open(recorded / "zero3")
    names = ["transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.weight"]
    read = store.read_model(STEPS, names)
    gathered = torch.load(recorded / "zero3.pt")
    analysed = weight_metrics(_matrices(*(read[n] for n in names)), HEADS)["spectral_head"]
    independent = _heads(_matrices(*(gathered[n] for n in names)))
    assert analysed.shape == (4, HEADS) and np.allclose(analysed, independent, rtol=1e-9, atol=0)


def test_zero3_replays_bit_for_bit(recorded):
    result = replay_cli("run", str(recorded / "zero3"), "--from", "3", "--to", "6", "--verify")
    assert "bit for bit" in result.stdout, result.stderr[-3000:]


def test_another_attention_on_layer_0_diverges_exactly_at_the_window(recorded):
    result = replay_cli("run", str(recorded / "zero3"), "--from", "5", "--to", "6", "--verify", "--json",
                        "--attention", "reference-emu:dtype=bf16", "--layers", "0")
    assert result.returncode == 0, result.stderr[-3000:]
    v = json.loads(result.stdout)["verification"]
    assert not v["bitwise"] and v["divergence"]["step"] == 5   # step 4, from checkpoint 4, was exact


def _committed(store: Path) -> list[int]:
    try:
        return [c.step for c in RunStore.open(store).checkpoints()]
    except StoreError:   # not created yet
        return []


def test_zero3_killed_and_resumed_matches_the_uninterrupted_run(recorded):
    proc = _torchrun(recorded, "cut", 3, popen=True, SLOW_STEP="0.3")
    deadline = time.monotonic() + 120
    while not any(step >= 4 for step in _committed(recorded / "cut")):
        assert proc.poll() is None and time.monotonic() < deadline, "the recording ended before it was killed"
        time.sleep(0.02)
    start = start_time(proc.pid)
    assert start is not None, "torchrun is running"
    procs = {proc.pid: start, **descendants(proc.pid)}
    for pgid in {os.getpgid(pid) for pid in procs}:   # torchrun starts each rank in a session of its own
        os.killpg(pgid, signal.SIGKILL)
    proc.wait()
    assert_gone(procs)
    cut = RunStore.open(recorded / "cut")
    last = cut.checkpoints()[-1].step
    assert cut.manifest.status != "complete" and 4 <= last < STEPS
    _torchrun(recorded, "cut", 3, RESUME="1")
    a, b = RunStore.open(recorded / "zero3"), RunStore.open(recorded / "cut")
    assert b.manifest.status == "complete" and [r.from_step for r in b.manifest.resumes] == [last]
    _same(a, b)
    names = list(a.manifest.sharding.tensors)
    final_a, final_b = a.read_model(STEPS, names), b.read_model(STEPS, names)
    assert all(torch.equal(final_a[n], final_b[n]) for n in names)


def test_zero2_records_each_ranks_optimizer_partition_and_the_whole_module(recorded):
    """Its replays restore as the built-in trainer's ZeRO-1/2 runs do (tests/launch/test_record_deepspeed_integration.py
    replays those bit for bit), through the same DeepSpeedTrainState."""
    _torchrun(recorded, "zero2", 2)
    store = RunStore.open(recorded / "zero2")
    assert store.manifest.sharding is None
    _same(store, RunStore.open(recorded / "zero3"), fields=("sample_ids",))   # the same draws, another partitioning
    gathered = torch.load(recorded / "zero2.pt")
    whole = store.read_model(STEPS, list(gathered))   # rank 0's whole module
    assert all(torch.equal(whole[n], gathered[n]) for n in gathered)
    parts = [store.read_shard(STEPS, r)["state"]["local"]["optimizer"]["single_partition_of_fp32_groups"][0]
             for r in (0, 1)]
    assert abs(parts[0].numel() - parts[1].numel()) <= 1   # each rank's half of the FP32 master weights
