"""The examples' token file, written once by examples/nanogpt/prepare.py (the standard library's bytes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from replay.store import RunStore
from tests.conftest import REPO


@pytest.fixture(scope="session")
def token_file(tmp_path_factory) -> Path:
    """100 000 byte tokens: train.bin (90%) and val.bin."""
    out = tmp_path_factory.mktemp("tokens")
    done = subprocess.run([sys.executable, str(REPO / "examples/nanogpt/prepare.py"), "--out", str(out),
                           "--bytes", "100000"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return out / "train.bin"


def assert_resumed_as_recorded(resumed: Path, recorded: Path, resumed_from: int, checkpoint: int) -> None:
    """A run resumed once, at `resumed_from`, equals the uninterrupted recording bit for bit: every step's ids,
    losses, norms, rates and state digests, and the model at `checkpoint`."""
    ours, theirs = RunStore.open(resumed), RunStore.open(recorded)
    assert ours.manifest.status == "complete" and [r.from_step for r in ours.manifest.resumes] == [resumed_from]
    fields = ["sample_ids", "loss", "grad_norm", "lr", "state_digest"]
    mine, record = ours.read_steps(fields), theirs.read_steps(fields)
    assert all(np.array_equal(mine[f], record[f]) for f in fields)
    after, expected = (s.read_shard(checkpoint, 0)["state"]["replicated"]["model"] for s in (ours, theirs))
    assert all(torch.equal(after[k], expected[k]) for k in expected)
