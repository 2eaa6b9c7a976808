"""Benchmark `replay diff`: its time against the time of the step it runs twice, side by side in this process.

A one-rank recording of the built-in trainer in GPT-2 small's shape (12 layers x 12 heads x 768, FP32, eager
attention; sequences of 256 tokens, one micro-batch of 4; the built-in corpus's byte vocabulary), one step
with its checkpoint at step 0. Then, each the median of 3 (1 with --quick):
- the step: the model built and restored from the checkpoint, the micro-batch's forward and backward, as each
  side of a diff runs it, without the comparison;
- `replay diff` with both sides as recorded (every module's output and gradient, the attention calls' and the
  weight gradients: side A's written to a temporary file, side B's compared as they come);
- `replay diff --attention sdpa` (side B's attention another backend: its tensors from the attention on differ
  and are read back for their deviations).
Target (issue 44): a diff within 5x the step. Then the peak resident memory of each of the three, each in a
process of its own (the same code; the kernel's VmHWM, which, unlike `ru_maxrss`, does not carry over the
peak of the process that started it): what a diff holds beyond the step itself. `--quick`: the
`tiny` preset's shape.

    .venv/bin/python benchmarks/bench_diff.py [--quick]
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from replay.lifeline import child_env
from replay.replayer.diff import diff
from replay.store import RunStore
from replay.store.location import Location
from replay.store.overrides import Overrides
from replay.train.data import load_data
from replay.train.model import build_model, lm_loss

SMALL = ["--set", "model.n_layer=12", "--set", "model.n_head=12", "--set", "model.n_embd=768", "--set",
         "model.block_size=256", "--set", "batch_size=4", "--set", "micro_batch_size=4"]


def hardware() -> str:
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.processor())
    return f"hardware: {cpu}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"


def plain_step(store: RunStore, step: int) -> None:
    """One side's work without the comparison: the model restored from the checkpoint, forward and backward."""
    cfg = store.manifest.config
    data = load_data(cfg, store)
    model = build_model(cfg.model, data.vocab_size, cfg.seed)
    model.load_state_dict(store.read_shard(step, 0)["state"]["replicated"]["model"])
    model.train()
    ids = store.read_steps(["sample_ids"], start=step, stop=step + 1)["sample_ids"][0][0]
    for micro in ids:
        x, y = data.batch(micro)
        (lm_loss(model, x, y) / len(ids)).backward()


def median_seconds(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    quick = "--quick" in sys.argv
    runs = 1 if quick else 3
    with tempfile.TemporaryDirectory(prefix="bench-diff-") as tmp:
        where = Path(tmp) / "run"
        subprocess.run([sys.executable, "-m", "replay", "record", "--store", str(where), "--steps", "1",
                        "--set", "threads=" + str(torch.get_num_threads()), *([] if quick else SMALL)],
                       check=True, capture_output=True, text=True, env=child_env())   # it ends with this one
        store, location = RunStore.open(where), Location.parse(where)
        model = store.manifest.config.model
        print(f"model: {model.n_layer} layers x {model.n_head} heads x {model.n_embd}, seq {model.block_size}; "
              f"{hardware()}")
        step = median_seconds(lambda: plain_step(store, 0), runs)
        same = median_seconds(lambda: diff(location, 0, Overrides()), runs)
        other = median_seconds(lambda: diff(location, 0, Overrides(attention="sdpa")), runs)
        answer = diff(location, 0, Overrides(attention="sdpa"))
        peaks = {what: peak_mib(where, what) for what in ("step", "as recorded", "sdpa")}
    print(f"the step (restore, forward, backward): {step:.2f} s")
    print(f"replay diff, both sides as recorded: {same:.2f} s = {same / step:.2f}x the step "
          f"({answer.compared} tensors compared)")
    print(f"replay diff --attention sdpa: {other:.2f} s = {other / step:.2f}x the step ({len(answer.differences)} "
          f"differ; first: {answer.first.where + ' ' + answer.first.what if answer.first else 'none'})")
    print(f"peak resident memory, each in a process of its own: the step {peaks['step']} MiB; replay diff as "
          f"recorded {peaks['as recorded']} MiB = {peaks['as recorded'] / peaks['step']:.3f}x; --attention sdpa "
          f"{peaks['sdpa']} MiB = {peaks['sdpa'] / peaks['step']:.3f}x")


def peak_mib(where: Path, what: str) -> int:
    """The peak resident memory of a process that runs only `what` on the run at `where`: the step, or a diff."""
    if what == "step":
        code = "import bench_diff as b; from replay.store import RunStore; b.plain_step(RunStore.open(w), 0)"
    else:
        overrides = "Overrides(attention='sdpa')" if what == "sdpa" else "Overrides()"
        code = ("from replay.replayer.diff import diff; from replay.store.location import Location; "
                f"from replay.store.overrides import Overrides; diff(Location.parse(w), 0, {overrides})")
    script = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); w = {str(where)!r}; {code}; "
              "print(next(line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM:')))")
    done = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True,
                          env=child_env())
    return int(done.stdout.split()[-1]) // 1024   # kB


if __name__ == "__main__":
    main()
