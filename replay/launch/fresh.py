"""Fresh ranks: one `python -m replay.launch.worker STORE` process per rank, started here with torchrun's
environment (env:// rendezvous), each dying with this process (lifeline.py). Each imports torch and
transformers itself (seconds of CPU); the fork server (forkserver.py) saves that where it may be used."""

from __future__ import annotations

import subprocess
import sys

from replay.config import Launcher
from replay.launch.job import RankJob
from replay.launch.local import Node, wait_for_ranks


class FreshRanks:
    """A launcher (launch/job.py) that starts every rank as a new process."""

    def takes(self, launcher: Launcher, world_size: int) -> bool:
        return launcher is not Launcher.CUSTOM

    def run(self, job: RankJob) -> None:
        failures = run_node(job, job.node_here())
        if failures:
            raise job.failed(failures)


def run_node(job: RankJob, node: Node) -> str | None:
    """Run `node`'s ranks of `job` as fresh processes and wait: their failures in words, or None."""
    args = [sys.executable, "-m", "replay.launch.worker", *job.args()]
    procs = [subprocess.Popen(args, env=job.rank_env(node, local)) for local in range(len(node.ranks))]
    return wait_for_ranks(procs, ranks=node.ranks)
