"""Starting a user's training script again, as it was recorded, in replay mode.

The recorded command (recorder/command.py) runs from its recorded working directory, with this Python and
the recorded variables (PYTHONPATH, thread counts, the launchers' settings: exactly those the record had),
once per rank of the recorded world size. Under the
`torchrun` launcher each process gets torchrun's environment (env:// rendezvous on loopback), as `replay
record`'s own ranks do; each dies with this process (replay/lifeline.py: the script's `Loop` follows its
parent). The script's output goes to stderr, keeping this command's stdout for its answer.

`ScriptRanks` starts the script for each replay; `ScriptServer` keeps its ranks up between replays (a
bisect's probes): each next replay is handed to the running ranks, whose `Loop` restores its checkpoint in
place (recorder/serving.py), and a rank that finds its state after a step from there is not the record's
(the script keeps state of its own) has the script started afresh, for that replay and every later one.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from replay.config import Launcher
from replay.errors import ReplayError
from replay.launch.forkserver import ForkServer, ScriptImage, script_argv_forkable
from replay.launch.job import RankJob
from replay.launch.local import Node, RankProcess, how_it_ended, wait_for_outcomes
from replay.lifeline import child_env
from replay.recorder.command import RESUME_ENV, STORE_ENV, environment
from replay.recorder.serving import SERVE_ENV, Answer, ServedJob, job_line
from replay.store.holder import ENV as LEASE_ENV
from replay.store.location import Location
from replay.store.manifest import CommandInfo

GRACE = 5.0    # seconds a rank has to end on its own once a peer failed
ENDING = 60.0  # seconds a rank told there are no more jobs has to finish its script (its code after the loop)


def _envs(replay: Location, command: CommandInfo, resume: bool, lease: str, node: Node | None) -> list[dict[str, str]]:
    """The environment of each of the recorded command's ranks (those of `node`; default: all of them, on this
    machine) writing the replay at `replay`."""
    extra = {STORE_ENV: str(replay), LEASE_ENV: lease, RESUME_ENV: "1" if resume else "0"}
    if command.launcher == "torchrun":
        node = node or Node.local(command.world_size)
        return [{**environment(command, node.env(local)), **extra} for local in range(len(node.ranks))]
    return [child_env({**environment(command, os.environ), **extra})]


def _start(command: CommandInfo, envs: list[dict[str, str]], serve: Sequence[tuple[int, int]],
           forks: ForkServer | None) -> list[RankProcess]:
    """The ranks, each given its pipe ends (jobs to read, answers to write: recorder/serving.py): forked from
    `forks` where it can fork them, else started as fresh processes."""
    if forks is not None:
        forked = forks.fork_script(list(command.argv), envs, SERVE_ENV, list(serve), cwd=command.cwd)
        if forked is not None:
            return list(forked)
        print(f"note: the script's fork server cannot fork its ranks ({forks.refused}): starting them as fresh "
              "processes", file=sys.stderr, flush=True)
        forks.close()
    args = [sys.executable, *command.argv]
    return [subprocess.Popen(args, cwd=command.cwd, env={**env, SERVE_ENV: f"{fds[0]},{fds[1]}"},
                             stdout=sys.stderr, pass_fds=fds)
            for env, fds in zip(envs, serve, strict=True)]


# a rank's own variables, which no rank's import may see in the server all ranks are forked from
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT", STORE_ENV, RESUME_ENV, LEASE_ENV, SERVE_ENV)


def script_forks(command: CommandInfo, env: Mapping[str, str]) -> ForkServer | None:
    """A fork server for the script's ranks (launch/forkserver.py), importing what its recording had imported in
    the script's environment (`env`, a rank's, less the rank's own variables) and working directory; None where
    its ranks start as fresh processes: not Linux, an interpreter option other than -u, or REPLAY_RANKS=fresh."""
    if not sys.platform.startswith("linux") or not script_argv_forkable(command.argv) \
            or os.environ.get("REPLAY_RANKS") == "fresh":
        return None
    shared = {k: v for k, v in env.items() if k not in RANK_VARIABLES}
    return ForkServer(ScriptImage(tuple(command.imports or ["torch"]), shared, command.cwd))


class ScriptRanks:
    """A launcher (launch/job.py) of a user's script, as `command` recorded it, started for each job."""

    def __init__(self, command: CommandInfo):
        self.command = command

    def takes(self, launcher: Launcher, world_size: int) -> bool:
        return launcher is Launcher.CUSTOM

    def run(self, job: RankJob) -> None:
        with ScriptServer(self.command, keep=False) as once:
            once.run(job)


@dataclass
class _Served:
    """A rank of the script kept up: its process (fresh, or forked from the script's fork server) and its ends
    of the two pipes."""

    process: RankProcess
    jobs: int      # written by us, read by the rank
    answers: int   # written by the rank, read by us

    def close(self) -> None:
        for fd in (self.jobs, self.answers):
            try:
                os.close(fd)
            except OSError:
                pass


class ScriptServer:
    """A launcher (launch/job.py) of a user's script on this machine that keeps its ranks up between jobs,
    handing each next replay to them (recorder/serving.py). `refused`: why the last job could not be served
    on the running ranks (the script was started afresh for it, and is for every job after), else None;
    `starts`: how many times the script was started.
    `forks`: a script fork server of the caller's (`script_forks`), which every start uses and `close` leaves up;
    without one, the server makes its own where a start may use it.
    Close it (or use it as a context) to let the ranks end: they have no more jobs."""

    def __init__(self, command: CommandInfo, keep: bool = True, forks: ForkServer | None = None):
        self.command = command
        self.refused: str | None = None
        self.starts = 0
        self._keep = keep   # False (or once a rank refused): the script is started for each job, and ends with it
        self._ranks: list[_Served] = []
        self._forks = forks   # the script's fork server, once a start may use it
        self._fork_tried = self._lent_forks = forks is not None

    def takes(self, launcher: Launcher, world_size: int) -> bool:
        return launcher is Launcher.CUSTOM and world_size == self.command.world_size

    @property
    def pids(self) -> list[int]:
        """The running ranks' processes (none between a refusal and the next job, or once closed)."""
        return [pid for rank in self._ranks if (pid := rank.process.pid) is not None]

    def run(self, job: RankJob) -> None:
        self.refused = None
        if self._ranks:
            for rank in self._ranks:
                os.write(rank.jobs, job_line(ServedJob(str(job.store), job.lease, job.resume)))
        else:
            self._ranks = self._started(job)
        answers = self._answers(job)
        refused = next((a.refused for a in answers if a.refused), None)
        if refused is not None or len(answers) < len(self._ranks) or not self._keep:
            self._end_ranks()
        if refused is not None:   # the job once more, on the script started afresh, as every later one
            self._keep, self.refused = False, refused
            self._ranks = self._started(job)
            self._answers(job)
            self._end_ranks()

    def _started(self, job: RankJob) -> list[_Served]:
        count = len(job.node.ranks) if job.node else (self.command.world_size
                                                       if self.command.launcher == "torchrun" else 1)
        pipes = [(os.pipe(), os.pipe()) for _ in range(count)]   # (jobs: read, write), (answers: read, write)
        self.starts += 1
        envs = _envs(job.store, self.command, job.resume, job.lease, job.node)
        # forked from one server that imported the script's packages once, where more than one process of the
        # script starts: several ranks, or a server that may start it again for a later job
        if not self._fork_tried and (count > 1 or self._keep):
            self._fork_tried, self._forks = True, script_forks(self.command, envs[0])
        try:
            procs = _start(self.command, envs, [(jobs[0], answers[1]) for jobs, answers in pipes],
                           self._forks if self._forks is None or self._forks.refused is None else None)
        finally:
            for jobs, answers in pipes:   # the ranks' ends are theirs now
                os.close(jobs[0])
                os.close(answers[1])
        return [_Served(p, jobs[1], answers[0]) for p, (jobs, answers) in zip(procs, pipes, strict=True)]

    def _answers(self, job: RankJob) -> list[Answer]:
        """Every rank's answer to the job, or fewer where a rank ended without one (an exit 0: the script left
        its loop early, which the replay's store shows); a failing rank fails the job, no rank outliving it."""
        procs = [r.process for r in self._ranks]
        names = list(job.node.ranks) if job.node else list(range(len(procs)))
        answers: dict[int, Answer] = {}
        told: dict[int, str] = {}   # the error a rank said it fails with, before it exits
        pending = set(range(len(procs)))

        def outcomes(timeout: float) -> list[tuple[int, str | None]]:
            readable, _, _ = select.select([self._ranks[i].answers for i in pending], [], [], timeout)
            done: list[tuple[int, str | None]] = []
            for i in list(pending):
                read = os.read(self._ranks[i].answers, 65536) if self._ranks[i].answers in readable else b""
                for answer in map(Answer.parse, read.splitlines()):
                    if answer.failed is not None:
                        told[i] = answer.failed
                    else:
                        answers[i] = answer
                if i in answers:
                    done.append((i, None))
                    pending.discard(i)
                elif not read and (code := procs[i].poll()) is not None:
                    done.append((i, None if code == 0 else told.get(i) or f"rank {names[i]} {how_it_ended(code)}"))
                    pending.discard(i)
            return done

        try:
            failures, killed = wait_for_outcomes(procs, outcomes, GRACE)
        except BaseException:
            self._end_ranks()
            raise
        if failures or killed:
            self._end_ranks()
            above = "" if told else " (its messages are above)"
            raise ReplayError(f"the training script failed: {', then '.join(failures) or 'a rank was stopped'}{above}")
        return [answers[i] for i in sorted(answers)]

    def close(self) -> None:
        """Tell the ranks there are no more jobs (they leave their loops and end as scripts do), and wait for
        them; one still running after ENDING seconds is killed. Then end the script's fork server, if it has one."""
        self._end_ranks()
        if self._forks is not None and not self._lent_forks:
            self._forks.close()
            self._forks, self._fork_tried = None, False

    def _end_ranks(self) -> None:
        ranks, self._ranks = self._ranks, []
        for rank in ranks:
            rank.close()
        for rank in ranks:
            try:
                rank.process.wait(timeout=ENDING)
            except subprocess.TimeoutExpired:
                rank.process.kill()
                rank.process.wait()

    def __enter__(self) -> ScriptServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
