"""Training data: nanoGPT-style token files, the built-in byte corpus, and the global sample order.

A *sample* is a fixed window of block_size + 1 tokens: sample i covers tokens [i*T, i*T + T + 1), so a
sample id alone names the exact text a rank trained on. The order of samples is a property of the run,
not of the world size: step s trains on the global ids [s*B, (s+1)*B) of a seeded per-epoch
permutation, and ranks only split that batch between them.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from replay.config import RunConfig
from replay.errors import UsageError

if TYPE_CHECKING:
    import torch

_FULL_HASH_LIMIT = 256 << 20   # files up to this size are hashed whole; larger ones are sampled
_VOCAB_SCAN_LIMIT = 2 << 30    # token range checked over the whole file up to this size


def builtin_corpus(n_bytes: int) -> np.ndarray:
    """Bytes of the Python standard library's own source files: text every machine has, no download.

    The bytes depend on the Python version, which is why a run embeds them in its store."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= n_bytes:
            break
    return np.frombuffer(b"".join(chunks)[:n_bytes], dtype=np.uint8).copy()


def fingerprint_file(path: Path) -> dict:
    size = path.stat().st_size
    h = hashlib.sha256()
    with path.open("rb") as f:
        if size <= _FULL_HASH_LIMIT:
            method = "sha256"
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        else:  # 64 blocks of 1 MiB at fixed offsets, plus the size: cheap, and catches any re-export
            method = "sha256-sampled-64x1MiB"
            for i in range(64):
                f.seek((size - (1 << 20)) * i // 63)
                h.update(f.read(1 << 20))
    return {"path": str(path.resolve()), "bytes": size, "method": method, "digest": h.hexdigest()}


def fingerprint_tokens(tokens: np.ndarray) -> dict:
    return {"path": None, "bytes": int(tokens.nbytes), "method": "sha256",
            "digest": hashlib.sha256(tokens.tobytes()).hexdigest()}


@dataclass
class TokenData:
    tokens: np.ndarray
    block_size: int
    n_samples: int
    vocab_size: int
    is_bytes: bool  # the built-in corpus: samples decode to text

    def batch(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, [len(ids), T] each, for the given sample ids."""
        # lazy: the launchers read the data without torch (1 s)
        import torch

        T = self.block_size
        rows = torch.from_numpy(np.stack([self.tokens[i * T: i * T + T + 1] for i in np.asarray(ids).reshape(-1)])
                                .astype(np.int64))
        return rows[:, :-1], rows[:, 1:]

    def describe(self, sample_id: int) -> str:
        T = self.block_size
        window = self.tokens[sample_id * T: sample_id * T + T + 1]
        if self.is_bytes:
            return bytes(window.astype(np.uint8)).decode("utf-8", errors="replace")
        return " ".join(str(int(t)) for t in window)


def open_token_file(cfg: RunConfig) -> np.ndarray:
    path = Path(cfg.data.path)
    if not path.exists():
        raise UsageError(f"data file {path} does not exist; pass a nanoGPT-style train.bin with --data")
    if not path.is_file():
        raise UsageError(f"data file {path} is not a file; pass a nanoGPT-style train.bin with --data")
    itemsize = np.dtype(cfg.data.dtype).itemsize
    size = path.stat().st_size
    if size == 0:
        raise UsageError(f"data file {path} is empty; pass a nanoGPT-style train.bin with --data")
    if size % itemsize:
        raise UsageError(f"data file {path} is not a whole number of {cfg.data.dtype} tokens; "
                         "check --set data.dtype=uint16|uint32")
    try:
        with path.open("rb") as f:
            f.read(1)
        return np.memmap(path, dtype=cfg.data.dtype, mode="r")
    except OSError as e:
        raise UsageError(f"data file {path} cannot be read ({e.strerror})") from None


def make_data(cfg: RunConfig, tokens: np.ndarray) -> TokenData:
    """Wrap tokens as samples for this config, with the checks a user needs to hear about."""
    T = cfg.model.block_size
    available = max(0, (len(tokens) - 1) // T)
    n = min(available, cfg.data.max_samples) if cfg.data.max_samples else available
    what = f"data file {cfg.data.path}" if cfg.data.path else "the built-in corpus"
    if n < cfg.batch_size:
        raise UsageError(
            f"{what} is too short: {len(tokens)} tokens make {n} samples of {T + 1} tokens, "
            f"but one step needs batch_size={cfg.batch_size}; bring more data or lower the batch size"
        )
    is_bytes = not cfg.data.path
    vocab = cfg.model.vocab_size or (256 if is_bytes else 0)
    if not is_bytes and (vocab == 0 or tokens.nbytes <= _VOCAB_SCAN_LIMIT):
        top = int(tokens[: n * T + 1].max())
        if vocab == 0:
            vocab = top + 1
        elif top >= vocab:
            raise UsageError(f"{what} holds token id {top}, outside model.vocab_size={vocab}; "
                             "raise --set model.vocab_size or check data.dtype")
    return TokenData(tokens=tokens, block_size=T, n_samples=n, vocab_size=vocab, is_bytes=is_bytes)


def load_data(cfg: RunConfig, store) -> TokenData:
    """The run's samples: its token file, or the corpus embedded in its store (a RunStore)."""
    return make_data(cfg, open_token_file(cfg) if cfg.data.path else store.read_tokens())


class DataOrder:
    """The global sample order: one seeded permutation per epoch, consumed batch_size at a time."""

    def __init__(self, n_samples: int, batch_size: int, seed: int):
        self.n, self.batch_size, self.seed = n_samples, batch_size, seed
        self._epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return self._perm

    def step_ids(self, step: int) -> np.ndarray:
        return self.steps_ids(step, step + 1)[0]

    def steps_ids(self, start: int, stop: int) -> np.ndarray:
        """The global ids of steps start..stop-1: [steps, batch_size]."""
        positions = np.arange(start * self.batch_size, stop * self.batch_size, dtype=np.int64)
        epochs = positions // self.n
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):
            at = epochs == epoch
            out[at] = self._permutation(int(epoch))[positions[at] % self.n]
        return out.reshape(stop - start, self.batch_size)

    def rank_ids(self, step: int, rank: int, world: int, micro_batch_size: int) -> np.ndarray:
        """This rank's [accum, micro_batch_size] ids: micro-batch m of all ranks is one contiguous slice."""
        ids = self.step_ids(step).reshape(-1, world, micro_batch_size)
        return ids[:, rank, :]


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
