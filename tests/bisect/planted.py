"""Runs whose spike has a known cause, planted before recording. Imported by the product through
REPLAY_PLUGINS (conftest.DEFECT), it also registers the deliberately broken attention backend `defect`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from replay.kernels.baseline import causal_mask
from replay.kernels.plan import register_backend
from replay.train.data import DataOrder

VOCAB, BLOCK, STEPS, BATCH, SEED = 16, 32, 48, 8, 1337
PERIOD = np.random.default_rng(0).permutation(VOCAB)   # the text every normal sample repeats


def periodic_tokens(n_samples: int) -> np.ndarray:
    """A token file in which every sample is the same periodic text: quickly learnt, loss near 0."""
    return np.resize(PERIOD, n_samples * BLOCK + 1).astype(np.uint16)


def plant_degenerate_samples(path: Path, step: int, positions: list[int]) -> list[int]:
    """Write a token file whose samples at `positions` of step `step`'s batch are random tokens
    (unlearnable: their loss stays near ln 16); returns their sample ids."""
    n_samples = STEPS * BATCH   # every sample is seen once, so the planted ones only at `step`
    tokens = periodic_tokens(n_samples)
    ids = DataOrder(n_samples, BATCH, SEED).step_ids(step)[positions]
    rng = np.random.default_rng(1)
    for i in ids:   # keep each sample's first and last token: neighbours share them
        tokens[i * BLOCK + 1: i * BLOCK + BLOCK] = rng.integers(0, VOCAB, BLOCK - 1)
    tokens.tofile(path)
    return sorted(int(i) for i in ids)


RECORD_ARGS = ["--steps", str(STEPS), "--nproc", "2", "--checkpoint-every", "10", "--seed", str(SEED),
               "--set", f"model.block_size={BLOCK}", "--set", f"batch_size={BATCH}", "--set", "micro_batch_size=4",
               "--set", "optim.lr=1e-2", "--set", "optim.min_lr=1e-2", "--set", "spike.window=10",
               "--set", "snapshot_every=0"]


DEFECT_THRESHOLD = 1.5


def defect(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """A test double for a kernel bug (which we cannot cause for real): exact FP32 attention, except that
    rows whose largest logit exceeds DEFECT_THRESHOLD come out as inf (as from a kernel overflowing there).
    It fires only once training has grown the logits, so the run it is planted in breaks mid-way."""
    n, m = q.shape[-2], k.shape[-2]
    logits = (q.float() @ k.float().transpose(-2, -1)) * scaling
    logits = logits.masked_fill(~causal_mask(n, m, q.device), float("-inf"))
    out = torch.softmax(logits, dim=-1) @ v.float()
    broken = logits.amax(dim=-1, keepdim=True) > DEFECT_THRESHOLD
    return out.masked_fill(broken, float("inf")).to(q.dtype)


register_backend("defect", defect)
