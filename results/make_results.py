"""`make results`: reproduce the papers' headline results at laptop scale with the product's own commands
and write them, with the command behind every number, to OUT/results.md (PNGs beside it).

    python -m results.make_results [--out docs] [--work runs/results] [--quick [--story-store STORE]]

Stores already complete in WORK are reused, so a rerun only does what is missing; a partial one (an
interrupted run) is recorded anew. --quick runs every section at a reduced size (the test's run; it
writes to runs/results-quick/ by default, never over the published docs/results.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from results import golden, qiu_yao, story
from results.common import Context, Section, shared_ray

SECTIONS = [golden.forward, golden.weights, qiu_yao.mechanism, story.story]


def render(ctx: Context, done: list[tuple[Section, float, int]], seconds: float) -> str:
    load = os.getloadavg()[0]
    head = [
        "# Results: the papers' headline findings at laptop scale" + (" (QUICK MODE)" if ctx.quick else ""),
        "Every number below is what a `replay` command printed or wrote; each section shows the commands. "
        "Regenerate all of it with one command, `make results` (`.venv/bin/python -m results.make_results`), "
        "which reuses the run stores already complete in its work directory (delete `runs/results` for a "
        "fresh run)." + (" **This file was made by `--quick`: reduced sizes, a test of the pipeline, not the "
                         "published numbers.**" if ctx.quick else ""),
        f"- hardware: {ctx.hardware}\n- date: {ctx.date}\n- wall time: {seconds / 60:.1f} min in all (load "
        f"average {load:.1f} at the end; times are longer where other jobs shared the machine)",
    ]
    parts = []
    for i, (section, took, reused) in enumerate(done, 1):
        commands = "```bash\n" + "\n".join(section.commands) + "\n```" if section.commands else ""
        note = f" (reusing {reused} output{'s' * (reused > 1)} of an earlier run)" if reused else ""
        parts.append(f"## {i}. {section.title}\n\n{commands}\n\n{section.body}\n\n_Wall time: {took:.0f} s{note}._")
    return "\n\n".join(head + parts) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m results.make_results", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="directory for results.md and its PNGs (default docs; quick: "
                   "runs/results-quick/docs)")
    p.add_argument("--work", type=Path, help="directory for run stores and outputs (default runs/results; quick: "
                   "runs/results-quick)")
    p.add_argument("--quick", action="store_true", help="reduced sizes: seconds per section (the test's run)")
    p.add_argument("--story-store", type=Path, help="quick mode: an existing `spike` recording for item 4 "
                   "(without it, quick mode skips item 4)")
    p.add_argument("--jobs", type=int, default=1, help="sections run at once (default 1, which the published "
                   "wall times use; the test runs 4)")
    args = p.parse_args(argv)
    work = args.work or Path("runs/results-quick" if args.quick else "runs/results")
    ctx = Context(out=args.out or (work / "docs" if args.quick else Path("docs")), work=work, quick=args.quick,
                  story_store=args.story_store)
    ctx.work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def run(fn) -> tuple[Section, float, int]:
        name = threading.current_thread().name = f"{fn.__module__}.{fn.__name__}"
        print(f"[{name}] started", file=sys.stderr)
        t = time.perf_counter()
        section = fn(ctx)
        print(f"[{name}] done in {time.perf_counter() - t:.0f} s", file=sys.stderr)
        return section, time.perf_counter() - t, sum(who == name for who, _ in ctx.reused)

    with shared_ray(), ThreadPoolExecutor(max_workers=args.jobs) as pool:   # sections only share the CPU
        done = list(pool.map(run, SECTIONS))
    ctx.out.mkdir(parents=True, exist_ok=True)
    doc = ctx.out / "results.md"
    tmp = doc.with_name(doc.name + ".tmp")
    tmp.write_text(render(ctx, done, time.perf_counter() - t0))
    tmp.replace(doc)
    print(f"wrote {doc} in {(time.perf_counter() - t0) / 60:.1f} min", file=sys.stderr)


if __name__ == "__main__":
    main()
