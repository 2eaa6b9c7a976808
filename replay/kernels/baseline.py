"""Baseline attention: materialise S, softmax, multiply, at one chosen precision.

Where it rounds, for a low-precision `dtype` (BF16, FP16): the inputs are cast to `dtype`; `S = Q K^T`
accumulates in FP32 and is rounded to `dtype` (PyTorch's matmul); `S * scale` is rounded again; the
softmax runs in FP32 inside PyTorch's kernel and its output P is rounded to `dtype`; `O = P V`
accumulates in FP32 and is rounded once. With attention dropout (kernels/dropout.py) the dropped P are
zeroed and the kept ones multiplied by 1 / (1 - p), rounded once more, before P V. The backward is
PyTorch autograd through the same ops, so every gradient tensor is rounded to `dtype` as it is produced.
In FP64 every step is FP64: the golden value of Golden et al.'s microbenchmark.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from replay.kernels.dropout import keep_mask


def causal_mask(n_q: int, n_k: int, device=None) -> torch.Tensor:
    """True where a query may attend: key position <= query position (queries are the last n_q keys)."""
    rows = torch.arange(n_q, device=device)[:, None] + (n_k - n_q)
    return torch.arange(n_k, device=device)[None, :] <= rows


def baseline_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype,
                       causal: bool = True, scale: float | None = None,
                       mask: torch.Tensor | None = None, dropout: float = 0.0,
                       kept: torch.Tensor | None = None,
                       watch: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> torch.Tensor:
    """q, k, v: [..., N, d]; `mask` (bool, True = attend) broadcasts to [..., N, M]. Returns [..., N, d].
    `dropout`: attention dropout's probability; the mask is drawn (`keep_mask`) unless `kept` gives it.
    `watch`: given S and P as computed (kernels/internals.py)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    s = (q @ k.transpose(-1, -2)) * scale
    keep = attended(q.shape[-2], k.shape[-2], causal, mask, q.device)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, dim=-1)
    if keep is not None:   # rows with nothing to attend to give 0, not NaN
        p = torch.nan_to_num(p, nan=0.0)
    if watch is not None:
        watch(s.detach(), p.detach())
    if dropout:
        kept = keep_mask(p.shape, dropout, p.device) if kept is None else kept
        p = torch.where(kept, p * (1.0 / (1.0 - dropout)), 0.0)
    return p @ v


def attended(n_q: int, n_k: int, causal: bool, mask: torch.Tensor | None, device) -> torch.Tensor | None:
    """Where queries attend (bool [..., n_q, n_k]): the causal mask and `mask` combined; None: everywhere."""
    keep = causal_mask(n_q, n_k, device) if causal else None
    if mask is not None:
        keep = mask if keep is None else keep & mask
    return keep
