"""Starting a user's training script again, as it was recorded, in replay mode.

The recorded command (recorder/command.py) runs from its recorded working directory, with this Python and
the recorded PYTHONPATH and thread variables, once per rank of the recorded world size. Under the
`torchrun` launcher each process gets torchrun's environment (env:// rendezvous on loopback), as `replay
record`'s own ranks do; each dies with this process (replay/lifeline.py: the script's `Loop` follows its
parent). The script's output goes to stderr, keeping this command's stdout for its answer.
"""

from __future__ import annotations

import os
import subprocess
import sys

from replay.errors import ReplayError
from replay.launch.local import free_port, rank_env, wait_for_ranks
from replay.lifeline import child_env
from replay.recorder.command import RESUME_ENV, STORE_ENV
from replay.store.holder import ENV as LEASE_ENV
from replay.store.location import Location
from replay.store.manifest import CommandInfo


def run_script(replay: Location, command: CommandInfo, resume: bool, lease: str) -> None:
    """Run the recorded command's ranks writing the replay at `replay`, and wait; a failing rank fails it."""
    extra = {**command.env, STORE_ENV: str(replay), LEASE_ENV: lease,
             RESUME_ENV: "1" if resume else "0"}
    args = [sys.executable, *command.argv]
    if command.launcher == "torchrun":
        port = free_port()
        envs = [{**rank_env(rank, command.world_size, port), **extra} for rank in range(command.world_size)]
    else:
        envs = [child_env({**os.environ, **extra})]
    procs = [subprocess.Popen(args, cwd=command.cwd, env=env, stdout=sys.stderr) for env in envs]
    failures = wait_for_ranks(procs)
    if failures:
        raise ReplayError(f"the training script failed: {failures} (its messages are above)")
