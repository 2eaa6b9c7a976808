"""Ranks on one node: the environment torchrun would give each, and the one wait for a set of them (fresh
ranks in fresh.py and script.py, forked ones in forkserver.py, warm ranks in pool.py; a Ray cluster's nodes in
ray_ranks.py)."""

from __future__ import annotations

import contextlib
import gc
import os
import random
import signal
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from replay.lifeline import child_env
from replay.recorder.host import NODE_ENV

TICK = 0.05   # seconds between looks at the ranks

# `outcomes(timeout)`: the ranks whose outcome came within `timeout` seconds, each with its failure in
# words, or None where it succeeded
Outcomes = Callable[[float], list[tuple[int, str | None]]]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """For the block (a rank's imports of seconds: torch, transformers, the trainer), Python's garbage collector
    does not run. An import makes hundreds of thousands of objects and frees few, and every full collection it
    sets off visits all of them again (about a fifth of the trainer's import: docs/benchmarks.md)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class RankProcess(Protocol):
    """A rank as the wait sees it: a subprocess.Popen, or a rank of the fork server (forkserver.py)."""

    @property
    def pid(self) -> int | None: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


@dataclass(frozen=True)
class Node:
    """One node's ranks as torchrun would start them: which ranks, and how they meet their peers (env://)."""

    ranks: tuple[int, ...]          # its ranks, by local rank
    world: int
    master: tuple[str, int]         # rank 0's address and port
    rank: int = 0                   # the node's rank (torchrun's GROUP_RANK)
    name: str | None = None         # its name, where the hostname does not tell it (recorder/placement.py)

    @classmethod
    def local(cls, world: int) -> Node:
        """Every rank on this machine, meeting on loopback."""
        return cls(tuple(range(world)), world, ("127.0.0.1", free_port()))

    def env(self, local_rank: int) -> dict[str, str]:
        """What torchrun gives a rank, and the lifeline."""
        env = child_env({**os.environ, "RANK": str(self.ranks[local_rank]), "LOCAL_RANK": str(local_rank),
                         "WORLD_SIZE": str(self.world), "LOCAL_WORLD_SIZE": str(len(self.ranks)),
                         "GROUP_RANK": str(self.rank), "MASTER_ADDR": self.master[0],
                         "MASTER_PORT": str(self.master[1])})
        env.pop("TORCHELASTIC_RUN_ID", None)
        if self.name is not None:
            env[NODE_ENV] = self.name
        else:
            env.pop(NODE_ENV, None)
        return env


# Rendezvous ports come from below the kernel's ephemeral range (32768-60999 on Linux), where every outgoing
# connection of every process takes its local port, and above Ray's worker ports (10002-19999): a port
# found free there stays free until rank 0 binds it (measured: ephemeral picks collided under a loaded suite).
PORTS = range(20000, 32768)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, for rank 0 to listen on."""
    for port in random.Random().sample(PORTS, 64):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:   # every one tried is taken: whatever the kernel gives
        s.bind((host, 0))
        chosen: int = s.getsockname()[1]
        return chosen


def wait_for_outcomes(procs: Sequence[RankProcess], outcomes: Outcomes, grace: float
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


def wait_for_ranks(procs: Sequence[RankProcess], grace: float = 5.0, ranks: Sequence[int] | None = None
                   ) -> str | None:
    """Wait for every rank process to exit (`wait_for_outcomes`: no rank outlives the wait). Returns the
    failures in words, the first one first, or None. `ranks`: the rank each process is (default: its index)."""
    names = list(ranks) if ranks is not None else list(range(len(procs)))
    seen: set[int] = set()

    def exits(timeout: float) -> list[tuple[int, str | None]]:
        ended = [(i, code) for i, p in enumerate(procs) if i not in seen and (code := p.poll()) is not None]
        if not ended:
            time.sleep(timeout)
        seen.update(i for i, _ in ended)
        ended.sort(key=lambda e: e[1] >= 0)   # in one look, a rank killed outright came first
        return [(i, None if code == 0 else f"rank {names[i]} {how_it_ended(code)}") for i, code in ended]

    failures, killed = wait_for_outcomes(procs, exits, grace)
    failures += [f"rank {names[i]} {how_it_ended(code)}" for i in killed if (code := procs[i].wait()) != 0]
    return ", then ".join(failures) or None


def how_it_ended(code: int) -> str:
    """A process's exit code in words."""
    if code < 0:
        return f"was killed by signal {-code} ({signal.Signals(-code).name})"
    return f"exited with code {code}"
