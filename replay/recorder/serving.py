"""A script's rank serving one replay after another: the script is imported, built and joined once, and its
`Loop` restores each next replay's checkpoint in place (recorder/loop.py).

The launcher (launch/script.py `ScriptServer`, which starts every script's rank) gives each rank `SERVE_ENV`
naming two pipes: it writes a line per job on the first (the next replay's store, lease and resume flag; end
of file: no more), the rank answers on the second when the job is done, or why it cannot serve it warm (its
state after a step from the restored checkpoint is not the record's: the script keeps state of its own that
the Loop does not restore), after which the launcher starts the script afresh; a rank that fails with
replay's own error says it there too, for the launcher's one line. Both sides speak through this module.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from types import TracebackType

from replay.errors import ReplayError

SERVE_ENV = "REPLAY_LOOP_SERVE"   # "<fd to read jobs from>,<fd to answer on>"
Hook = Callable[[type[BaseException], BaseException, TracebackType | None], object]


@dataclass(frozen=True)
class ServedJob:
    """The next replay a serving rank runs: its store (prepared), the lease it writes under, and whether it
    continues from the store's last committed checkpoint."""

    store: str
    lease: str
    resume: bool


@dataclass(frozen=True)
class Answer:
    """A serving rank's answer to a job: done, or refused warm with the reason (`refused`); or, just before it
    exits, the error it fails with, in one line (`failed`), for the launcher's own line."""

    refused: str | None = None
    failed: str | None = None

    def line(self) -> bytes:
        return (json.dumps(asdict(self)) + "\n").encode()

    @classmethod
    def parse(cls, line: bytes) -> Answer:
        return cls(**json.loads(line))


def job_line(job: ServedJob) -> bytes:
    return (json.dumps(asdict(job)) + "\n").encode()


class Serving:
    """The rank's side: answers the job it ran, then waits for the next."""

    def __init__(self, jobs: int, answers: int):
        self._jobs = os.fdopen(jobs, "rb", buffering=0)
        self._answers = answers

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Serving | None:
        value = environ.get(SERVE_ENV)
        if not value:
            return None
        jobs, answers = (int(fd) for fd in value.split(","))
        return cls(jobs, answers)

    def failing(self, hook: Hook, rank: int) -> Hook:
        """An excepthook that says replay's own error to the launcher (`Answer.failed`), which says it in its one
        line, then calls `hook`; the rank itself says it only where the launcher could not be told."""
        def excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> object:
            if isinstance(value, ReplayError):
                with contextlib.suppress(OSError):   # the launcher gone: the rank ends with it anyway
                    os.write(self._answers, Answer(failed=f"rank {rank}: {value}").line())
                    value.said_by_launcher = True
            return hook(kind, value, tb)
        return excepthook

    def answer(self, refused: str | None = None) -> ServedJob | None:
        """Say the last job is done (or `refused` warm), then wait for the next; None: there is none."""
        os.write(self._answers, Answer(refused).line())
        line = self._jobs.readline()
        if not line:
            return None
        return ServedJob(**json.loads(line))
