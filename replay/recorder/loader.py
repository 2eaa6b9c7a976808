"""A torch `DataLoader`'s batches, recorded by their dataset indices and replayed: `loop.loader(dataloader)`.

The loader's sampler runs in the training process (with worker processes too: the workers only fetch), so
the indices are taken where the sampler yields them: the DataLoader's batch sampler is replaced by a tap
that notes every batch in a queue. The DataLoader prefetches (workers, `prefetch_factor`) but hands its
batches out in the order they were sampled, so the batch the script takes next is always the queue's
head: the step a batch belongs to is the step that takes it, never the one that sampled it.

What makes a stream replayable from any checkpoint:
- **The sampler's randomness is the loader's own.** Every draw the sampler makes (RandomSampler's seed,
  WeightedRandomSampler's multinomial) runs with the loader's own RNG states swapped in for the global ones,
  so the training's RNG (dropout) does not depend on when the DataLoader samples ahead, and a checkpoint can
  say where the loader's stream stands: its pass (epoch), the position in it, and the loader's RNG states
  at the pass's start. A replay or a resumed run samples that pass again from those states and skips to
  the position (indices only: nothing is fetched), so the sampler's own order carries on as recorded.
- **Each batch is fetched under a seed of its place in the stream.** A dataset that draws random numbers
  in `__getitem__` (augmentation), or a collate that does (masking), draws them from a seed made of the
  loader's seed and the batch's number in the stream, in a worker or in this process alike; a worker
  restarted in the middle of an epoch (a replay) fetches the same bits.
- **`set_epoch(n)`** is called on the sampler at the start of the loader's n-th pass, when it has one
  (DistributedSampler), as accelerate does: the loader, not the script, numbers the passes.

The loader is an endless stream: `iter(loop.loader(dl))` passes over the data again and again, starting
each pass itself; `len()` and every other attribute are the DataLoader's. A driver that iterates the
DataLoader itself, epoch by epoch (the Trainer: recorder/hf_trainer.py), uses the same tap through
`driven()`: each time it iterates the DataLoader a pass begins, and it calls `take()` for every batch it
trains on, in order.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from replay.errors import ReplayError, UsageError
from replay.recorder.environment import cpu_rng_state, set_rng_state


@dataclass
class Batch:
    """A batch the tap sampled: its indices and where it stands in the loader's stream."""

    ids: np.ndarray
    number: int           # in the stream since the run began (the record's numbering, in a replay too)
    pass_no: int
    position: int         # in its pass
    pass_start: Raw               # the loader's RNG states at its pass's start
    scheduled: tuple[int, int] | None = None   # a replay: the recorded (step, micro-batch) it is


@dataclass
class Scheduled:
    """A replay's next batch, as the record has it."""

    step: int
    micro: int
    ids: np.ndarray
    skipped: bool   # of a step the replay skips: sampled past, never handed out


class RecordedLoader:
    """`loop.loader(dataloader)`; `take` is told of every batch the script takes (recorder/loop.py)."""

    def __init__(self, dataloader: DataLoader, take: Callable[[Batch], None], seed: int):
        _check(dataloader)
        self._dl, self._take = dataloader, take
        self._batched = dataloader.batch_sampler is not None
        self._inner: Any = dataloader.batch_sampler if self._batched else dataloader.sampler
        self._rng = _OwnRng(seed)
        self._seed = seed
        self._queue: deque[Batch] = deque()
        self._pass_no, self._position, self._number = 0, 0, 0   # the next batch the tap samples
        self._pass_start = self._rng.state   # the loader's RNG states at the start of pass `_pass_no`
        self._skip_to = 0                     # a restored pass: positions sampled past before the first yield
        self._schedule: deque[Scheduled] = deque()   # a replay's recorded batches, in stream order
        self._it: Iterator[Any] | None = None
        self._driving = False     # the DataLoader is iterated by a driver (`driven`), not by this stream
        self._driven_passes = 0   # how many passes the driver began
        tap = _Tap(self._inner, self._sample_pass)
        object.__setattr__(dataloader, "batch_sampler" if self._batched else "sampler", tap)   # past its guard:
        object.__setattr__(dataloader, "dataset", _SeededDataset(dataloader.dataset))        # never iterated yet
        dataloader.collate_fn = _SeededCollate(dataloader.collate_fn)

    # -- what the checkpoint keeps, and a restore from it --------------------------------------------

    def restore(self, state: dict[str, Any], schedule: list[Scheduled]) -> None:
        """Continue the stream from a checkpoint's `state` (`position`, below); a replay hands out the
        record's batches from there (`schedule`), checking that the sampler draws them too."""
        if self._it is not None:
            raise UsageError("loop.loader(...): the loader was iterated before the run's first step restored its "
                             "checkpoint; take its first batch inside `for step in loop.steps()` or just before it")
        self._seed = int(state["seed"])
        self._pass_no, self._skip_to, self._number = int(state["pass"]), int(state["position"]), int(state["number"])
        self._pass_start = self._rng.state = from_storable(state["pass_start"])
        self._schedule = deque(schedule)

    def position(self, first_unfinished: Batch | None) -> dict[str, Any]:
        """Where the stream stands for the step that begins: at `first_unfinished`, a batch the script took
        ahead of it (a prefetch), else at the next batch it takes."""
        at = first_unfinished or (self._queue[0] if self._queue else None)
        where = ((at.pass_no, at.position, at.number, at.pass_start) if at is not None
                 else (self._pass_no, self._position, self._number, self._pass_start))
        return {"seed": self._seed, "pass": where[0], "position": where[1], "number": where[2],
                "pass_start": storable(where[3])}

    # -- a driver's passes ----------------------------------------------------------------------------

    def driven(self) -> RecordedLoader:
        """Leave the passes to a driver that iterates the DataLoader itself, epoch by epoch: each iteration
        is the stream's next pass (the first, a restored one, yields the batches before the checkpoint's
        position unnoted, for the driver to skip itself: accelerate's `skip_first_batches`), the driver
        calls `take()` for every batch it trains on, in order, and runs the batches of a step the replay
        skips too (its update left out). Called before the DataLoader is iterated."""
        assert self._it is None and not self._driving, "driven before any batch is sampled"
        self._driving = True
        return self

    def take(self) -> None:
        """A driven loader: the driver trains on the stream's next batch."""
        assert self._driving, "take() is a driver's; the stream takes its own batches"
        if not self._queue:
            raise ReplayError("a batch is trained on that the training DataLoader's sampler did not yield: it is "
                              "not the DataLoader the loop taps")
        self._take(self._queue.popleft())

    def _driver_pass(self) -> None:
        """A driven loader: the driver iterates the DataLoader again, the stream's next pass."""
        if self._driven_passes:
            self._pass_no, self._skip_to = self._pass_no + 1, 0
            self._pass_start = self._rng.state
        self._driven_passes += 1
        self._position = 0
        self._queue.clear()

    # -- the stream ----------------------------------------------------------------------------------

    def __iter__(self) -> RecordedLoader:
        return self

    def __next__(self) -> Any:
        assert not self._driving, "a driven loader's DataLoader is iterated by its driver"
        while True:
            if self._it is None:
                self._begin_pass()
            assert self._it is not None, "a pass is under way"
            try:
                data = next(self._it)
            except StopIteration:
                self._it = None
                self._pass_no, self._position, self._skip_to = self._pass_no + 1, 0, 0
                self._pass_start = self._rng.state   # the sampler's draws of the pass are all made
                continue
            batch = self._queue.popleft()
            self._take(batch)
            return data

    def __len__(self) -> int:
        return len(self._dl)

    def close(self) -> None:
        """Let go of the DataLoader's iterator, whose workers then stop at once (the loop's close calls it).
        The tap's references make a cycle, and a DataLoader iterator left to the garbage collector waits 5 s
        for each worker before it kills them."""
        self._it = None
        if getattr(self._dl, "_iterator", None) is not None:   # persistent workers: the DataLoader keeps it too
            self._dl._iterator = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._dl, name)

    def _begin_pass(self) -> None:
        # the sampler told its epoch: a batch sampler's own (or the sampler it batches), or the plain sampler
        told: Any = self._inner if hasattr(self._inner, "set_epoch") else getattr(self._inner, "sampler", None)
        if hasattr(told, "set_epoch"):
            told.set_epoch(self._pass_no)
        self._position = 0
        self._queue.clear()
        with _training_rng_kept():   # the DataLoader draws its workers' base seed from the global generator
            self._it = iter(self._dl)

    def _sample_pass(self) -> Iterator[Any]:
        """The tap's pass: the inner sampler's batches, noted (and, in a replay, checked against the record's)."""
        if self._driving:
            self._driver_pass()
        pass_no, pass_start = self._pass_no, self._pass_start
        with self._rng.active():
            inner = iter(self._inner)
        with self._rng.active():   # a restored pass: on to the checkpoint's position
            before = list(itertools.islice(inner, self._skip_to))
        if self._driving:   # unnoted: the driver skips them itself
            yield from before
        if len(before) < self._skip_to:
            return
        self._position = self._skip_to
        while True:
            with self._rng.active():
                sampled = self._sample_past_skipped(inner)
            if sampled is None:
                return
            scheduled = self._schedule[0] if self._schedule else None
            ids = _indices(sampled)
            if scheduled is not None:
                self._schedule.popleft()
                if not np.array_equal(ids, scheduled.ids):
                    raise ReplayError(f"step {scheduled.step}, micro-batch {scheduled.micro}: the loader's sampler "
                                      f"yields samples {ids[:4].tolist()}..., the record has "
                                      f"{scheduled.ids[:4].tolist()}...: it is not the recorded sampler, or its "
                                      "randomness is not the loader's own (a generator of its own?)")
            batch = Batch(ids, self._number, pass_no, self._position, pass_start,
                          None if scheduled is None else (scheduled.step, scheduled.micro))
            self._queue.append(batch)
            self._number += 1
            self._position += 1
            yield _tagged(sampled, self._seed, batch.number, self._batched)

    def _sample_past_skipped(self, inner: Iterator[Any]) -> Any:
        """The sampler's next batch to hand out (None at the pass's end); in a replay, past the batches of the
        steps it skips, sampled as the record took them (the stream's numbering and the sampler stay the
        record's; a skipped step's batches left at a pass's end are the next pass's first). A driver trains
        on them, without their update: to it they are handed out as any other."""
        sampled = next(inner, None)
        while sampled is not None and not self._driving and self._schedule and self._schedule[0].skipped:
            self._schedule.popleft()
            self._number += 1
            self._position += 1
            sampled = next(inner, None)
        return sampled


class _Tap(torch.utils.data.Sampler):
    """What the DataLoader iterates instead of its (batch) sampler."""

    def __init__(self, inner: Any, sample_pass: Callable[[], Iterator[Any]]):
        self.inner, self._sample_pass = inner, sample_pass

    def __iter__(self) -> Iterator[Any]:
        return self._sample_pass()

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def _check(dataloader: Any) -> None:
    if not isinstance(dataloader, DataLoader):
        raise UsageError(f"loop.loader(...) takes a torch.utils.data.DataLoader, not a {type(dataloader).__name__}")
    if isinstance(dataloader.dataset, IterableDataset):
        raise UsageError("loop.loader(...) records a sampler's indices; an IterableDataset has no sampler: pass "
                         "each batch's sample ids through loop.sample_ids(...) instead")
    if not getattr(dataloader, "in_order", True):
        raise UsageError("loop.loader(...) needs the DataLoader's batches in the order they were sampled: "
                         "leave in_order=True")
    if getattr(dataloader, "_iterator", None) is not None:
        raise UsageError("loop.loader(...) takes a DataLoader that has not been iterated yet: wrap it first")


def _indices(sampled: Any) -> np.ndarray:
    ids = np.asarray(sampled.tolist() if isinstance(sampled, torch.Tensor) else sampled)
    if ids.dtype.kind not in "iu":
        raise UsageError(f"loop.loader(...) records integer dataset indices; the sampler yields {sampled!r}")
    return ids.astype(np.int64).reshape(-1)


# -- fetches seeded by their place in the stream ------------------------------------------------------

def fetch_seed(seed: int, number: int) -> int:
    """The seed of the stream's batch `number`: its samples are fetched, then collated, drawing from it."""
    digest = hashlib.blake2b(f"{seed}:{number}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


def _tagged(sampled: Any, seed: int, number: int, batched: bool) -> Any:
    batch_seed = fetch_seed(seed, number)
    if not batched:
        return _Tagged(int(sampled), batch_seed)
    return [_Tagged(int(i), batch_seed) for i in sampled]


@dataclass(frozen=True)
class _Tagged:
    index: int
    seed: int


Raw = tuple[Any, Any, torch.Tensor]   # Python's, numpy's and torch's CPU generator states, as they give them


def _raw() -> Raw:
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _set_raw(state: Raw) -> None:
    random.setstate(state[0])
    np.random.set_state(state[1])
    torch.set_rng_state(state[2])


def _seed(seed: int) -> Raw | None:
    """Seed the CPU generators for a batch's fetch; returns the states to put back after its collate (none in a
    worker process, whose generators serve the fetches alone)."""
    saved = _raw() if torch.utils.data.get_worker_info() is None else None
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)   # the CPU's: torch.manual_seed would queue every CUDA device's too
    return saved


class _Fetched(list):
    """A batch's samples on their way to the collate, with the generator states to put back after it."""

    saved: Raw | None = None


@dataclass
class _One:
    """A sample that is the batch (no automatic batching), on its way to the collate."""

    sample: Any
    saved: Raw | None


class _SeededDataset(torch.utils.data.Dataset):
    """The user's dataset, each batch fetched (and then collated) under its own seed."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: Any) -> Any:
        if not isinstance(item, _Tagged):   # a read of the script's own (a length grouping): as it was
            return self.dataset[item]
        saved = _seed(item.seed)
        return _One(self.dataset[item.index], saved)

    def __getitems__(self, items: list[Any]) -> list[Any]:
        if not items or not isinstance(items[0], _Tagged):
            return [self.dataset[i] for i in items]
        fetched = _Fetched()
        fetched.saved = _seed(items[0].seed)
        fetched.extend(self.dataset[item.index] for item in items)
        return fetched

    def __getattr__(self, name: str) -> Any:   # unpickled in a worker: no attribute yet
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


class _SeededCollate:
    """The DataLoader's collate function, drawing on from its batch's seed; then the generators are put back."""

    def __init__(self, collate: Callable[[Any], Any]):
        self.collate = collate

    def __call__(self, samples: Any) -> Any:
        if not isinstance(samples, (_Fetched, _One)):
            return self.collate(samples)
        try:
            return self.collate(samples.sample if isinstance(samples, _One) else list(samples))
        finally:
            if samples.saved is not None:
                _set_raw(samples.saved)


# -- the loader's own RNG --------------------------------------------------------------------------

class _OwnRng:
    """The loader's RNG states (Python's, numpy's, torch's CPU generator), swapped in while it samples."""

    def __init__(self, seed: int):
        saved = _raw()
        _seed(seed)
        self.state = _raw()
        _set_raw(saved)

    @contextmanager
    def active(self) -> Iterator[None]:
        saved = _raw()
        _set_raw(self.state)
        try:
            yield
        finally:
            self.state = _raw()
            _set_raw(saved)


def storable(state: Raw) -> dict[str, Any]:
    """Generator states as a checkpoint keeps them (recorder/environment.py)."""
    saved = _raw()
    _set_raw(state)
    try:
        return cpu_rng_state()
    finally:
        _set_raw(saved)


def from_storable(tree: dict[str, Any]) -> Raw:
    saved = _raw()
    set_rng_state(tree)
    try:
        return _raw()
    finally:
        _set_raw(saved)


@contextmanager
def _training_rng_kept() -> Iterator[None]:
    saved = torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_rng_state(saved)
