"""The numbers the analysis computes, as plain functions of tensors (no store, no Ray).

A layer's matrices come as (in, out) (store/layout.py reads them so from any layout): W_Q is [d, H*hd],
head h being columns h*hd:(h+1)*hd; W_O is [H*hd, d], head h being rows h*hd:(h+1)*hd; W_K, W_V are
[d, H_kv*hd], H_kv = H without grouped-query attention; the MLP's "fc" [d, 4d] and "proj" [4d, d], where
the layout names them (NaN where it does not). Per-head numbers are per query head h; those of W_K, W_V
(and W_Q,h W_K^T) are of the key/value head it reads, g = h // (H / H_kv), so the heads of one group
show the same W_K and W_V numbers.

Definitions (stated once, used everywhere):
- spectral norm: the largest singular value. Whole matrices: Lanczos (ARPACK) on the smaller Gram
  matrix in FP32, relative error about 1e-7 against a full SVD. Per-head slices: exact (batched SVD of
  the R factor). `W_Q,h W_K,g^T`: the norm of `R_q R_k^T` from the R factors of the two [d, hd]
  slices, exact because Q = U_q R_q and K = U_k R_k with orthonormal U; on the weights, so before any
  rotary position embedding (RoPE rotates q and k by position; the probe measures logits after it).
- update between consecutive checkpoints: D_t = W_t - W_prev. Relative update norm ||D_t||_F / ||W_prev||_F
  (the analysis divides it by the steps between the two checkpoints: a per-step rate);
  cosine of successive updates <D_t, D_prev> / (||D_t|| ||D_prev||) (the "similar updates" signature);
  stable rank ||D_t||_F^2 / ||D_t||_2^2.
- probe: on fixed samples of the run's own data, the FP32 attention logits S = q k^T / sqrt(hd) of each
  head (causal); max logit = max of S; a row has tied maxima at BF16 when, with q and k rounded to BF16
  and S rounded to BF16 (what a BF16 matmul writes), two or more entries equal the row max (rows with
  one visible key cannot tie and are left out); attention entropy = the mean over rows of
  -sum_j P_ij ln P_ij with P = softmax(S) (nats; the same rows: collapse is its fall towards 0).
- log Z of a layer: the mean over the probe's positions of logsumexp(ln_f(h) W_E^T), h the layer's
  output and W_E the (tied) token embedding: the output logits' log partition function (PaLM's z-loss
  quantity) read through the final layer norm and the unembedding; the last layer's is the model's own.
- update-to-weight RMS ratio of a matrix: RMS(D_t) / RMS(W_prev), which is the relative update norm
  above (both have the same number of entries).
- weight distance of two tensors a (reference) and b: max |a - b|, Frobenius ||a - b||_F, relative
  ||a - b||_F / ||a||_F, and Wasserstein-1 between the two value distributions (of two samples of the same
  size: the mean |difference| of their sorted values, what `scipy.stats.wasserstein_distance` computes).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse.linalg as sla
import torch

from replay.analysis.names import HEAD_MATRICES, MATRICES
from replay.errors import UsageError
from replay.kernels.numerics import cosine


def spectral_norm(m: np.ndarray) -> float:
    """Largest singular value of a 2-D matrix: Lanczos on the smaller Gram matrix (FP32)."""
    m = np.asarray(m, dtype=np.float32)
    if min(m.shape) <= 64:
        return float(np.linalg.svd(m.astype(np.float64), compute_uv=False)[0])
    gram = m @ m.T if m.shape[0] <= m.shape[1] else m.T @ m
    v0 = np.ones(gram.shape[0], dtype=np.float32)    # fixed start: the same checkpoint gives the same number
    top = sla.eigsh(gram, k=1, which="LA", v0=v0, tol=1e-7, return_eigenvectors=False)[0]
    return float(np.sqrt(max(top, 0.0)))


def head_slices(mats: dict[str, np.ndarray], n_head: int) -> dict[str, np.ndarray]:
    """[n_head, d, hd] slices per query head of W_Q (columns), of W_O (rows, transposed to [d, hd]) and of
    W_K, W_V (the columns of the key/value head each query head reads)."""
    d, width = mats["q"].shape
    hd = width // n_head
    n_kv = mats["k"].shape[1] // hd
    if width != n_head * hd or n_kv * hd != mats["k"].shape[1] or n_head % n_kv:
        raise UsageError(f"W_Q ({mats['q'].shape[1]} wide) and W_K ({mats['k'].shape[1]} wide) do not split into "
                         f"{n_head} query heads sharing key/value heads evenly: check the run's heads per layer "
                         "(Loop(n_head=...)) and its layout")
    out = {"q": mats["q"].reshape(d, n_head, hd).transpose(1, 0, 2)}
    for name in ("k", "v"):
        out[name] = np.repeat(mats[name].reshape(d, n_kv, hd).transpose(1, 0, 2), n_head // n_kv, axis=0)
    out["o"] = mats["o"].reshape(n_head, hd, -1).transpose(0, 2, 1)
    return out


def _r_factors(slices: np.ndarray) -> np.ndarray:
    """R factors (up to signs) of the batched QR of [n, d, hd] slices, in FP64: the Cholesky factor of
    the small Gram matrix S^T S = R^T R (several times faster than a QR of the tall slices); a
    rank-deficient slice, whose Gram matrix is singular, goes through QR."""
    s = torch.from_numpy(np.ascontiguousarray(slices, dtype=np.float64))
    chol, info = torch.linalg.cholesky_ex(s.transpose(1, 2) @ s)
    if bool((info != 0).any()):
        return torch.linalg.qr(s, mode="r")[1].numpy()
    return chol.transpose(1, 2).numpy()


def weight_metrics(mats: dict[str, np.ndarray], n_head: int) -> dict[str, np.ndarray]:
    """Spectral norms of one layer: "spectral" [matrix], "spectral_head" [head_matrix, head],
    "spectral_qk" [head]."""
    heads = head_slices(mats, n_head)
    r = {name: _r_factors(s) for name, s in heads.items()}
    per_head = np.stack([np.linalg.svd(r[name], compute_uv=False)[:, 0] for name in HEAD_MATRICES])
    qk = np.linalg.svd(r["q"] @ r["k"].transpose(0, 2, 1), compute_uv=False)[:, 0]
    return {"spectral": np.array([spectral_norm(mats[name]) if name in mats else np.nan for name in MATRICES]),
            "spectral_head": per_head, "spectral_qk": qk}


def update_metrics(cur: dict[str, np.ndarray], prev: dict[str, np.ndarray] | None,
                   before: dict[str, np.ndarray] | None, n_head: int) -> dict[str, np.ndarray]:
    """Update statistics of one layer from its matrices at three consecutive checkpoints (NaN where a
    checkpoint is missing): "update_rel", "update_cos", "update_srank" [matrix] and the same with
    "_head" [head_matrix, head]."""
    n_m, n_h = len(MATRICES), len(HEAD_MATRICES)
    out = {f"update_{k}": np.full(n_m, np.nan) for k in ("rel", "cos", "srank")}
    out.update({f"update_{k}_head": np.full((n_h, n_head), np.nan) for k in ("rel", "cos", "srank")})
    if prev is None:
        return out
    for i, name in enumerate(MATRICES):
        if name not in cur:   # a layout that names no MLP
            continue
        d_t = cur[name].astype(np.float64) - prev[name]
        fro = frobenius(d_t)
        out["update_rel"][i] = fro / max(frobenius(prev[name]), 1e-30)
        out["update_srank"][i] = fro ** 2 / max(spectral_norm(d_t), 1e-30) ** 2 if fro > 0 else np.nan
        if before is not None:
            d_prev = prev[name].astype(np.float64) - before[name]
            out["update_cos"][i] = _cos(d_t.ravel(), d_prev.ravel())
    cur_h, prev_h = head_slices(cur, n_head), head_slices(prev, n_head)
    before_h = head_slices(before, n_head) if before is not None else None
    for i, name in enumerate(HEAD_MATRICES):
        d_t = cur_h[name].astype(np.float64) - prev_h[name]          # [head, d, hd]
        fro = np.linalg.norm(d_t, axis=(1, 2))
        top = np.linalg.svd(_r_factors(d_t), compute_uv=False)[:, 0]
        out["update_rel_head"][i] = fro / np.maximum(np.linalg.norm(prev_h[name], axis=(1, 2)), 1e-30)
        out["update_srank_head"][i] = np.where(top > 0, fro ** 2 / np.maximum(top, 1e-30) ** 2, np.nan)
        if before_h is not None:
            d_prev = prev_h[name].astype(np.float64) - before_h[name]
            out["update_cos_head"][i] = [_cos(a.ravel(), b.ravel()) for a, b in zip(d_t, d_prev, strict=True)]
    return out


def attention_probe(q: torch.Tensor, k: torch.Tensor) -> dict[str, np.ndarray]:
    """Per head, from one layer's q and k [batch, head, seq, hd] (FP32) under a causal mask: the max
    attention logit ("max_logit"), the rate of rows with tied maxima at BF16 ("tie_rate") and the mean
    attention entropy ("attn_entropy")."""
    hd, T = q.shape[-1], q.shape[-2]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    scale = hd ** -0.5
    s = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~causal, -torch.inf)
    p = torch.softmax(s, dim=-1)
    entropy = -(p * torch.log(p.clamp_min(torch.finfo(p.dtype).tiny))).sum(dim=-1)   # [batch, head, seq]
    s16 = (q.bfloat16().float() @ k.bfloat16().float().transpose(-1, -2)).bfloat16().float()
    s16 = s16.masked_fill(~causal, -torch.inf)
    ties = (s16 == s16.amax(dim=-1, keepdim=True)).sum(dim=-1) >= 2      # [batch, head, seq]
    return {"max_logit": s.amax(dim=(0, 2, 3)).numpy(),
            "tie_rate": ties[..., 1:].float().mean(dim=(0, 2)).numpy(),    # row 0 sees one key only
            "attn_entropy": entropy[..., 1:].mean(dim=(0, 2)).numpy()}


def log_z(h: torch.Tensor, ln_f: torch.nn.Module, wte: torch.Tensor) -> float:
    """Mean over positions of logsumexp(ln_f(h) @ wte^T), h [batch, seq, d] (FP32)."""
    return float(torch.logsumexp(ln_f(h) @ wte.T, dim=-1).mean())


def frobenius(x: np.ndarray) -> float:
    """The Frobenius norm in FP64, summed by numpy itself: the same bits wherever it runs (np.linalg.norm of
    a whole array is a BLAS dot, whose sum the BLAS splits among as many threads as the process allows)."""
    x64 = np.asarray(x, dtype=np.float64)
    return float(np.sqrt(np.sum(x64 * x64)))


def tensor_distances(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """Distances of b from the reference a (same shape). Every sum is numpy's own (see `frobenius`); scipy's
    Wasserstein distance ends in a BLAS dot."""
    a64, b64 = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    diff = b64 - a64
    fro = frobenius(diff)
    return {"max_abs": float(np.abs(diff).max()) if diff.size else 0.0, "frobenius": fro,
            "relative": fro / max(frobenius(a64), 1e-30),
            "wasserstein": float(np.mean(np.abs(np.sort(b64) - np.sort(a64)))) if diff.size else 0.0}


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    """The cosine of the angle between two arrays (as the numerics probe takes it)."""
    return cosine(torch.from_numpy(np.ascontiguousarray(a)), torch.from_numpy(np.ascontiguousarray(b)))
