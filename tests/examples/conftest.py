"""The examples' token file, written once by examples/nanogpt/prepare.py (the standard library's bytes), and
the comparison of an example's run recorded with the same run without replay (`--record=False`), and a
recording's kill."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from replay.errors import StoreError
from replay.processes import descendants, start_time
from replay.store import RunStore
from tests.conftest import REPO, assert_gone, tensors_equal

# the line a recording prints when it turned PyTorch's deterministic algorithms on (recorder/environment.py)
DETERMINISM = "replay: this recording runs with torch.use_deterministic_algorithms(True)"


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
    losses, norms, rates, state digests (and a stream's sample digests), and the model at `checkpoint`."""
    ours, theirs = RunStore.open(resumed), RunStore.open(recorded)
    assert ours.manifest.status == "complete" and [r.from_step for r in ours.manifest.resumes] == [resumed_from]
    fields = ["sample_ids", "sample_digest", "loss", "grad_norm", "lr", "state_digest"]
    mine, record = ours.read_steps(fields), theirs.read_steps(fields)
    assert all(np.array_equal(mine[f], record[f], equal_nan=mine[f].dtype.kind == "f") for f in fields)   # no norm: NaN
    after, expected = (s.read_shard(checkpoint, 0)["state"]["replicated"]["model"] for s in (ours, theirs))
    assert all(torch.equal(after[k], expected[k]) for k in expected)


def assert_same_run(recorded: Path, plain: Path, steps: int) -> None:
    """An example's `--out` files of a recorded run and of the same run without replay: every step's loss
    and the final weights, bit for bit."""
    a, b = (torch.load(path, weights_only=True) for path in (recorded, plain))
    assert len(a["losses"]) == len(b["losses"]) == steps
    differ = [(step, x, y) for step, (x, y) in enumerate(zip(a["losses"], b["losses"], strict=True)) if x != y]
    assert differ == [], f"first differing step, recorded and not: {differ[0]}"
    assert a["model"].keys() == b["model"].keys()
    assert [k for k in a["model"] if not tensors_equal(a["model"][k], b["model"][k])] == []


def committed_steps(store: Path) -> list[int]:
    try:
        return [c.step for c in RunStore.open(store).checkpoints()]
    except StoreError:   # not created yet
        return []


def kill_after_checkpoint(proc: subprocess.Popen, store: Path, step: int) -> int:
    """Once `store` has committed a checkpoint at `step` or later, SIGKILL the recording (`kill_all`); returns
    its last committed checkpoint, of a store left incomplete."""
    deadline = time.monotonic() + 120
    while not any(s >= step for s in committed_steps(store)):
        assert proc.poll() is None and time.monotonic() < deadline, "the recording ended before it was killed"
        time.sleep(0.02)
    kill_all(proc)
    cut = RunStore.open(store)
    assert cut.manifest.status != "complete", "killed before it completed"
    return cut.checkpoints()[-1].step


def kill_all(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun, its ranks and their DataLoader workers at once, as a machine going down does
    (torchrun starts each rank in a session of its own: killing torchrun's group alone leaves them
    running)."""
    start = start_time(proc.pid)
    assert start is not None, "torchrun is running"
    procs = {proc.pid: start, **descendants(proc.pid)}
    for pgid in {os.getpgid(pid) for pid in procs}:
        os.killpg(pgid, signal.SIGKILL)
    proc.wait()
    assert_gone(procs)


TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")


def run_example(example: Path, workdir: Path, *args: str, popen: bool = False,
                launcher: tuple[str, ...] = TORCHRUN) -> Any:
    """An example under torchrun (or `launcher`), as its user starts it: from their own directory, not through
    replay. A CompletedProcess, or with `popen` the running Popen (in a session of its own, output dropped)."""
    cmd = [*launcher, str(example), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    if popen:
        return subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    return subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
