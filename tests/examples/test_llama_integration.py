"""examples/llama: a plain PyTorch loop training transformers' Llama and Qwen2 (built from a config,
grouped-query attention) recorded, replayed bit for bit, overridden per query head and analysed per head.
Every run is a real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from replay.store import RunStore
from tests.conftest import REPO, replay_cli
from tests.examples.conftest import assert_same_run

EXAMPLE = REPO / "examples" / "llama"
N_HEAD, N_KV, HD = 4, 2, 8   # the example's shape: 4 query heads in 2 groups, n_embd 32


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
FSDP = ["--fsdp=True", "--max_iters=16"]   # each decoder layer and the root fully_shard'ed over 2 gloo ranks


def _train(workdir: Path, *args: str, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([*(launcher or [sys.executable]), str(EXAMPLE / "train.py"), *args], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("llama")


def _record(runs: Path, token_file: Path, family: str) -> Path:
    store = runs / family
    done = _train(runs, f"--family={family}", f"--data={token_file}", f"--store={store}", "--max_iters=20",
                  "--checkpoint_every=10")
    assert done.returncode == 0, done.stderr
    return store


@pytest.fixture(scope="module")
def llama(runs, token_file) -> Path:
    return _record(runs, token_file, "llama")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_window_replays_bit_for_bit(family, runs, token_file, llama):
    store = llama if family == "llama" else _record(runs, token_file, family)
    m = RunStore.open(store).manifest
    assert (m.config.model.n_layer, m.config.model.n_head, m.layout["q"]) == \
        (2, N_HEAD, "model.layers.{layer}.self_attn.q_proj.weight")
    result = replay_cli("run", str(store), "--from", "12", "--to", "15", "--verify", "--json")
    assert result.returncode == 0, result.stderr
    v = json.loads(result.stdout)["verification"]
    assert (v["steps"], v["bitwise"], v["level"], v["divergence"]) == ([10, 15], True, "state", None)


def test_one_query_head_on_emulated_bf16_attention_diverges_exactly_at_from(llama):
    result = replay_cli("run", str(llama), "--from", "12", "--to", "14", "--verify", "--json",
                        "--attention", "fa2-emu:dtype=bf16", "--heads", "1.3")
    assert result.returncode == 0, result.stderr
    v = json.loads(result.stdout)["verification"]
    assert not v["bitwise"] and v["divergence"]["step"] == 12   # steps 10, 11 were bit for bit


def test_diff_of_one_query_head_traces_the_transformers_model_without_changing_its_bits(llama):
    """`replay diff` through transformers' attention interface, grouped-query attention: side A's replay, traced,
    is the record bit for bit (no note: tracing adds nothing to the backward's graph); head 1.3 on emulated BF16
    is the first difference, the only head whose O moves, and the heads sharing its key/value head show the
    same dK."""
    done = replay_cli("diff", str(llama), "--step", "12", "--attention", "fa2-emu:dtype=bf16", "--heads", "1.3",
                      "--json")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["notes"] == []
    assert (answer["first"]["where"], answer["first"]["what"]) == ("attention 1", "O")
    heads = {(h["layer"], h["head"]): h for h in answer["heads"]}
    assert len(heads) == 2 * N_HEAD and [k for k, h in heads.items() if h["o"] > 0] == [(1, 3)]
    assert heads[(1, 2)]["dk"] == heads[(1, 3)]["dk"] > 0


@pytest.fixture(scope="module")
def fsdp(runs, token_file) -> Path:
    """The FSDP2 recording, 16 steps, checkpoints every 10; its `--out` (each step's loss, the final weights
    gathered whole) beside it: fsdp.pt."""
    store = runs / "fsdp"
    done = _train(runs, *FSDP, f"--data={token_file}", f"--store={store}", "--checkpoint_every=10",
                  f"--out={runs / 'fsdp.pt'}", launcher=TORCHRUN)
    assert done.returncode == 0, done.stderr[-3000:]
    return store


def test_sharded_with_fsdp2_it_replays_and_one_query_head_with_the_fix_diverges_at_from(fsdp):
    """Each rank checkpoints its pieces, and a query head's override (the flash emulation with the safe-softmax
    fix) reaches the sharded layers through transformers' AttentionInterface, diverging exactly at --from."""
    store = fsdp
    sharding = RunStore.open(store).manifest.sharding
    assert sharding is not None and sharding.kind == "fsdp2"
    assert [p.length for p in sharding.tensors["model.layers.1.self_attn.q_proj.weight"].pieces] == [16, 16]
    result = replay_cli("run", str(store), "--from", "12", "--to", "13", "--verify", "--json",
                        "--attention", "fa2-emu:dtype=bf16", "--fix", "safe-softmax", "--heads", "1.1")
    assert result.returncode == 0, result.stderr
    v = json.loads(result.stdout)["verification"]
    assert not v["bitwise"] and v["divergence"]["step"] == 12   # steps 10, 11 were bit for bit


def test_sharded_with_fsdp2_a_recording_trains_as_the_script_without_replay_bit_for_bit(fsdp, runs, token_file):
    """The same sharded run without its replay lines (--record=False): rank 0's loss at every step and the
    final weights, gathered whole, are the recording's."""
    done = _train(runs, *FSDP, f"--data={token_file}", "--record=False", f"--out={runs / 'fsdp-plain.pt'}",
                  launcher=TORCHRUN)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_run(runs / "fsdp.pt", runs / "fsdp-plain.pt", steps=16)


def test_per_head_metrics_of_grouped_query_attention_are_the_svds_of_the_stored_weights(llama):
    """Query head h reads key/value head h // 2: its W_K, W_V numbers (spectral norms; relative update per
    step from checkpoint 10 to 20 and the cosine of that update with the one from 0 to 10) and W_Q,h W_K,g^T
    are those of that group's rows of k_proj / v_proj (nn.Linear keeps (out, in))."""
    from replay.analysis import jobs, tasks
    from replay.analysis.names import HEAD_MATRICES, MATRICES

    store = RunStore.open(llama)
    items, _ = jobs.plan_metrics(RunStore.open(llama, mode="a"))
    item = next(i for i in items if i.ckpt.step == 20)
    values = tasks.compute_metrics(item)
    w, w10, w0 = ({k: t.double().numpy() for k, t in store.read_shard(step, 0)["state"]["replicated"]["model"].items()}
                  for step in (20, 10, 0))
    sigma = lambda m: np.linalg.svd(m, compute_uv=False)[0]   # noqa: E731
    for layer in range(2):
        p = f"model.layers.{layer}."
        q, k, v, o = (w[p + f"self_attn.{n}_proj.weight"] for n in "qkvo")
        assert k.shape == (N_KV * HD, N_HEAD * HD)
        whole = {"q": q, "k": k, "v": v, "o": o, "fc": w[p + "mlp.up_proj.weight"],
                 "proj": w[p + "mlp.down_proj.weight"]}
        for i, name in enumerate(MATRICES):
            assert values["spectral"][layer, i] == pytest.approx(sigma(whole[name]), rel=1e-5), (layer, name)
        for head in range(N_HEAD):
            rows, group = slice(head * HD, (head + 1) * HD), slice(head // 2 * HD, (head // 2 + 1) * HD)
            expected = {"q": q[rows], "k": k[group], "v": v[group], "o": o[:, rows]}
            for i, name in enumerate(HEAD_MATRICES):
                assert values["spectral_head"][layer, i, head] == pytest.approx(sigma(expected[name]), rel=1e-5), \
                    (layer, name, head)
            qk = q[rows].T @ k[group]   # W_Q,h W_K,g^T as (in, in)
            assert values["spectral_qk"][layer, head] == pytest.approx(sigma(qk), rel=1e-5), (layer, head)
            for i, name in ((1, "k"), (2, "v")):
                key = p + f"self_attn.{name}_proj.weight"
                now, then = w[key][group] - w10[key][group], w10[key][group] - w0[key][group]
                rel = np.linalg.norm(now) / np.linalg.norm(w10[key][group]) / 10
                cos = (now * then).sum() / (np.linalg.norm(now) * np.linalg.norm(then))
                assert values["update_rel_head"][layer, i, head] == pytest.approx(rel, rel=1e-6), (layer, name, head)
                assert values["update_cos_head"][layer, i, head] == pytest.approx(cos, rel=1e-6), (layer, name, head)


def test_the_probe_is_the_recorded_models_attention_on_its_first_batch_after_rope(llama, token_file):
    """The probe rows are the first training forward's inputs; its entropy per query head is that of the
    attention transformers' own eager forward returns, and its max logit that of q k^T / sqrt(hd) with
    RoPE applied and each query head on its group's key head, recomputed here step by step."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from replay.analysis import jobs, tasks

    store = RunStore.open(llama)
    info = store.manifest.model
    first = store.read_steps(["sample_ids"])["sample_ids"][0, 0, 0]
    tokens = np.memmap(token_file, dtype=np.uint16, mode="r")
    assert info.probe == [tokens[i:i + 32].astype(int).tolist() for i in first]   # --block_size 32, 4 rows
    items, _ = jobs.plan_metrics(RunStore.open(llama, mode="a"))
    values = tasks.compute_metrics(next(i for i in items if i.ckpt.step == 20))

    model = AutoModelForCausalLM.from_config(LlamaConfig.from_dict(info.transformers_config),
                                             attn_implementation="eager")
    weights = store.read_shard(20, 0)["state"]["replicated"]["model"]
    model.load_state_dict(weights, strict=False)
    x = torch.tensor(info.probe)
    with torch.no_grad():
        out = model(input_ids=x, output_attentions=True, output_hidden_states=True)
        for layer in range(2):
            p = out.attentions[layer][..., 1:, :]   # [batch, head, row, key]; row 0 sees one key
            entropy = -(p * torch.log(p.clamp_min(1e-38))).sum(-1).mean(dim=(0, 2))
            assert np.allclose(values["attn_entropy"][layer], entropy.numpy(), rtol=1e-5)
            block = model.model.layers[layer]
            h = block.input_layernorm(out.hidden_states[layer])
            b, t, _ = h.shape
            q = block.self_attn.q_proj(h).view(b, t, N_HEAD, HD).transpose(1, 2)
            k = block.self_attn.k_proj(h).view(b, t, N_KV, HD).transpose(1, 2)
            cos, sin = model.model.rotary_emb(h, torch.arange(t)[None])
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            logits = q @ k[:, [0, 0, 1, 1]].transpose(-1, -2) / HD ** 0.5
            logits = logits.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -torch.inf)
            assert np.allclose(values["max_logit"][layer], logits.amax(dim=(0, 2, 3)).numpy(), rtol=1e-5)
    assert np.isfinite(values["tie_rate"]).all() and np.isfinite(values["log_z"]).all()
