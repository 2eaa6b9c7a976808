"""Where the test suite's CPU goes: runs `make test`'s pytest command while sampling every process it starts
(from /proc, every 0.25 s), then prints CPU seconds by kind of process (docs/testing.md).

    .venv/bin/python benchmarks/suite_cpu.py [PYTEST ARGS...]   # default: the whole suite, as `make test`

A process is counted at its last sample, so the CPU of its final quarter second and of processes that live less
than one sample is missed: the totals are a lower bound, the shares are what to read.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from replay.processes import descendants

REPO = Path(__file__).resolve().parents[1]
MAKE_TEST = ["-q", "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder", "-m", "not benchmark"]
TICK = os.sysconf("SC_CLK_TCK")
KINDS = [   # first match wins
    ("the built-in trainer's ranks", r"replay\.launch\.worker"),
    ("fork servers and the ranks they fork", r"replay\.launch\.forkserver"),   # a forked rank keeps its cmdline
    ("torchrun agents", r"torch\.distributed\.run"),
    ("Ray's workers", r"^ray::|default_worker\.py"),
    ("Ray's daemons", r"raylet|gcs_server|ray/_private|ray/dashboard"),
    ("the lifeline guardians", r"-m replay\.lifeline"),
    ("`replay` CLI processes", r"-m replay |/bin/replay "),
    ("the pytest-xdist workers", r"-c import sys;exec\(eval\(sys\.stdin\.readline\(\)\)\)"),
    ("the S3 server", r"\bweed\b"),
    ("benchmarks", r"benchmarks/bench_"),
    ("users' scripts under `replay`", r"\.py\b"),
]


def sample(pid: int) -> tuple[str, float] | None:
    """(command line, CPU seconds so far) of a process, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    return cmdline.strip(), (int(fields[11]) + int(fields[12])) / TICK


def kind(cmdline: str) -> str:
    return next((name for name, pattern in KINDS if re.search(pattern, cmdline)), "other")


def main() -> None:
    args = sys.argv[1:] or MAKE_TEST
    suite = subprocess.Popen([sys.executable, "-m", "pytest", *args], cwd=REPO)
    last: dict[tuple[int, int], tuple[str, float]] = {}   # (pid, start time) -> its last sample
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for pid, start in descendants(suite.pid).items():
                if (s := sample(pid)) is not None:   # one that ended since has no command line left: keep the last
                    last[pid, start] = (s[0] or last.get((pid, start), ("", 0.0))[0], s[1])
            time.sleep(0.25)

    watcher = threading.Thread(target=watch, daemon=True)
    start = time.monotonic()
    watcher.start()
    code = suite.wait()
    done.set()
    watcher.join()
    cpu: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.defaultdict(int)
    for cmdline, seconds in last.values():
        cpu[kind(cmdline)] += seconds
        count[kind(cmdline)] += 1
    print(f"\nthe suite: {time.monotonic() - start:.0f} s of wall time, exit code {code}; CPU by process (lower "
          "bounds):")
    for name, seconds in sorted(cpu.items(), key=lambda item: -item[1]):
        print(f"  {seconds:7.1f} s  {count[name]:4d} processes  {name}")
    print(f"  {sum(cpu.values()):7.1f} s  in all")
    sys.exit(code)


if __name__ == "__main__":
    main()
