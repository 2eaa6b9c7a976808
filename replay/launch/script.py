"""Starting a user's training script again, as it was recorded, in replay mode.

The recorded command (recorder/command.py) runs from its recorded working directory, with this Python and
the recorded variables (PYTHONPATH, thread counts, the launchers' settings: exactly those the record had),
once per rank of the recorded world size. Under the
`torchrun` launcher each process gets torchrun's environment (env:// rendezvous on loopback), as `replay
record`'s own ranks do; each dies with this process (replay/lifeline.py: the script's `Loop` follows its
parent). The script's output goes to stderr, keeping this command's stdout for its answer.
"""

from __future__ import annotations

import os
import subprocess
import sys

from replay.config import Launcher
from replay.errors import ReplayError
from replay.launch.job import RankJob
from replay.launch.local import Node, wait_for_ranks
from replay.lifeline import child_env
from replay.recorder.command import RESUME_ENV, STORE_ENV, environment
from replay.store.holder import ENV as LEASE_ENV
from replay.store.location import Location
from replay.store.manifest import CommandInfo


def run_script(replay: Location, command: CommandInfo, resume: bool, lease: str, node: Node | None = None) -> None:
    """Run the recorded command's ranks writing the replay at `replay` (those of `node`; default: all of them,
    on this machine), and wait; a failing rank fails it."""
    extra = {STORE_ENV: str(replay), LEASE_ENV: lease, RESUME_ENV: "1" if resume else "0"}
    args = [sys.executable, *command.argv]
    if command.launcher == "torchrun":
        node = node or Node.local(command.world_size)
        envs = [{**environment(command, node.env(local)), **extra} for local in range(len(node.ranks))]
    else:
        envs = [child_env({**environment(command, os.environ), **extra})]
    procs = [subprocess.Popen(args, cwd=command.cwd, env=env, stdout=sys.stderr) for env in envs]
    failures = wait_for_ranks(procs, ranks=node.ranks if node else None)
    if failures:
        raise ReplayError(f"the training script failed: {failures} (its messages are above)")


class ScriptRanks:
    """A launcher (launch/job.py) of a user's script, as `command` recorded it."""

    def __init__(self, command: CommandInfo):
        self.command = command

    def takes(self, launcher: Launcher, world_size: int) -> bool:
        return launcher is Launcher.CUSTOM

    def run(self, job: RankJob) -> None:
        run_script(job.store, self.command, job.resume, job.lease, node=job.node)
