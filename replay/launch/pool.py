"""Warm ranks: a set of rank processes that stays up between replays, so a replay costs its steps, not
the ~6 s per process of importing torch and transformers and joining a process group.

Each rank is `python -m replay.launch.worker --serve`, started with torchrun's environment (RANK,
WORLD_SIZE, MASTER_ADDR/PORT, ...). It joins the process group once, then trains one store per request
line on its stdin and answers one JSON line on its own reply pipe. Every replay restores its model,
optimizer and RNG states from the store and sets its thread count and determinism flags, so nothing
carries over between replays but imported code; bitwise verification checks exactly that.
A failing rank (its error, or its death) takes the whole pool down: the others may be stuck in a
collective. The next request starts a fresh pool.

A pool used as a context manager is *active* while the block runs: every recording or replay of this
process that would start local ranks of its world size runs on it instead (`replay demo`, a notebook,
a test session).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from replay.errors import ReplayError
from replay.kernels.plan import plugin_env
from replay.launch.local import Node, wait_for_outcomes
from replay.store.location import Location
from replay.store.s3 import configuration


class RankPoolError(ReplayError):
    """A rank of the pool failed or died: the pool is gone; the next request starts a fresh one."""


_active: list[RankPool] = []


def active_pool(world_size: int) -> RankPool | None:
    """The innermost active pool of `world_size` ranks, if any."""
    return next((p for p in reversed(_active) if p.world_size == world_size), None)


class RankPool:
    """`world_size` warm ranks on this machine; or, given a `node`, the ranks of that node only (a Ray
    cluster's node, launch/ray_ranks.py), which meet the other nodes' ranks at its rendezvous."""

    def __init__(self, world_size: int, log: str | Path | None = None, node: Node | None = None):
        assert node is None or node.world == world_size, "a node's ranks belong to a world of this size"
        self.world_size = world_size
        self.node = node
        self.log_path = Path(log) if log else None
        self._procs: list[subprocess.Popen] = []
        self._replies: list[int] = []

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.poll() is None for p in self._procs)

    def start(self) -> None:
        """Start the ranks now (they import and join their process group while other work goes on)."""
        if not self.alive:
            self.close()
            self._start()

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.node.ranks if self.node else tuple(range(self.world_size))

    def _start(self) -> None:
        node = self.node or Node.local(self.world_size)
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        for local in range(len(node.ranks)):
            read_fd, write_fd = os.pipe()
            env = {**node.env(local), "REPLAY_REPLY_FD": str(write_fd)}
            proc = subprocess.Popen([sys.executable, "-m", "replay.launch.worker", "--serve"], env=env,
                                    stdin=subprocess.PIPE, stdout=log, stderr=log, pass_fds=(write_fd,))
            os.close(write_fd)
            self._procs.append(proc)
            self._replies.append(read_fd)
        if not isinstance(log, int):   # a file, not DEVNULL
            log.close()

    def train(self, store: Location, lease: str, resume: bool = False) -> None:
        """Train the (already prepared) store on every rank, writing under `lease` (store/lease.py); raises
        ReplayError if any rank fails."""
        self.start()
        request = (json.dumps({"store": str(store), "resume": resume, "lease": lease,
                               "env": {**plugin_env(), **configuration()}})
                   + "\n").encode()
        try:
            for proc in self._procs:
                assert proc.stdin is not None, "started with stdin=PIPE"
                proc.stdin.write(request)
                proc.stdin.flush()
        except BrokenPipeError:
            self.close(kill=True)
            raise RankPoolError(f"a warm rank died before it took the replay of {store}"
                                f"{self._see_log()}") from None
        failures = self._collect()
        if failures:
            self.close(kill=True)
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

    def close(self, kill: bool = False) -> None:
        """Let the ranks leave (end of their input), or kill them (a failed replay: some may be stuck)."""
        for proc in self._procs:
            if kill and proc.poll() is None:
                proc.kill()
            try:
                if proc.stdin is not None:
                    proc.stdin.close()
            except OSError:
                pass
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for fd in self._replies:
            os.close(fd)
        self._procs, self._replies = [], []

    @contextlib.contextmanager
    def activated(self) -> Iterator[RankPool]:
        """Active for the block (see above), and still up after it: for a caller that keeps one pool
        across several blocks and closes it itself."""
        _active.append(self)
        try:
            yield self
        finally:
            _active.remove(self)

    def __enter__(self) -> RankPool:
        _active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _active.remove(self)
        self.close()
