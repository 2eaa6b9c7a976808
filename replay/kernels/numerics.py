"""Per-step attention numerics of the emulated flash backends: Qiu & Yao's failure signature, measured
inside a training run (`replay record --numerics`; replays of such a run measure it too).

For every layer and optimizer step (over this rank's micro-batches and all heads):
  tied_rate       the fraction of attended query rows whose largest score occurs more than once, in the
                  precision the placement holds S in (BF16 for `reference`, FP32 for `fa2`): the rows
                  where exp(S - max) is exactly 1 more than once
  delta_err       the mean over rows of delta_used - delta_hp, where delta = rowsum(dO * O) is the
                  backward's D: the one the kernel used against one from an FP32 O (FP32 attention on
                  the same low-precision Q, K, V); signed, so a bias shows as a drift of its running sum
  delta_err_tied  the same mean over the rows with tied maxima only (NaN in a step without any)
  wq_err_norm     the Frobenius norm of the W_Q gradient error that delta's error causes: with
                  dS = P * (dP - delta), an error e in delta moves dQ by -scale * diag(e) P K and the
                  W_Q gradient by X^T of that (X: the input of the layer's c_attn)
  wq_err_cos      the cosine similarity of this step's W_Q gradient error with the previous step's:
                  near 1 when the errors keep pointing the same way (the low-rank accumulation)
  wq_tied_err_cos the same for the part of the error that comes from rows with tied maxima, where the
                  rounding is biased (elsewhere delta's rounding error is closer to noise)
The probe only reads what the kernels compute and never changes it: a run records the same bits with
and without it. It costs one FP32 attention per layer in the forward and the backward.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from transformers import GPT2LMHeadModel

# What the probe measures per step and layer (the run store keeps them as optional steps/ arrays).
FIELDS = ("tied_rate", "delta_err", "delta_err_tied", "wq_err_norm", "wq_err_cos", "wq_tied_err_cos")

_active: NumericsProbe | None = None


def active() -> NumericsProbe | None:
    return _active


class NumericsProbe:
    """Collects the per-layer numbers of one optimizer step; `end_step` returns them and starts the next."""

    def __init__(self, model: GPT2LMHeadModel):
        blocks = model.transformer.h
        self.n_layer, self.n_embd = len(blocks), model.config.n_embd
        self._inputs: dict[int, torch.Tensor] = {}
        for i, block in enumerate(blocks):   # for as long as the model lives
            block.get_submodule("attn.c_attn").register_forward_pre_hook(self._keep_input(i))
        self.last_wq_err: list[torch.Tensor | None] = [None] * self.n_layer   # the last step's, per layer
        self.last_wq_tied_err: list[torch.Tensor | None] = [None] * self.n_layer
        self._reset()

    def _keep_input(self, layer: int):
        def hook(module, args):
            self._inputs[layer] = args[0].detach()
        return hook

    def _reset(self) -> None:
        L, E = self.n_layer, self.n_embd
        self.rows, self.tied = np.zeros(L), np.zeros(L)
        self.err_sum, self.err_tied_sum, self.err_rows = np.zeros(L), np.zeros(L), np.zeros(L)
        self.wq_err = [torch.zeros(E, E, dtype=torch.float64) for _ in range(L)]
        self.wq_tied_err = [torch.zeros(E, E, dtype=torch.float64) for _ in range(L)]

    @contextlib.contextmanager
    def collecting(self):
        global _active
        assert _active is None, "one numerics probe at a time"
        _active = self
        try:
            yield self
        finally:
            _active = None

    # -- called by the flash emulation -------------------------------------------------------------

    def tied_rows(self, layer: int, s: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """Count the rows of S (as the placement holds it, [G, N, M]) whose max occurs more than once."""
        if keep is not None:
            s = s.masked_fill(~keep, float("-inf"))
        row_max = s.amax(-1, keepdim=True)
        attended = torch.isfinite(row_max[..., 0])
        tied = ((s == row_max) & torch.isfinite(s)).sum(-1) > 1
        self.rows[layer] += int(attended.sum())
        self.tied[layer] += int(tied.sum())
        return tied

    def delta_error(self, layer: int, heads: list[int], lead: torch.Size, q, k, keep, scale: float,
                    delta_used: torch.Tensor, delta_hp: torch.Tensor, tied: torch.Tensor) -> None:
        """q, k: [G, N, d] low precision with G = B x len(heads); delta_*: [G, N]."""
        err = delta_used.double() - delta_hp.double()
        self.err_sum[layer] += float(err.sum())
        self.err_rows[layer] += err.numel()
        self.err_tied_sum[layer] += float(err[tied].sum())
        s = (q.float() @ k.float().transpose(-1, -2)) * scale
        if keep is not None:
            s = s.masked_fill(~keep, float("-inf"))
        p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
        B, N, d = lead[0], q.shape[1], q.shape[2]
        x = self._inputs[layer].float().reshape(B * N, -1)                     # [B*N, E]
        for total, e in ((self.wq_err[layer], err), (self.wq_tied_err[layer], err * tied)):
            dq_err = (-scale * (e.float()[..., None] * p) @ k.float()).reshape(B, len(heads), N, d)
            for i, h in enumerate(heads):
                total[:, h * d:(h + 1) * d] += (x.T @ dq_err[:, i].reshape(B * N, d)).double()

    # -- called by the trainer ---------------------------------------------------------------------

    def skipped(self) -> dict[str, np.ndarray]:
        """A step that trained on nothing (a replay's --skip): NaN throughout."""
        return {name: np.full(self.n_layer, np.nan) for name in FIELDS}

    def end_step(self) -> dict[str, np.ndarray]:
        out = {name: np.full(self.n_layer, np.nan) for name in FIELDS}
        for layer in range(self.n_layer):
            if self.rows[layer]:
                out["tied_rate"][layer] = self.tied[layer] / self.rows[layer]
            if self.err_rows[layer]:
                out["delta_err"][layer] = self.err_sum[layer] / self.err_rows[layer]
            if self.tied[layer]:
                out["delta_err_tied"][layer] = self.err_tied_sum[layer] / self.tied[layer]
            out["wq_err_norm"][layer] = float(self.wq_err[layer].norm())
            out["wq_err_cos"][layer] = cosine(self.wq_err[layer], self.last_wq_err[layer])
            out["wq_tied_err_cos"][layer] = cosine(self.wq_tied_err[layer], self.last_wq_tied_err[layer])
            self.last_wq_err[layer], self.last_wq_tied_err[layer] = self.wq_err[layer], self.wq_tied_err[layer]
        self._reset()
        return out


def cosine(a: torch.Tensor, b: torch.Tensor | None) -> float:
    """The cosine of two tensors' angle, flattened; NaN if either is missing or zero."""
    if b is None or not a.norm() > 0 or not b.norm() > 0:
        return float("nan")
    return float((a * b).sum() / (a.norm() * b.norm()))
