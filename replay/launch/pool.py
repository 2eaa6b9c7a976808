"""Warm ranks: a set of rank processes that stays up between replays, so a replay costs its steps, not
the ~6 s per process of importing torch and transformers and joining a process group.

Each rank is `python -m replay.launch.worker --serve` with torchrun's environment (RANK, WORLD_SIZE,
MASTER_ADDR/PORT, ...), forked from a fork server (launch/forkserver.py: the pool's own, or one its caller
lends it), so that the pool's ranks import torch and transformers once between them, not once each; or
started as fresh processes where no fork server can fork (not Linux, REPLAY_RANKS=fresh, a Ray node's ranks).
A rank joins the process group once, then trains one store per request line on its request pipe and answers
one JSON line on its reply pipe. Every replay restores its model, optimizer and RNG states from the store and
sets its thread count and determinism flags, so nothing carries over between replays but imported code;
bitwise verification checks exactly that.
A failing rank (its error, or its death) takes the whole pool down: the others may be stuck in a
collective. The next request starts a fresh pool.

A pool is a launcher (launch/job.py): a caller that keeps one (`replay demo`, a bisect's probe worker, a
notebook, a test session) passes it to the recordings and replays that should run on it.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
from pathlib import Path

from replay.config import Launcher
from replay.errors import ReplayError
from replay.kernels.plan import plugin_env
from replay.launch.forkserver import ForkServer
from replay.launch.job import RankJob, fresh_ranks
from replay.launch.local import Node, RankProcess, wait_for_outcomes
from replay.launch.worker import POOL_FDS
from replay.store.s3 import configuration


class RankPoolError(ReplayError):
    """A rank of the pool failed or died: the pool is gone; the next request starts a fresh one."""


class RankPool:
    """`world_size` warm ranks on this machine, forked from `forks` (a fork server of the caller's, kept when the
    pool closes) or from one of the pool's own; or, given a `node`, the ranks of that node only (a Ray cluster's
    node, launch/ray_ranks.py), fresh processes that meet the other nodes' ranks at its rendezvous."""

    def __init__(self, world_size: int, log: str | Path | None = None, node: Node | None = None,
                 forks: ForkServer | None = None):
        assert node is None or node.world == world_size, "a node's ranks belong to a world of this size"
        assert forks is None or forks.script is None, "warm ranks are the built-in trainer's"
        self.world_size = world_size
        self.node = node
        self.log_path = Path(log) if log else None
        self._forks = forks
        self._own_forks: ForkServer | None = None
        self._procs: list[RankProcess] = []
        self._requests: list[int] = []
        self._replies: list[int] = []

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.poll() is None for p in self._procs)

    def start(self) -> None:
        """Start the ranks now (fresh ones import and join their process group while other work goes on; forked
        ones once their server has imported)."""
        if not self.alive:
            self._end()
            self._start()

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.node.ranks if self.node else tuple(range(self.world_size))

    def _server(self) -> ForkServer | None:
        """The fork server the ranks come from; None: they start as fresh processes."""
        if self.node is not None or fresh_ranks():
            return None
        if self._forks is not None:
            return self._forks
        if self._own_forks is None:
            self._own_forks = ForkServer()
        return self._own_forks if self._own_forks.takes(Launcher.LOCAL, self.world_size) else None

    def _start(self) -> None:
        node = self.node or Node.local(self.world_size)
        log = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND) if self.log_path \
            else os.open(os.devnull, os.O_WRONLY)
        pipes = [(os.pipe(), os.pipe()) for _ in node.ranks]   # (requests, replies) of each rank
        theirs: list[tuple[int, ...]] = [(requests[0], replies[1]) for requests, replies in pipes]
        envs = [{**node.env(local), POOL_FDS: "{},{}".format(*theirs[local])} for local in range(len(node.ranks))]
        try:
            server = self._server()
            forked = server.fork_warm(envs, POOL_FDS, theirs, log) if server is not None else None
            if server is not None and forked is None:
                print(f"note: the fork server cannot fork warm ranks ({server.refused}): starting fresh ones",
                      file=sys.stderr, flush=True)
            self._procs = list(forked) if forked is not None else [
                subprocess.Popen([sys.executable, "-m", "replay.launch.worker", "--serve"], env=env,
                                 stdin=subprocess.DEVNULL, stdout=log, stderr=log, pass_fds=own)
                for env, own in zip(envs, theirs, strict=True)]
        finally:
            for fd in (log, *(fd for own in theirs for fd in own)):
                os.close(fd)   # the ranks hold theirs: a rank's death is the end of its reply pipe
        self._requests = [requests[1] for requests, _ in pipes]
        self._replies = [replies[0] for _, replies in pipes]

    def takes(self, launcher: Launcher, world_size: int) -> bool:
        return launcher is Launcher.LOCAL and world_size == self.world_size > 1

    def run(self, job: RankJob) -> None:
        """Train the (already prepared) store of `job` on every rank of the pool (its own node and rendezvous);
        raises RankPoolError if any rank fails."""
        assert job.world_size == self.world_size and not job.env, "the pool takes local runs of its world size"
        self.start()
        store = job.store
        request = (json.dumps({"store": str(store), "resume": job.resume, "lease": job.lease,
                               "env": {**plugin_env(), **configuration()}})
                   + "\n").encode()
        try:
            for fd in self._requests:
                os.write(fd, request)
        except BrokenPipeError:
            self._end(kill=True)
            raise RankPoolError(f"a warm rank died before it took the replay of {store}"
                                f"{self._see_log()}") from None
        failures = self._collect()
        if failures:
            self._end(kill=True)
            raise RankPoolError(f"{'; '.join(failures)} (replay of {store}){self._see_log()}")

    def _see_log(self) -> str:
        return f"; the ranks' output is in {self.log_path}" if self.log_path else ""

    def _collect(self) -> list[str]:
        """Wait for every rank's answer (launch/local.py: the first failure ends the wait after a grace, for
        the others may hang in a collective); a rank's death first, the errors it caused after."""
        selector = selectors.DefaultSelector()
        for local, fd in enumerate(self._replies):
            selector.register(fd, selectors.EVENT_READ, local)
        buffers = {local: b"" for local in range(len(self._replies))}
        ranks = self.ranks

        def answers(timeout: float) -> list[tuple[int, str | None]]:
            out: list[tuple[int, str | None]] = []
            for key, _ in selector.select(timeout):
                local = key.data
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                    out.append((local, f"rank {ranks[local]} died (exit code {self._procs[local].wait()})"))
                    continue
                buffers[local] += chunk
                if buffers[local].endswith(b"\n"):
                    answer = json.loads(buffers[local])
                    selector.unregister(key.fd)
                    out.append((local, f"rank {ranks[local]}: {answer['error']}" if "error" in answer else None))
            return out

        try:
            failures, _ = wait_for_outcomes(self._procs, answers, grace=2.0)
        finally:
            selector.close()
        return sorted(failures, key=lambda f: "died" not in f)

    def close(self) -> None:
        """Let the ranks leave (the end of their requests), and end the pool's own fork server."""
        self._end()
        if self._own_forks is not None:
            self._own_forks.close()
            self._own_forks = None

    def _end(self, kill: bool = False) -> None:
        """Let the ranks leave, or kill them (a failed replay: some may be stuck)."""
        for proc in self._procs:
            if kill and proc.poll() is None:
                proc.kill()
        for fd in self._requests:
            os.close(fd)
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for fd in self._replies:
            os.close(fd)
        self._procs, self._requests, self._replies = [], [], []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
