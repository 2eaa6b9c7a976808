"""Local ranks: the environment torchrun would give each rank on one machine, and the one wait for a set of
them (fresh ranks in ranks.py and script.py, warm ranks in pool.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence

from replay.lifeline import child_env

TICK = 0.05   # seconds between looks at the ranks

# `outcomes(timeout)`: the ranks whose outcome came within `timeout` seconds, each with its failure in
# words, or None where it succeeded
Outcomes = Callable[[float], list[tuple[int, str | None]]]


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """What torchrun gives a rank on one machine (env:// rendezvous on loopback), and the lifeline."""
    env = child_env({**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                     "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    env.pop("TORCHELASTIC_RUN_ID", None)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_for_outcomes(procs: Sequence[subprocess.Popen], outcomes: Outcomes, grace: float
                      ) -> tuple[list[str], list[int]]:
    """Wait until every rank has its outcome. When one fails, the others get `grace` seconds to end on their
    own (a peer stuck in a collective with the failed rank usually errors out at once); then the ranks still
    without an outcome are killed, as they are when the wait ends by an exception. Returns the failures in
    the order they came, and the ranks left without an outcome (killed, unless they ended meanwhile)."""
    pending = set(range(len(procs)))
    failures: list[str] = []
    deadline: float | None = None
    try:
        while pending:
            left = TICK if deadline is None else min(TICK, deadline - time.monotonic())
            if left <= 0:
                break
            for rank, failure in outcomes(left):
                pending.discard(rank)
                if failure is not None:
                    failures.append(failure)
            if failures and deadline is None:
                deadline = time.monotonic() + grace
    finally:
        for rank in pending:
            if procs[rank].poll() is None:
                procs[rank].kill()
        for rank in pending:
            procs[rank].wait()
    return failures, sorted(pending)


def wait_for_ranks(procs: Sequence[subprocess.Popen], grace: float = 5.0) -> str | None:
    """Wait for every rank process to exit (`wait_for_outcomes`: no rank outlives the wait). Returns the
    failures in words, the first one first, or None."""
    seen: set[int] = set()

    def exits(timeout: float) -> list[tuple[int, str | None]]:
        ended = [(rank, p.returncode) for rank, p in enumerate(procs) if rank not in seen and p.poll() is not None]
        if not ended:
            time.sleep(timeout)
        seen.update(rank for rank, _ in ended)
        ended.sort(key=lambda e: e[1] >= 0)   # in one look, a rank killed outright came first
        return [(rank, None if code == 0 else f"rank {rank} {_how(code)}") for rank, code in ended]

    failures, killed = wait_for_outcomes(procs, exits, grace)
    failures += [f"rank {rank} {_how(procs[rank].returncode)}" for rank in killed if procs[rank].returncode != 0]
    return ", then ".join(failures) or None


def _how(code: int) -> str:
    if code < 0:
        return f"was killed by signal {-code} ({signal.Signals(-code).name})"
    return f"exited with code {code}"
