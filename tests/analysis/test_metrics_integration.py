"""Analysis results against an independent computation: full numpy SVDs of the checkpoint's tensors
read back from the store, transformers' own forward for the probe, sorted-sample Wasserstein."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replay.analysis.results import read_distances, read_metrics
from replay.store import RunStore

P = "/state/replicated/model/transformer.h.{}."


def _weights(store: RunStore, step: int) -> dict[str, np.ndarray]:
    tree = store.read_shard(step, 0)["state"]["replicated"]["model"]
    return {k: v.double().numpy() for k, v in tree.items()}


def _mats(w: dict[str, np.ndarray], layer: int, d: int) -> dict[str, np.ndarray]:
    p = f"transformer.h.{layer}."
    c_attn = w[p + "attn.c_attn.weight"]
    return {"q": c_attn[:, :d], "k": c_attn[:, d:2 * d], "v": c_attn[:, 2 * d:], "o": w[p + "attn.c_proj.weight"],
            "fc": w[p + "mlp.c_fc.weight"], "proj": w[p + "mlp.c_proj.weight"]}


def _head(m: np.ndarray, name: str, h: int, hd: int) -> np.ndarray:
    return m[h * hd:(h + 1) * hd, :].T if name == "o" else m[:, h * hd:(h + 1) * hd]


def _sigma(m: np.ndarray) -> float:
    return float(np.linalg.svd(m, compute_uv=False)[0])


@pytest.fixture(scope="module")
def context(analysed_store):
    store = RunStore.open(analysed_store)
    cfg = store.manifest.config.model
    table = read_metrics(analysed_store)
    steps = [c.step for c in store.checkpoints()]
    weights = {s: _weights(store, s) for s in steps}
    return store, cfg, table, steps, weights


def test_every_checkpoint_is_analysed(context):
    _, _, table, steps, _ = context
    assert table["step"].tolist() == steps
    for name in ("spectral", "spectral_head", "spectral_qk", "max_logit", "tie_rate"):
        assert np.isfinite(table[name]).all(), name


def test_spectral_norms_match_full_svd(context):
    _, cfg, table, steps, weights = context
    d, H = cfg.n_embd, cfg.n_head
    hd = d // H
    for i, step in enumerate(steps):
        for layer in range(cfg.n_layer):
            mats = _mats(weights[step], layer, d)
            whole = [_sigma(mats[n]) for n in ("q", "k", "v", "o", "fc", "proj")]
            np.testing.assert_allclose(table["spectral"][i, layer], whole, rtol=1e-5)
            for j, name in enumerate(("q", "k", "v", "o")):
                per_head = [_sigma(_head(mats[name], name, h, hd)) for h in range(H)]
                np.testing.assert_allclose(table["spectral_head"][i, layer, j], per_head, rtol=1e-10)
            qk = [_sigma(_head(mats["q"], "q", h, hd) @ _head(mats["k"], "k", h, hd).T) for h in range(H)]
            np.testing.assert_allclose(table["spectral_qk"][i, layer], qk, rtol=1e-10)


def test_update_statistics_match_direct_computation(context):
    _, cfg, table, steps, weights = context
    d = cfg.n_embd
    hd = d // cfg.n_head
    assert np.isnan(table["update_rel"][0]).all() and np.isnan(table["update_cos"][:2]).all()
    for i in range(1, len(steps)):
        for layer in range(cfg.n_layer):
            cur, prev = _mats(weights[steps[i]], layer, d), _mats(weights[steps[i - 1]], layer, d)
            for j, name in enumerate(("q", "k", "v", "o", "fc", "proj")):
                delta = cur[name] - prev[name]
                rel = np.linalg.norm(delta) / np.linalg.norm(prev[name]) / (steps[i] - steps[i - 1])
                srank = np.sum(delta ** 2) / _sigma(delta) ** 2
                np.testing.assert_allclose(table["update_rel"][i, layer, j], rel, rtol=1e-6)
                np.testing.assert_allclose(table["update_srank"][i, layer, j], srank, rtol=1e-4)
                if i >= 2:
                    older = prev[name] - _mats(weights[steps[i - 2]], layer, d)[name]
                    cos = np.sum(delta * older) / (np.linalg.norm(delta) * np.linalg.norm(older))
                    np.testing.assert_allclose(table["update_cos"][i, layer, j], cos, rtol=1e-6)
            h = 1    # one head in full
            delta_h = _head(cur["q"], "q", h, hd) - _head(prev["q"], "q", h, hd)
            np.testing.assert_allclose(table["update_srank_head"][i, layer, 0, h],
                                       np.sum(delta_h ** 2) / _sigma(delta_h) ** 2, rtol=1e-9)


def _bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even) on the bit pattern, independently of torch."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def test_probe_logits_and_ties_match_transformers_forward(context):
    """q and k captured from transformers' own GPT-2 forward on the probe samples."""
    from transformers import GPT2Config, GPT2LMHeadModel

    store, cfg, table, steps, weights = context
    probe = table["attrs"]["probe"]["sample_ids"]
    assert len(probe) == 4
    tokens = store.read_tokens()
    T = cfg.block_size
    x = torch.tensor(np.stack([tokens[i * T:i * T + T] for i in probe]).astype(np.int64))
    H, hd = cfg.n_head, cfg.n_embd // cfg.n_head
    i = len(steps) - 1
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=T, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
                                       n_head=H, attn_implementation="eager")).eval()
    model.load_state_dict(store.read_shard(steps[i], 0)["state"]["replicated"]["model"])
    captured = {}
    for layer, block in enumerate(model.transformer.h):
        block.attn.c_attn.register_forward_hook(lambda m, a, out, layer=layer: captured.__setitem__(layer, out))
    with torch.no_grad():
        model(input_ids=x)
    causal = np.tril(np.ones((T, T), dtype=bool))
    for layer in range(cfg.n_layer):
        qkv = captured[layer].numpy()
        for h in range(H):
            q = qkv[:, :, h * hd:(h + 1) * hd]
            k = qkv[:, :, cfg.n_embd + h * hd: cfg.n_embd + (h + 1) * hd]
            s = np.einsum("btd,bsd->bts", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(hd)
            np.testing.assert_allclose(table["max_logit"][i, layer, h], s[:, causal].max(), rtol=1e-5)
            s16 = _bf16(np.einsum("btd,bsd->bts", _bf16(q).astype(np.float64), _bf16(k).astype(np.float64)))
            s16 = np.where(causal, s16, -np.inf)
            ties = (s16 == s16.max(axis=-1, keepdims=True)).sum(axis=-1) >= 2
            assert table["tie_rate"][i, layer, h] == pytest.approx(ties[:, 1:].mean(), abs=1.5 / ties[:, 1:].size)


def test_attention_entropy_and_log_z_match_transformers_forward(context):
    """Entropy from transformers' own attention probabilities (eager, output_attentions), log Z from its
    LM head's logits (the last layer) and from each block's output through ln_f and the tied embedding."""
    from transformers import GPT2Config, GPT2LMHeadModel

    store, cfg, table, steps, weights = context
    tokens = store.read_tokens()
    T = cfg.block_size
    x = torch.tensor(np.stack([tokens[i * T:i * T + T] for i in table["attrs"]["probe"]["sample_ids"]])
                     .astype(np.int64))
    i = len(steps) - 1
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=T, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
                                       n_head=cfg.n_head, attn_implementation="eager")).eval()
    model.load_state_dict(store.read_shard(steps[i], 0)["state"]["replicated"]["model"])
    outputs = {}
    for layer, block in enumerate(model.transformer.h):
        block.register_forward_hook(
            lambda m, a, out, layer=layer: outputs.__setitem__(layer, out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        out = model(input_ids=x, output_attentions=True)
    for layer in range(cfg.n_layer):
        p = out.attentions[layer].double().numpy()                 # [batch, head, query, key]
        with np.errstate(divide="ignore", invalid="ignore"):
            h = -np.where(p > 0, p * np.log(p), 0.0).sum(axis=-1)
        np.testing.assert_allclose(table["attn_entropy"][i, layer], h[:, :, 1:].mean(axis=(0, 2)), rtol=1e-5)
        with torch.no_grad():
            lens = model.transformer.ln_f(outputs[layer]) @ model.transformer.wte.weight.T
        np.testing.assert_allclose(table["log_z"][i, layer], torch.logsumexp(lens.double(), -1).mean().item(),
                                   rtol=1e-5)
    z_model = torch.logsumexp(out.logits.double(), dim=-1).mean().item()
    np.testing.assert_allclose(table["log_z"][i, cfg.n_layer - 1], z_model, rtol=1e-5)
    assert np.all(table["attn_entropy"][i] > 0) and np.all(table["attn_entropy"][i] < np.log(T))


def test_replay_distances_against_the_run(analysed_store):
    """The diverging replay's checkpoint 20 against the run's: every distance, recomputed."""
    from tests.analysis.conftest import DIVERGING_REPLAY

    name = DIVERGING_REPLAY[-1]
    replay = RunStore.open(analysed_store / "replays" / name)
    run = RunStore.open(analysed_store)
    dist = read_distances(replay.location)["parent"]
    assert dist["step"].tolist() == [20]
    a, b = _weights(run, 20), _weights(replay, 20)
    keys = [t.removeprefix("/state/replicated/model/") for t in dist["tensor"]]
    assert "lm_head.weight" not in keys or "transformer.wte.weight" not in keys   # tied: stored once
    for j, key in enumerate(keys):
        diff = b[key] - a[key]
        assert dist["max_abs"][0, j] == pytest.approx(np.abs(diff).max(), rel=1e-12)
        assert dist["frobenius"][0, j] == pytest.approx(np.linalg.norm(diff), rel=1e-9)
        assert dist["relative"][0, j] == pytest.approx(np.linalg.norm(diff) / np.linalg.norm(a[key]), rel=1e-9)
        w1 = np.abs(np.sort(a[key].ravel()) - np.sort(b[key].ravel())).mean()   # equal sizes: sorted pairs
        assert dist["wasserstein"][0, j] == pytest.approx(w1, rel=1e-6, abs=1e-15)
    assert dist["max_abs"].max() > 0      # the replay did leave the record
