"""Runs whose spike has a known cause, planted before recording."""

from __future__ import annotations

from pathlib import Path

import numpy as np

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
               "--set", "optim.lr=1e-2", "--set", "optim.min_lr=1e-2", "--set", "spike.window=10", "--set", "snapshot_every=0"]
