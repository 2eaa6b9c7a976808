"""Benchmark replays: replay step rate against the recording's, and the time to the first replayed step.

A 2-rank recording of the built-in trainer (4 layers x 128, seq 128, batch 16, FP32, a checkpoint every 20
steps), then a replay of steps 20..79 of it, both through the command line as a user runs them.
Step rates come from the step logs (`step_time` on rank 0, so process start-up is not in them): the
median over the same steps 21..79 (target: replay >= 0.95x the recording). Time to the first replayed
step: a one-step replay (`--from 20 --to 20`) timed whole, split into the command's imports (a fresh
`python -c "import replay.cli"`), the restore (reading and checksumming a rank's shard, measured here on
the same store; ranks restore in parallel), the step itself (its `step_time`), and the rest (rank
processes starting, imports in the ranks, model build, the final checkpoint's write and commit).

    .venv/bin/python benchmarks/bench_replay.py [--quick]
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from replay.lifeline import child_env, follow_parent
from replay.store import RunStore

ARGS = ["--nproc", "2", "--checkpoint-every", "20", "--set", "model.n_layer=4", "--set",
        "model.n_head=4", "--set", "model.n_embd=128", "--set", "model.block_size=128", "--set", "batch_size=16",
        "--set", "micro_batch_size=8"]


def hardware() -> str:
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.processor())
    return f"hardware: {cpu}, {os.cpu_count()} cores"


def timed(*cmd: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *cmd], check=True, capture_output=True, text=True, env=child_env())
    return time.perf_counter() - start


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="30 steps of the `tiny` preset on one rank, no one-step "
                                                          "replay (seconds; the suite runs it to keep the benchmark "
                                                          "working)")
    quick = ap.parse_args().quick
    steps = 30 if quick else 80
    args = ["--preset", "tiny", "--nproc", "1", "--checkpoint-every", "20"] if quick else ARGS
    print(hardware())
    work = Path(tempfile.mkdtemp(prefix="bench_replay_"))
    try:
        store = work / "run"
        timed("-m", "replay", "record", "--store", str(store), *args, "--steps", str(steps))
        timed("-m", "replay", "run", str(store), "--from", "20", "--to", str(steps - 1), "--name", "window")
        run = RunStore.open(store)
        rec = run.read_steps(["step_time"])["step_time"][21:steps]
        rep = RunStore.open(store / "replays" / "window").read_steps(["step_time"])["step_time"][1:steps - 20]
        ratio = statistics.median(rec) / statistics.median(rep)
        print(f"step rate: recording {1 / statistics.median(rec):.1f} steps/s, replay {1 / statistics.median(rep):.1f} "
              f"steps/s over the same steps 21..{steps - 1}: {ratio:.2f}x (target >= 0.95x)")
        if quick:
            return

        total = timed("-m", "replay", "run", str(store), "--from", "20", "--to", "20", "--name", "one")
        imports = timed("-c", "import replay.cli, replay.replayer.replays")
        start = time.perf_counter()
        run.read_shard(20, 0)
        restore = time.perf_counter() - start
        first = float(RunStore.open(store / "replays" / "one").read_steps(["step_time"])["step_time"][0])
        rest = total - imports - restore - first
        print(f"time to the first replayed step (a one-step replay, {total:.1f} s whole): imports {imports:.1f} s, "
              f"restore {restore:.2f} s, the step {first:.2f} s, rank start-up + model build + final checkpoint "
              f"{rest:.1f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    follow_parent()   # started by the test suite: end with it
    main()
