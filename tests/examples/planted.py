"""A planted batch: random bytes above 127 (never in Python source) written over what one step drew from a token
file (`overwrite_with_noise`), and the nanoGPT example's run with one, as its test, the soak and
benchmarks/bench_bisect.py make it: recorded twice (100 steps, checkpoints every 4), the second time over a token
file planted at every window step 95 drew, which the recording's own detector flags."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from replay.store import RunStore
from replay.store.location import Location

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "nanogpt"
STEP = 95


def plant_nanogpt_run(store: Location | Path, data: Path) -> None:
    """The token file into `data` (examples/nanogpt/prepare.py), a clean recording beside `store` (the same RNG
    draws the same windows), step 95's windows overwritten in the token file, then the recording into `store`."""
    subprocess.run([sys.executable, str(EXAMPLE / "prepare.py"), "--out", str(data), "--bytes", "200000"],
                   check=True, capture_output=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}

    def train(into: Location | Path) -> None:
        subprocess.run([sys.executable, str(EXAMPLE / "train.py"), f"--data_dir={data}", f"--store={into}",
                        "--max_iters=100", "--checkpoint_every=4"], cwd=data.parent, env=env, check=True,
                       capture_output=True)

    clean = store.parent / f"{store.name}-clean"
    train(clean)
    overwrite_with_noise(data, RunStore.open(clean).read_steps(["sample_ids"])["sample_ids"][STEP].ravel(), 33)
    train(store)


def overwrite_with_noise(data: Path, starts: Iterable[int], length: int, into: Path | None = None) -> Path:
    """Random bytes above 127 over `length` tokens from each of `starts` in the token file `data`/train.bin, in
    place or in a copy of the directory `data` made at `into`; returns the directory written."""
    if into is not None:
        shutil.copytree(data, into)
        data = into
    tokens = np.memmap(data / "train.bin", dtype=np.uint16, mode="r+")
    noise = np.random.default_rng(0)
    for start in starts:
        tokens[start:start + length] = noise.integers(128, 256, length)
    tokens.flush()
    return data
