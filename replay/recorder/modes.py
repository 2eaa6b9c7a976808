"""How a `Loop` was started, decided once (`decide`), and what its two modes answer to it (`Mode`).

Three ways in: the script run as it is (a recording whose rank 0 prepares the store), started again by
`replay run` (a replay: REPLAY_LOOP_STORE names its store, REPLAY_LOOP_LEASE its lease), or by a launcher
that prepared the store itself and passes its lease (`Loop(lease=...)`: the built-in trainer, recording or
replaying as the store's kind says). The modes are recorder/recording.py and recorder/replaying.py.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, NoReturn, Protocol

import numpy as np

from replay.config import RunConfig
from replay.errors import ReplayError, UsageError
from replay.recorder import command as cmd
from replay.recorder.overrides import ReplayOverrides
from replay.recorder.recorder import RecorderConfig
from replay.store import RunStore
from replay.store.holder import ENV as LEASE_ENV
from replay.store.location import Location, Where
from replay.store.manifest import ReplaySpec


@dataclass(frozen=True)
class Start:
    """How this process's loop was started."""

    mode: Literal["record", "replay"]
    store: Location
    lease: str | None     # the spec of the lease it writes under; None: rank 0 takes one and prepares the store
    resume: bool
    by_replay_run: bool   # started again by `replay run`: the loop's own errors end the process in one line


def decide(store: Where, lease: str | None, resume: bool,
           environ: Mapping[str, str] = os.environ) -> Start:
    """The one place the mode is decided: from `replay run`'s environment, the `lease=` argument, or neither."""
    if environ.get(cmd.STORE_ENV):
        return Start("replay", Location.parse(environ[cmd.STORE_ENV]), environ[LEASE_ENV],
                     environ.get(cmd.RESUME_ENV) == "1", by_replay_run=True)
    if lease is None:
        return Start("record", Location.parse(store), None, resume, by_replay_run=False)
    kind = RunStore.open(store).kind
    return Start("replay" if kind == "replay" else "record", Location.parse(store), lease, resume, by_replay_run=False)


class Mode(Protocol):
    """What differs between recording and replaying, asked by the `Loop` at fixed points of its steps."""

    cfg: RunConfig                              # the run's config, as recorded
    lease: str                                  # the spec of the lease every rank writes under
    start_from: tuple[RunStore, int] | None     # the checkpoint the first step restores (a replay's parent's)
    recorder_config: RecorderConfig             # steps, checkpoint cadence, snapshots
    window: ReplaySpec | None                   # a replay's window, overrides and skips
    overrides: ReplayOverrides                  # a replay's overrides as applied (a recording's: none, never begun)

    @property
    def follows_record(self) -> bool:
        """The global generators draw as the record's did: no step the replay skipped, no attention plan of its
        (whose backends draw their own way) has moved them yet."""

    def opened(self, store: RunStore) -> None:
        """Rank 0, once the recorder has the store open for writing."""

    def started(self, step: int) -> None:
        """The first step to train is `step` (restored from a checkpoint, or 0)."""

    def begin(self, step: int) -> bool:
        """`step` begins; returns whether it is one the replay skips."""

    def sample(self, step: int, micro: int, drawn: np.ndarray,
               drawn_as: tuple[int, int] | None) -> np.ndarray | None:
        """The ids micro-batch `micro` of `step` trains on, when not the `drawn` ones (a replay's recorded ids);
        `drawn_as`: the record's micro-batch drawn from the same RNG states, which the drawn ids must equal."""

    def skip(self, step: int) -> np.ndarray:
        """`step` is skipped: this rank's recorded ids of it."""

    def check_step(self, autocast_used: bool) -> None:
        """Refuse, at `log`, a step the mode cannot record as it ran."""

    def counted(self) -> np.ndarray | None:
        """A replay: what its overrides replaced in the step that ends, on this process (None: nothing to count)."""

    def reached(self, step: int, totals: np.ndarray | None) -> None:
        """A replay: the step's counts summed over the ranks, kept, and an override that reached nothing refused."""

    def precision(self) -> str:
        """What `loop.autocast()` gives now."""

    def in_window(self) -> bool:
        """Whether the current step is in a replay's window (its overrides apply)."""

    def recorded_ids(self, step: int) -> np.ndarray:
        """A replay: the ids the record has for `step` (rank, micro-batch, sample), padded with -1."""

    def recorded_batches(self, step: int) -> list[np.ndarray]:
        """A replay: this rank's micro-batches of `step` in the record."""

    def recorded_digests(self, step: int) -> list[np.ndarray]:
        """A replay of a stream's run: the digests of this rank's micro-batches' samples of `step` in the record."""

    def close(self) -> None:
        """Take back what the mode put into the model, the optimizer or the store's lease."""


Hook = Callable[[type[BaseException], BaseException, TracebackType | None], object]


def one_line_errors(hook: Hook, rank: int) -> Hook:
    """In a replay (and in a recording the Trainer's callback refuses as it starts, recorder/hf_trainer.py),
    replay's own errors end the process with one line and their exit code, as a rank of the built-in trainer
    does (a traceback with REPLAY_DEBUG=1); any other error is the script's, shown whole."""
    def excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> object:
        if not isinstance(value, ReplayError) or os.environ.get("REPLAY_DEBUG"):
            return hook(kind, value, tb)
        if not value.said_by_launcher:
            print(f"rank {rank}: {value}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(value.exit_code)
    return excepthook


def refuse(message: str, rank: int) -> NoReturn:
    """A UsageError that, not caught by the script, ends its process in one line (exit code 2), as a replay's
    errors do, though no loop has started (a framework's callback refusing a run as it starts)."""
    sys.excepthook = one_line_errors(sys.excepthook, rank)
    raise UsageError(message)
