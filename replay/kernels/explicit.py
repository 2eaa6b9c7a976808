"""Attention written by hand (minGPT, nanoGPT's slow path), made reachable by `--attention` with one call.

A model that computes attention itself never calls SDPA, so no attention plan reaches it. Its five lines

    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
    att = F.softmax(att, dim=-1)
    att = self.attn_dropout(att)
    y = att @ v

become one:

    y = causal_attention(q, k, v, dropout=self.attn_dropout)

Where no attention plan routes it, the call runs exactly those operations in that order (the same kernels,
the same dropout draw), so the run is bit for bit the run before the change. Inside an attention module under
`sdpa_dispatch` (a `Loop` recording or replaying with `--attention`), it is handed to the layer's backends as
an SDPA call would be, and counted where it ran.
"""

from __future__ import annotations

import math

import torch
from torch.overrides import handle_torch_function, has_torch_function

from replay.kernels.baseline import causal_mask


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: torch.nn.Dropout | None = None,
                     scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale, causal) v. q: [B, H, N, d]; k, v: [B, H, M, d] (queries are the last N keys);
    `dropout`: the module's attention dropout, applied to the probabilities as the module would; `scale`:
    default 1 / sqrt(d)."""
    if has_torch_function((q, k, v)):   # a TorchFunctionMode is active: sdpa_dispatch's routes this call
        return handle_torch_function(causal_attention, (q, k, v), q, k, v, dropout=dropout, scale=scale)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)) if scale is None else scale)
    att = att.masked_fill(~causal_mask(q.size(-2), k.size(-2), q.device), float("-inf"))
    att = torch.nn.functional.softmax(att, dim=-1)
    if dropout is not None:
        att = dropout(att)
    return att @ v


def dropout_probability(dropout: torch.nn.Dropout | None) -> float:
    """The probability a backend applies for the module's attention dropout: none outside training."""
    return float(dropout.p) if dropout is not None and dropout.training else 0.0
