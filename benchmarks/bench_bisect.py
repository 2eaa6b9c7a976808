"""Benchmark `replay bisect`: probes used against the stated bound, 2 Ray workers against 1, and warm
ranks against ranks started afresh for every probe.

A probe takes (ranks x recorded threads) cores, and the bisect runs only as many probes at once as the
cores hold: more would oversubscribe them (measured at about 10x slower probes on this machine). On 2
cores a 2-rank recording therefore runs one probe at a time whatever --workers says; the parallel
measurement uses a 1-rank, 1-thread recording, where 2 probes fit.

1. The demo's case: `replay bisect STORE --by all --fix lr-scale=0.5` on the `spike` preset (2 ranks):
   probes used against the worst case the searches state, and the wall time.
2. 1 vs 2 workers: `replay bisect STORE --by data --workers W` on two fresh copies of the planted-data
   run of the tests (two degenerate samples at step 37), recorded with 1 rank and 1 thread and a
   4-layer, 256-wide model so that a probe does real work (18 steps, about 2.5 s). The wall time is the
   session's own: Ray and the warm ranks' start-up included, the recording excluded. Target: >= 1.6x.
3. Three 10-step replays of the planted run (2 ranks, the tiny model) on fresh ranks (`replay run`, a
   process start-up each) against the same three on one pool of warm ranks.
4. The nanoGPT example's data bisect (examples/nanogpt/train.py, one process, 100 steps, checkpoints every
   4, the windows drawn at step 95 overwritten with bytes above 127 in the token file, as the example's test
   does): the script started afresh for every probe (REPLAY_RANKS=fresh) against the script kept up between
   probes (launch/script.py `ScriptServer`), on two fresh copies of the recording. The wall time is the
   session's own (Ray's start included). Target: >= 3x.
5. `replay session` against `replay run`s: three replays of that nanoGPT recording (two plain windows and an
   emulated BF16 attention from step 90) as three `replay run` commands and as one `replay session` of the
   same three lines (the script started once), on fresh copies, in alternating order, twice each.

    .venv/bin/python benchmarks/bench_bisect.py [--quick | --only-nanogpt]   (BENCH_SAY=1: each bisect's own lines too)

(`--only-nanogpt`: sections 4 and 5.)
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_analysis import cli, hardware  # noqa: E402
from replay.lifeline import child_env, follow_parent  # noqa: E402
from tests.bisect.planted import RECORD_ARGS, plant_degenerate_samples  # noqa: E402
from tests.examples.planted import plant_nanogpt_run  # noqa: E402


def bisect(store: Path, *args: str) -> dict:
    out = cli("bisect", str(store), *args, "--json")
    if os.environ.get("BENCH_SAY"):
        print(out.stderr, file=sys.stderr)
    return json.loads(out.stdout)["verdict"]


def fresh_copy(src: Path, dst: Path) -> Path:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("replays", "bisect", "analysis", "report.html"))
    return dst


def workers_pair(name: str, store: Path, root: Path, *args: str) -> None:
    results = {}
    for workers in (1, 2):
        copy = fresh_copy(store, root / f"{name}-w{workers}")
        results[workers] = bisect(copy, *args, "--workers", str(workers))
    one, two = results[1], results[2]
    print(f"{name}: bisect {' '.join(args)}")
    for w, v in results.items():
        print(f"  {w} worker(s): {v['probes']} probes (worst case {v['bound']}), {v['seconds']:.1f} s; "
              f"window {v['window']}, layers {v['layers']}, heads {v['heads']}, samples {v['samples']}")
    same = all(one[k] == two[k] for k in ("window", "layers", "heads", "batches", "samples"))
    print(f"  speed-up 2 vs 1 workers: {one['seconds'] / two['seconds']:.2f}x (same verdict: {same})")


def warm_vs_fresh(record: list[str], root: Path, windows: list[tuple[int, int]]) -> None:
    """Record `replay record ARGS` on warm ranks (in this process, as `replay demo` does), then time the
    same replays with fresh ranks (`replay run` commands) and on those warm ranks."""
    from replay.cli import main as replay_main
    from replay.launch.pool import RankPool
    from replay.replayer.replays import ReplayRequest, run
    from replay.store.overrides import Overrides

    store = root / "recorded"
    with RankPool(2) as pool:
        with contextlib.redirect_stdout(io.StringIO()):   # the recording's summary is not the benchmark's
            replay_main(["record", "--store", str(store), *record], standalone_mode=False, obj=pool)   # on the pool
        fresh = fresh_copy(store, root / "fresh")
        os.environ["REPLAY_RANKS"] = "fresh"   # fresh rank processes, not the commands' fork servers
        t = time.perf_counter()
        try:
            for a, b in windows:
                cli("run", str(fresh), "--from", str(a), "--to", str(b), "--lr-scale", "0.5")
        finally:
            del os.environ["REPLAY_RANKS"]
        cold = time.perf_counter() - t
        warm_store = fresh_copy(store, root / "warm")
        t = time.perf_counter()
        for a, b in windows:
            run(warm_store, ReplayRequest(a, b, overrides=Overrides(lr_scale=0.5)), ranks=pool)
        warm = time.perf_counter() - t
    print(f"{len(windows)} replay(s) of 10 steps: fresh ranks {cold:.1f} s, warm ranks {warm:.1f} s: "
          f"{cold / warm:.1f}x")


def nanogpt_data_bisect(root: Path) -> None:
    """Section 4: the planted nanoGPT recording, then its data bisect with the script started afresh for each
    probe and with it kept up."""
    planted = root / "nanogpt-planted"
    plant_nanogpt_run(planted, root / "nanogpt-data")
    verdicts = {}
    for how in ("fresh", "kept up"):
        copy = fresh_copy(planted, root / f"nanogpt-{how.replace(' ', '-')}")
        if how == "fresh":
            os.environ["REPLAY_RANKS"] = "fresh"
        try:
            verdicts[how] = bisect(copy, "--by", "data")
        finally:
            os.environ.pop("REPLAY_RANKS", None)
    fresh, kept = verdicts["fresh"], verdicts["kept up"]
    print("nanoGPT example, 1 process, data bisect of the batch planted at step 95:")
    for how, v in verdicts.items():
        print(f"  script {how}: {v['probes']} probes, {v['seconds']:.1f} s; batches {v['batches']}")
    print(f"  speed-up kept up vs fresh: {fresh['seconds'] / kept['seconds']:.1f}x (same verdict: "
          f"{fresh['batches'] == kept['batches'] and fresh['samples'] == kept['samples']})")


SESSION = ["--from 88 --to 92 --verify", "--from 90 --to 93 --attention reference-emu:dtype=bf16 --layers 0",
           "--from 80 --to 84 --verify"]


def session_vs_runs(planted: Path, root: Path) -> None:
    """Section 5: the same replays as `replay run` commands and as one `replay session`."""
    times: dict[str, list[float]] = {"replay run x3": [], "replay session": []}
    for round_ in range(2):
        for how in (list(times) if round_ % 2 == 0 else list(reversed(times))):
            copy = fresh_copy(planted, root / f"session-{round_}-{how.replace(' ', '-')}")
            t = time.perf_counter()
            if how == "replay session":
                out = subprocess.run([sys.executable, "-m", "replay", "session", str(copy)], input="\n".join(SESSION),
                                     capture_output=True, text=True, check=True, env=child_env())
                assert "the script was started once" in out.stderr, out.stderr
            else:
                for line in SESSION:
                    cli("run", str(copy), *line.split())
            times[how].append(time.perf_counter() - t)
    runs, session = (statistics.median(v) for v in times.values())
    print(f"nanoGPT example, 1 process, {len(SESSION)} replays: as `replay run`s {runs:.1f} s, as one `replay "
          f"session` {session:.1f} s (medians of 2): {runs / session:.1f}x")


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only-nanogpt", action="store_true", help="section 4 only")
    ap.add_argument("--quick", action="store_true", help="only warm against fresh ranks, one replay (seconds; the "
                                                          "suite runs it to keep the benchmark working)")
    args = ap.parse_args()
    print(hardware())
    root = Path(tempfile.mkdtemp(prefix="bench-bisect-"))
    try:
        if args.only_nanogpt:
            nanogpt_data_bisect(root)
            session_vs_runs(root / "nanogpt-planted", root)
            return
        if args.quick:
            plant_degenerate_samples(root / "train.bin", 37, [1, 6])
            warm_vs_fresh(["--data", str(root / "train.bin"), *RECORD_ARGS], root, [(30, 39)])
            return
        spike = root / "spike"
        cli("record", "--store", str(spike), "--preset", "spike", "--nproc", "2")
        v = bisect(spike, "--by", "all", "--fix", "lr-scale=0.5")
        print(f"spike preset, 2 ranks, bisect --by all --fix lr-scale=0.5: {v['probes']} probes (worst case "
              f"{v['bound']}) on {v['workers']} worker(s), {v['seconds']:.1f} s; window {v['window']}, layers "
              f"{v['layers']}, heads {v['heads']}, samples {v['samples']}")

        plant_degenerate_samples(root / "train.bin", 37, [1, 6])
        one_rank = list(RECORD_ARGS)
        one_rank[one_rank.index("--nproc") + 1] = "1"
        wider = ["--set", "threads=1", "--set", "model.n_layer=4", "--set", "model.n_embd=256", "--set",
                 "model.n_head=4", "--set", "optim.lr=2e-3", "--set", "optim.min_lr=2e-3"]
        planted = root / "planted"
        cli("record", "--store", str(planted), "--data", str(root / "train.bin"), *one_rank, *wider)
        workers_pair("planted data, 1 rank x 1 thread, 4 x 256 model", planted, root, "--by", "data")

        warm_vs_fresh(["--data", str(root / "train.bin"), *RECORD_ARGS], root, [(30, 39), (31, 40), (32, 41)])
        nanogpt_data_bisect(root)
        session_vs_runs(root / "nanogpt-planted", root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    follow_parent()   # started by the test suite: end with it
    main()
