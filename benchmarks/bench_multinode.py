"""Benchmark replays and bisect probes of a run recorded on two nodes: on a two-node Ray cluster (each probe's
ranks on a placement group with the recorded layout, launch/ray_ranks.py) against this machine alone (the
ranks of a probe side by side on warm local ranks, as before).

The run: the planted-data run of the tests (two degenerate samples at step 37; 48 steps, the tiny model),
recorded by two torchrun agents standing for two nodes, one rank and one thread each. The cluster: a head and
a second node on this machine, 2 CPUs each (so the two "nodes" share its 2 cores, as the two agents did).

1. `replay run STORE --from 30 --to 47 --verify`, on the cluster and locally: wall time of the command,
   start-up included (a local replay starts its ranks; a cluster replay its group, actors and ranks).
2. `replay bisect STORE --by data --workers 1` on two fresh copies, on the cluster and locally: the
   session's own seconds, probes and the mean seconds of a probe (warm ranks in both cases).

    .venv/bin/python benchmarks/bench_multinode.py [--quick]
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_analysis import cli, hardware  # noqa: E402
from benchmarks.bench_bisect import fresh_copy  # noqa: E402
from replay.lifeline import follow_parent  # noqa: E402
from tests.bisect.planted import RECORD_ARGS, plant_degenerate_samples  # noqa: E402
from tests.twonodes import ray_two_nodes, torchrun_two_nodes  # noqa: E402


def timed_run(store: Path, *args: str) -> tuple[float, bool]:
    t = time.perf_counter()
    out = json.loads(cli("run", str(store), "--from", "30", "--to", "47", "--verify", "--json", *args).stdout)
    return time.perf_counter() - t, out["verification"]["bitwise"]


def bisect(store: Path, *args: str) -> dict:
    session = json.loads(cli("bisect", str(store), "--by", "data", "--workers", "1", "--json", *args).stdout)
    ran = [p["seconds"] for p in session["probes"].values() if p.get("ran")]
    return {**session["verdict"], "mean_probe": sum(ran) / max(1, len(ran))}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="only the replay, once each (the suite runs it to keep "
                                                          "the benchmark working)")
    quick = ap.parse_args().quick
    print(hardware())
    root = Path(tempfile.mkdtemp(prefix="bench-multinode-"))
    cluster = None
    try:
        plant_degenerate_samples(root / "train.bin", 37, [1, 6])
        args = list(RECORD_ARGS)
        del args[args.index("--nproc"):args.index("--nproc") + 2]   # the agents say how many ranks
        store = root / "run"
        torchrun_two_nodes("-m", "replay", "record", "--store", str(store), "--data", str(root / "train.bin"), *args,
                           "--set", "threads=1")
        cluster = ray_two_nodes()
        on_cluster, bitwise_cluster = timed_run(fresh_copy(store, root / "run-cluster"), "--ray-address",
                                                cluster.address)
        local, bitwise_local = timed_run(fresh_copy(store, root / "run-local"))
        print(f"replay of steps 30..47 (2 ranks): on the 2-node cluster {on_cluster:.1f} s (bit for bit: "
              f"{bitwise_cluster}), on this machine {local:.1f} s (bit for bit: {bitwise_local}): "
              f"cluster/local {on_cluster / local:.2f}x")
        if quick:
            return
        there = bisect(fresh_copy(store, root / "bisect-cluster"), "--ray-address", cluster.address)
        here = bisect(fresh_copy(store, root / "bisect-local"))
        for name, v in (("2-node cluster", there), ("this machine", here)):
            print(f"bisect --by data on {name}: {v['probes']} probes, {v['seconds']:.1f} s, a probe "
                  f"{v['mean_probe']:.2f} s on average; samples {v['samples']}")
        print(f"  a probe, cluster/local: {there['mean_probe'] / here['mean_probe']:.2f}x; whole session "
              f"{there['seconds'] / here['seconds']:.2f}x (same verdict: {there['samples'] == here['samples']})")
    finally:
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    follow_parent()   # started by the test suite: end with it
    main()
