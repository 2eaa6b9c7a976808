"""Benchmark replays: replay step rate against the recording's, and the time to the first replayed step.

A 2-rank recording of the built-in trainer (4 layers x 128, seq 128, batch 16, FP32, a checkpoint every 20
steps), then a replay of steps 20..79 of it, both through the command line as a user runs them.
Step rates come from the step logs (`step_time` on rank 0, so process start-up is not in them): the
median over the same steps 21..79 (target: replay >= 0.95x the recording). Time to the first replayed
step: a one-step replay (`--from 20 --to 20`) timed whole, split into the command's imports (a fresh
`python -c "import replay.cli"`), the restore (reading and checksumming a rank's shard, measured here on
the same store; ranks restore in parallel), the step itself (its `step_time`), and the rest (rank
processes starting, imports in the ranks, model build, the final checkpoint's write and commit).

How ranks start, side by side in this one run (a 2-rank recording of the `tiny` preset, one-step replays of it
through `replay.replayer.replays.run` in this process): fresh rank processes, ranks forked from a fork server
already up (launch/forkserver.py), and warm ranks (launch/pool.py, warmed by one replay first). For each, the
time from the request (the launcher's `run`) to rank 0's first step done (its `step` line on stderr), and the
one-step replay's wall time (prepare, ranks, final checkpoint, verification); the median of 3 (1 with
--quick). Then the same one-step replay as a `replay run` command: fresh ranks (REPLAY_RANKS=fresh) against
the command's own fork server (the default). And a warm pool's start with its first one-step replay, its ranks
fresh against forked from the pool's own fork server, alternating: wall and CPU time.

A user's script: the examples' transformers Trainer script (a Llama from a config) recorded on 2 ranks under
torchrun, then the same 2-step `replay run` of it with the script's ranks started as fresh processes
(REPLAY_RANKS=fresh) and forked from the script's fork server (the default: one process imports transformers
once, launch/forkserver.py), alternating, 3 pairs (1 with --quick): the median wall time and CPU time (the
command and every process it started) of each.

    .venv/bin/python benchmarks/bench_replay.py [--quick]
"""

from __future__ import annotations

import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from replay.config import Launcher
from replay.launch.forkserver import ForkServer
from replay.launch.fresh import FreshRanks
from replay.launch.job import RankJob, RankLauncher
from replay.launch.pool import RankPool
from replay.lifeline import child_env, follow_parent
from replay.replayer.replays import ReplayRequest, run
from replay.store import RunStore

ARGS = ["--nproc", "2", "--checkpoint-every", "20", "--set", "model.n_layer=4", "--set",
        "model.n_head=4", "--set", "model.n_embd=128", "--set", "model.block_size=128", "--set", "batch_size=16",
        "--set", "micro_batch_size=8"]


def hardware() -> str:
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.processor())
    return f"hardware: {cpu}, {os.cpu_count()} cores"


def timed(*cmd: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> float:
    return timed_cpu(*cmd, env=env, cwd=cwd)[0]


def timed_cpu(*cmd: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the command and every process it started and waited for)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, *cmd], check=True, capture_output=True, text=True, cwd=cwd,
                   env=child_env({**os.environ, **(env or {})}))
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def script_replays(work: Path, pairs: int) -> None:
    """The examples' Trainer script on 2 ranks: a 2-step replay with fresh script processes against forked ones."""
    example = Path(__file__).resolve().parents[1] / "examples"
    timed(str(example / "nanogpt" / "prepare.py"), "--out", str(work / "tokens"), "--bytes", "100000")
    store = work / "trainer"
    # as a user starts it (the recording's ranks are torchrun's, whose parent is its agent, not this process)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    str(example / "hf_trainer" / "train.py"), f"--data={work / 'tokens' / 'train.bin'}",
                    f"--store={store}", f"--output_dir={work / 'trainer-out'}", "--max_steps=8",
                    "--checkpoint_every=4"],
                   check=True, capture_output=True, cwd=work, env={**os.environ, "OMP_NUM_THREADS": "1"})
    runs: dict[str, list[tuple[float, float]]] = {"fresh": [], "forked": []}
    for i in range(pairs):
        for kind in ("fresh", "forked") if i % 2 == 0 else ("forked", "fresh"):
            env = {"REPLAY_RANKS": "fresh"} if kind == "fresh" else {}
            runs[kind].append(timed_cpu("-m", "replay", "run", str(store), "--from", "5", "--to", "6", "--name",
                                        f"{kind}-{i}", env=env))
    (fw, fc), (kw, kc) = ((statistics.median(w for w, _ in runs[k]), statistics.median(c for _, c in runs[k]))
                          for k in ("fresh", "forked"))
    print(f"a 2-step replay of the Trainer script on 2 ranks: fresh processes {fw:.1f} s ({fc:.1f} s of CPU), "
          f"forked from its fork server {kw:.1f} s ({kc:.1f} s of CPU): {fc / kc:.2f}x less CPU, {fw / kw:.2f}x "
          "the wall time")


class Timed:
    """A launcher that notes when it was asked (the request) and hands the job on."""

    def __init__(self, launcher: RankLauncher):
        self.launcher, self.asked = launcher, 0.0

    def takes(self, launcher: Launcher, world_size: int) -> bool:
        return self.launcher.takes(launcher, world_size)

    def run(self, job: RankJob) -> None:
        self.asked = time.perf_counter()
        self.launcher.run(job)


@contextmanager
def step_lines() -> Iterator[list[float]]:
    """This process's stderr (the ranks' too: fresh and forked ranks write there, and warm ones to /dev/stderr)
    read by a thread, which notes when each `step` line came."""
    read_fd, write_fd = os.pipe()
    saved = os.dup(2)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    times: list[float] = []

    def read() -> None:
        with os.fdopen(read_fd, "rb") as lines:
            for line in lines:
                if line.startswith(b"step "):
                    times.append(time.perf_counter())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield times
    finally:
        os.dup2(saved, 2)   # the pipe's last write end: the reader ends
        os.close(saved)
        reader.join(timeout=10)


def side_by_side(store: Path, start: int, repeats: int) -> None:
    """One-step replays of `store` at `start` on each way of starting ranks (see the module's docstring)."""
    server, pool = ForkServer(), RankPool(2, log="/dev/stderr")
    launchers = {"fresh ranks": FreshRanks(), "fork server": server, "warm ranks": pool}
    results: dict[str, tuple[float, float]] = {}
    try:
        with step_lines() as steps:
            server.start()
            pool.start()
            server.wait_ready()
            assert server.refused is None, f"the fork server cannot fork: {server.refused}"
            run(store, ReplayRequest(start, start, name="warm-up"), ranks=pool)   # the pool joins its group
            for key, launcher in launchers.items():
                firsts, walls = [], []
                for i in range(repeats):
                    timed_launcher = Timed(launcher)
                    seen = len(steps)
                    t0 = time.perf_counter()
                    run(store, ReplayRequest(start, start, name=f"{key.split()[0]}-{i}"), ranks=timed_launcher)
                    walls.append(time.perf_counter() - t0)
                    deadline = time.monotonic() + 5
                    while len(steps) <= seen and time.monotonic() < deadline:
                        time.sleep(0.01)
                    firsts.append(steps[seen] - timed_launcher.asked)
                results[key] = statistics.median(firsts), statistics.median(walls)
    finally:
        server.close()
        pool.close()
    fresh_first, fresh_wall = results["fresh ranks"]
    print(f"how ranks start, one-step replays of the `tiny` preset on 2 ranks, in this process (median of "
          f"{repeats}):")
    for key, (first, wall) in results.items():
        print(f"  {key:<12} request to rank 0's first step {first:6.2f} s ({fresh_first / first:5.1f}x fresh), "
              f"the one-step replay {wall:6.2f} s ({fresh_wall / wall:5.1f}x fresh)")
    print(f"  targets: the first step within 0.5 s of the request (fork server: {results['fork server'][0]:.2f} s), "
          f"a one-step replay <= 2 s (fork server: {results['fork server'][1]:.2f} s)")


def pool_starts(store: Path, start: int, pairs: int) -> None:
    """A warm pool of 2 ranks started and its first one-step replay, the ranks started fresh (REPLAY_RANKS=fresh)
    and forked from the pool's own fork server (the default), alternating: wall and CPU time (every process the
    pool started, reaped when it closes)."""
    def children_cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    measured: dict[str, list[tuple[float, float]]] = {"fresh": [], "forked": []}
    for i in range(pairs):
        for kind, runs in measured.items():
            os.environ.pop("REPLAY_RANKS", None)
            if kind == "fresh":
                os.environ["REPLAY_RANKS"] = "fresh"
            try:
                cpu, t0 = children_cpu(), time.perf_counter()
                with RankPool(2) as pool:
                    run(store, ReplayRequest(start, start, name=f"pool-{kind}-{i}"), ranks=pool)
                runs.append((time.perf_counter() - t0, children_cpu() - cpu))
            finally:
                os.environ.pop("REPLAY_RANKS", None)
    (fresh_wall, fresh_cpu), (forked_wall, forked_cpu) = (
        (statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)) for runs in measured.values())
    print(f"a warm pool of 2 ranks started and its first one-step replay (median of {pairs}): fresh ranks "
          f"{fresh_wall:.1f} s wall, {fresh_cpu:.1f} s CPU; forked from its fork server {forked_wall:.1f} s wall, "
          f"{forked_cpu:.1f} s CPU ({fresh_cpu / forked_cpu:.2f}x less CPU)")


def commands(store: Path, start: int) -> None:
    """The one-step replay as a `replay run` command, fresh ranks against the command's own fork server."""
    window = ("-m", "replay", "run", str(store), "--from", str(start), "--to", str(start))
    fresh = timed(*window, "--name", "cmd-fresh", env={"REPLAY_RANKS": "fresh"})
    forked = timed(*window, "--name", "cmd-forked")
    print(f"the one-step replay as a `replay run` command: fresh ranks {fresh:.1f} s, its own fork server "
          f"{forked:.1f} s ({fresh / forked:.2f}x)")


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
        tiny = work / "tiny"
        timed("-m", "replay", "record", "--store", str(tiny), "--preset", "tiny", "--nproc", "2", "--steps", "20",
              "--checkpoint-every", "10")
        side_by_side(tiny, 10, 1 if quick else 3)
        pool_starts(tiny, 10, 1 if quick else 3)
        script_replays(work, 1 if quick else 3)
        if quick:
            return
        commands(tiny, 10)

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
