"""Benchmark the analysis: one GPT-2-small-sized checkpoint on one core, 2 Ray workers against 1, and a small
compare without Ray against one on a local cluster.

The store is a real recording with GPT-2 small's transformer (12 layers, 12 heads, d=768, vocab 50304;
sequence length 128 instead of 1024, which changes only the position embedding) trained 3 steps on the
built-in corpus with a checkpoint before every step, through `replay record`.

1. The spectral part of one checkpoint, every layer and head (what `weight_metrics` computes: whole
   W_Q, W_K, W_V, W_O, MLP matrices, per-head W_Q/W_K/W_V/W_O, per-head W_Q,h W_K,h^T), in this process
   with one BLAS/torch thread (target <= 2 s); and, for context, the rest of a work item (reading the
   tensors, update statistics, the probe forward).
2. The analysis with 1 then 2 workers (`analysis.jobs.analyze`, what `replay analyze --workers W` runs, each
   on a local Ray cluster of its own) on the same store (analysis removed in between), twice, alternated:
   the speed-up of the work itself (the `seconds` each reports, Ray start-up excluded; target >= 1.7x).
   --quick runs each once, both on one cluster: the one at RAY_ADDRESS where one is set, else a local one
   of 2 CPUs. Without --quick there is no cluster to join, so `--workers 1` runs its items in this
   process (analysis/jobs.py `task_slots`), as the command does.
3. A small `replay compare` end to end, as a user types it with no cluster: two 10-step `tiny` runs, in a
   fresh process each time, `--workers 1` (its items in the command's own process, no Ray) against
   `--workers 2` (a local Ray cluster of its own), alternated, best of two each (--quick: once each).

    .venv/bin/python benchmarks/bench_analysis.py [--quick]
"""

from __future__ import annotations

import os

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"          # one core, before numpy loads its BLAS

import platform  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from replay.launch.ray_cluster import SYSTEM_CONFIG  # noqa: E402
from replay.lifeline import child_env, follow_parent, guarded  # noqa: E402

QUICK_RECORD = ["--steps", "3", "--checkpoint-every", "1", "--set", "snapshot_every=0"]
RECORD = ["--preset", "gpt2-small", "--precision", "fp32", "--steps", "3", "--checkpoint-every", "1",
          "--set", "model.block_size=128", "--set", "batch_size=1", "--set", "micro_batch_size=1",
          "--set", "snapshot_every=0"]


def hardware() -> str:
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.processor())
    return f"hardware: {cpu}, {os.cpu_count()} cores"


def cli(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "replay", *args], capture_output=True, text=True, env=child_env())
    if result.returncode:
        sys.exit(f"replay {' '.join(args)} failed:\n{result.stderr}")
    return result


def best_of(n: int, fn) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    import argparse

    import torch

    from replay.analysis import jobs, tasks
    from replay.analysis import metrics as M
    from replay.analysis.items import Source
    from replay.store import RunStore

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the tiny model, each worker count once (seconds; the "
                                                          "suite runs it to keep the benchmark working)")
    quick = ap.parse_args().quick
    if not quick:
        os.environ.pop("RAY_ADDRESS", None)   # the speed-up is measured on local clusters of 1 and 2 CPUs
    torch.set_num_threads(1)
    print(hardware())
    work = Path(tempfile.mkdtemp(prefix="bench-analysis-"))
    try:
        store = work / "run"
        start = time.perf_counter()
        cli("record", "--store", str(store), *(QUICK_RECORD if quick else RECORD))
        print(f"recorded {store.name}: 4 checkpoints in {time.perf_counter() - start:.0f} s")

        run = RunStore.open(store)
        cfg = run.manifest.config.model

        def matrices(step: int) -> list[dict]:
            return tasks.read_layers(Source(run.location, step), range(cfg.n_layer))

        mats = matrices(2)
        spectral = best_of(3, lambda: [M.weight_metrics(m, cfg.n_head) for m in mats])
        read = best_of(3, lambda: matrices(2))
        items, _ = jobs.plan_metrics(RunStore.open(store, mode="a"))
        full = best_of(1, lambda: [tasks.compute_metrics(i) for i in items if i.ckpt.step == 2])
        print(f"one checkpoint, {cfg.n_layer} layers x {cfg.n_head} heads, one core: spectral part {spectral:.2f} s "
              f"(target <= 2 s at GPT-2 small); whole work items {full:.2f} s (reading the layers {read:.2f} s; the "
              "rest is update statistics and the probe forward)")
        shutil.rmtree(store / "analysis")

        seconds: dict[int, list[float]] = {1: [], 2: []}
        with guarded():
            if quick and not os.environ.get("RAY_ADDRESS"):   # one cluster for both runs, which analyze reuses
                import ray

                ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR",
                         _system_config=SYSTEM_CONFIG)
            for workers in (1, 2) if quick else (1, 2, 1, 2):   # alternated, best of two each: this VM is noisy
                out = jobs.analyze(str(store), workers=workers)   # what `replay analyze --workers W` runs
                seconds[workers].append(out.seconds)
                print(f"--workers {workers}: {out.computed} work items in {out.seconds:.1f} s")
                shutil.rmtree(store / "analysis")
        print(f"speed-up with 2 workers: {min(seconds[1]) / min(seconds[2]):.2f}x (target >= 1.7x at GPT-2 small; "
              f"best of {len(seconds[1])} run(s) each" + ("; --quick: the first run starts the workers, so this is "
                                                          "no measurement)" if quick else ")"))
        small_compare(work, quick)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def small_compare(work: Path, quick: bool) -> None:
    """Part 3: `replay compare A B` of two small runs, in its own process, with and without Ray."""
    a, b = work / "tiny-a", work / "tiny-b"
    for store, seed in ((a, 1), (b, 2)):
        cli("record", "--store", str(store), "--preset", "tiny", "--steps", "10", "--checkpoint-every", "5",
            "--set", f"seed={seed}")
    env = {k: v for k, v in child_env().items() if k != "RAY_ADDRESS"}   # no cluster to join, as at a prompt
    seconds: dict[int, list[float]] = {1: [], 2: []}
    for workers in (1, 2) if quick else (1, 2, 1, 2):
        shutil.rmtree(a / "analysis", ignore_errors=True)
        start = time.perf_counter()
        result = subprocess.run([sys.executable, "-m", "replay", "compare", str(a), str(b), "--workers", str(workers),
                                 "--json"], capture_output=True, text=True, env=env)
        seconds[workers].append(time.perf_counter() - start)
        if result.returncode:
            sys.exit(f"replay compare failed:\n{result.stderr}")
        where = "in its own process" if "in this process" in result.stderr else "on a local Ray cluster"
        print(f"replay compare (2 tiny runs, 3 checkpoints) --workers {workers}: {seconds[workers][-1]:.1f} s, {where}")
    print(f"a small compare without Ray: {min(seconds[2]) / min(seconds[1]):.2f}x faster than on a local cluster of "
          f"its own (best of {len(seconds[1])} each)")


if __name__ == "__main__":
    follow_parent()   # started by the test suite: end with it
    main()
