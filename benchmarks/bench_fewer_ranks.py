"""Benchmark `replay run --ranks N`: a window of a 4-rank tiny recording replayed on its 4 recorded ranks, on
2 processes and on 1, side by side in one run. Per replay: bit for bit against the record (`--verify`), the
largest per-step |replayed - recorded| of the loss and of the grad norm, and the wall seconds of the command.
Two fresh 4-rank replays of the window are compared with each other too (their spread; on CPU it is 0).
`--quick` (the suite's): a 2-rank run of 4 steps, its last two replayed on 2 ranks and on 1 process.

    .venv/bin/python benchmarks/bench_fewer_ranks.py [--quick]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_analysis import hardware  # noqa: E402
from replay.lifeline import child_env, follow_parent  # noqa: E402
from replay.store import RunStore  # noqa: E402


def replay(*args: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "replay", *args], check=True, env=child_env(), capture_output=True)
    return time.perf_counter() - t0


def differences(a: Path, b: Path, start: int, stop: int) -> tuple[float, float]:
    """The largest |a - b| over the window's steps, of the loss and of the grad norm."""
    x, y = (RunStore.open(p) for p in (a, b))
    tx, ty = (s.read_steps(["loss", "grad_norm"]) for s in (x, y))
    window = range(start, stop + 1)
    return tuple(max(abs(float(tx[k][s - x.first_step]) - float(ty[k][s - y.first_step])) for s in window)
                 for k in ("loss", "grad_norm"))  # type: ignore[return-value]


def main() -> None:
    follow_parent()
    quick = "--quick" in sys.argv
    world, steps, start, stop = (2, 4, 2, 3) if quick else (4, 40, 20, 39)
    print(hardware())
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        subprocess.run([sys.executable, "-m", "replay", "record", "--store", str(run), "--nproc", str(world), "--steps",
                        str(steps), "--checkpoint-every", str(start), "--set", "micro_batch_size=1"],
                       check=True, env=child_env(), capture_output=True)
        window = ["--from", str(start), "--to", str(stop)]
        rows = []
        fewer = [n for n in (2, 1) if n < world]
        fresh = [(f"{world} ranks ({x})", ["--name", f"full-{x}"]) for x in ("a",) + (() if quick else ("b",))]
        for name, extra in (*fresh, *((f"{n} process(es)", ["--ranks", str(n)]) for n in fewer)):
            seconds = replay("run", str(run), *window, "--verify", *extra)
            path = run / "replays" / (extra[1] if extra[0] == "--name" else f"steps-{start}-{stop}-ranks{extra[1]}")
            verification = RunStore.open(path).manifest.replay_spec.verification
            bitwise = verification.bitwise if verification is not None else None
            rows.append((name, path, seconds, bitwise, *differences(run, path, start, stop)))
        print(f"window {start}..{stop} of a {world}-rank tiny run")
        if not quick:
            spread = differences(rows[0][1], rows[1][1], start, stop)
            print(f"spread of two {world}-rank replays: loss {spread[0]:.3e}, grad norm {spread[1]:.3e}")
        for name, _, seconds, bitwise, dl, dg in rows:
            print(f"{name:12s} {seconds:6.2f} s  {seconds / rows[0][2]:.2f}x  bit for bit: {bitwise}  "
                  f"max |diff| loss {dl:.3e}  grad norm {dg:.3e}")


if __name__ == "__main__":
    main()
