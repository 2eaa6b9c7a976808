"""Fault injection for tests, in one place: off unless REPLAY_FAULT arms a fault point.

`REPLAY_FAULT=<point>:<argument>...` arms one of the points below (several, comma-separated, arm each);
the product calls `hit(point, ...)` there, which does nothing unless an armed fault names exactly that
place. A fault is what a real failure does: a SIGKILL of the process, or the OSError a flaky disk raises.
With REPLAY_FAULT_ONCE=<dir>, a fault fires once over all processes (the first to create its marker in
that directory), so a retry succeeds.

    shard-half:STEP:RANK       rank RANK half-way through its shard of checkpoint STEP      SIGKILL
    shard-pause:STEP:RANK      there too: it waits (ONCE/paused made) until ONCE/go exists   a pause
    before-commit:STEP:RANK    rank RANK once its shard of STEP is written, before the commit  SIGKILL
    bisect-kill:N              the bisect driver once N probes have run                    SIGKILL
    analysis-driver-kill:N     the analysis driver after N work items                      SIGKILL
    analysis-kill:STEP         an analysis task reading checkpoint STEP                    SIGKILL
    analysis-io:STEP           an analysis task reading checkpoint STEP                    OSError
    analysis-unfinished        the analysis driver: a table's arrays made, not its attributes SIGKILL
    analysis-rows              the analysis driver: arrays sized for new rows, not yet listed SIGKILL
    report-written             `replay report`: its page in the temporary file, not renamed SIGKILL
    export-written             `replay export`: DCP's files written, still marked unfinished SIGKILL
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

ENV, ONCE = "REPLAY_FAULT", "REPLAY_FAULT_ONCE"
_AT_LEAST = {"bisect-kill", "analysis-driver-kill"}   # counters: fire once the count is reached


def armed() -> dict[str, str]:
    """The fault settings to hand to processes that do not inherit this one's environment (Ray workers)."""
    return {k: os.environ[k] for k in (ENV, ONCE) if os.environ.get(k)}


def hit(point: str, *where: int) -> None:
    for spec in filter(None, os.environ.get(ENV, "").split(",")):
        name, *args = spec.split(":")
        if name != point or len(args) != len(where):
            continue
        reached = where[0] >= int(args[0]) if name in _AT_LEAST else [int(a) for a in args] == list(where)
        if not reached or not _first(spec):
            continue
        if point == "analysis-io":
            raise OSError(f"injected transient I/O error reading checkpoint {where[0]}")
        if point == "shard-pause":   # the test does to the store what it wants meanwhile (a server restart)
            _pause(Path(os.environ[ONCE]))
            return
        os.kill(os.getpid(), signal.SIGKILL)


def _pause(marks: Path, timeout: float = 300.0) -> None:
    (marks / "paused").touch()
    deadline = time.monotonic() + timeout
    while not (marks / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _first(spec: str) -> bool:
    once = os.environ.get(ONCE)
    if not once:
        return True
    try:
        (Path(once) / spec.replace(":", "-")).touch(exist_ok=False)
    except FileExistsError:
        return False
    return True
