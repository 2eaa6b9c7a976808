"""Benchmark `loop.loader(...)`: a DataLoader's batch rate through the recording tap against the same DataLoader
untapped, and the time a replay or a resumed run takes to find its place in an epoch.

The data: token blocks of 257 from a file of random uint16 tokens (a map-style dataset, as a language model's
loader reads them), batches of 16, a RandomSampler; 0 and 2 worker processes (persistent), no model, so
the loader's own cost is all there is (the worst case for the tap). Rounds alternate tapped and untapped;
the median of each is reported. The restore: a stream restored at position P of an epoch samples its first
P batches' indices again (nothing is fetched) before the first batch it hands out.

    .venv/bin/python benchmarks/bench_loader.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

from replay.recorder.loader import RecordedLoader

BLOCK, BATCH = 257, 16


class Blocks(Dataset):
    def __init__(self, path: Path):
        self.path = path
        self.n = (os.path.getsize(path) // 2) // BLOCK

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        return torch.from_numpy(tokens[i * BLOCK:(i + 1) * BLOCK].astype(np.int64))


def hardware() -> str:
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.processor())
    return f"hardware: {cpu}, {os.cpu_count()} cores"


def loader(data: Blocks, workers: int) -> DataLoader:
    return DataLoader(data, batch_size=BATCH, sampler=RandomSampler(data), num_workers=workers,
                      persistent_workers=workers > 0, prefetch_factor=2 if workers else None)


def rate(batches, n: int) -> float:
    """Batches a second, over `n` batches after the first (the workers' start is not in it); the workers are
    stopped after (a forked worker of the next loader must not inherit this one's)."""
    it = iter(batches)
    next(it)
    start = time.perf_counter()
    for _ in range(n):
        next(it)
    elapsed = time.perf_counter() - start
    if isinstance(batches, RecordedLoader):
        batches.close()
    del it, batches
    gc.collect()
    return n / elapsed


def restore_time(data: Blocks, position: int) -> float:
    stream = RecordedLoader(loader(data, 0), take=lambda batch: None, seed=0)
    state = stream.position([])
    state["position"] = position
    stream.restore(state, [])
    start = time.perf_counter()
    next(stream)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="50 batches, one round (seconds)")
    quick = ap.parse_args().quick
    n, rounds = (50, 1) if quick else (1500, 5)
    torch.set_num_threads(1)
    print(hardware())
    with tempfile.TemporaryDirectory(prefix="bench_loader_") as work:
        path = Path(work) / "tokens.bin"
        np.random.default_rng(0).integers(0, 50257, 400_000 if quick else 40_000_000,
                                          dtype=np.uint16).tofile(path)
        data = Blocks(path)
        for workers in (0, 2):
            plain, tapped = [], []
            for _ in range(rounds):
                plain.append(rate(loader(data, workers), n))
                tapped.append(rate(RecordedLoader(loader(data, workers), take=lambda batch: None, seed=0), n))
            p, t = statistics.median(plain), statistics.median(tapped)
            print(f"workers={workers}: untapped {p:.0f} batches/s, tapped {t:.0f} batches/s: {t / p:.3f}x "
                  f"({(1 / t - 1 / p) * 1e6:+.0f} us a batch)")
        for position in (1_000, 10_000) if not quick else (10,):
            if position * BATCH > len(data):
                continue
            print(f"restore at position {position} of an epoch of {len(data) // BATCH} batches: "
                  f"{restore_time(data, position) * 1000:.1f} ms to the first batch")


if __name__ == "__main__":
    main()
