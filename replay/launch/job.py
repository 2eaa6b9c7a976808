"""A job of ranks, and what runs one: every launcher (fresh processes, the fork server, warm ranks, a Ray
placement group, a user's script) takes a `RankJob` and runs it to its end, or raises naming the failures.

Which launcher runs a job is decided in one place, `launch/ranks.py` (`choose_launcher`); a caller that keeps
ranks of its own (warm ranks, a fork server, a placement group) passes them there, never through a global.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from replay.config import Launcher
from replay.errors import ReplayError, UsageError
from replay.launch.local import Node
from replay.store import RunStore
from replay.store.holder import ENV as LEASE_ENV
from replay.store.lifecycle import continue_command
from replay.store.location import Location


@dataclass(frozen=True)
class RankJob:
    """What one run of ranks is: they train `store` (prepared), writing under `lease`."""

    store: Location
    lease: str                       # the spec of the launching command's lease (store/lease.py)
    resume: bool                     # continue from the store's last committed checkpoint
    world_size: int                  # the processes to start: the run's ranks, or a replay's --ranks
    node: Node | None = None         # this machine's ranks and their rendezvous; None: all, meeting on loopback
    env: Mapping[str, str] = field(default_factory=dict)   # the launcher's variables for the ranks (DS_ACCELERATOR)

    def node_here(self) -> Node:
        """The ranks this machine starts (a fresh rendezvous port for each call without `node`)."""
        return self.node or Node.local(self.world_size)

    def args(self) -> list[str]:
        """A rank's arguments (launch/worker.py)."""
        return [str(self.store)] + (["--resume"] if self.resume else [])

    def rank_env(self, node: Node, local: int) -> dict[str, str]:
        """The whole environment of `node`'s rank `local`: torchrun's variables, the lifeline, the lease."""
        return {**node.env(local), **self.env, LEASE_ENV: self.lease}

    def failed(self, failures: str) -> ReplayError:
        """The error of a job whose ranks failed (`failures`, in words), their own messages printed before it."""
        return ReplayError(f"{failures}; their own messages are above (committed checkpoints are intact"
                           f"{continued_by(self.store)})")


def continued_by(store: Location) -> str:
    """How the stopped run or replay at `store` continues, for the line that says it stopped."""
    try:
        command = continue_command(RunStore.open(store))
    except ReplayError:   # the store cannot be read now: the rank's own message says why
        return ""
    return f": `{command}` continues" if command else ""


class RankLauncher(Protocol):
    """Runs a job's ranks and waits for them: returns when every rank succeeded, raises ReplayError naming the
    failures otherwise; no rank outlives `run`."""

    def takes(self, launcher: Launcher, world_size: int) -> bool:
        """Whether it runs the ranks of a run of `launcher` (what trains) on `world_size` processes."""
        ...

    def run(self, job: RankJob) -> None: ...


RANKS_ENV = "REPLAY_RANKS"   # "fresh": ranks start as fresh processes, never forked, scripts never kept up


def fresh_ranks() -> bool:
    """REPLAY_RANKS=fresh: every rank starts as a new process, never forked, and a user's script is started
    anew for each replay, never kept up between them (launch/script.py)."""
    fresh = os.environ.get(RANKS_ENV, "")
    if fresh not in ("", "fresh"):
        raise UsageError(f"{RANKS_ENV}={fresh}: set it to `fresh` to start every rank as a new process, or unset it")
    return fresh == "fresh"
