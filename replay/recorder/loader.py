"""A torch `DataLoader`'s batches, recorded by their dataset indices and replayed: `loop.loader(dataloader)`.

The loader's sampler runs in the training process (with worker processes too: the workers only fetch), so
the indices are taken where the sampler yields them: the DataLoader's batch sampler is replaced by a tap
that notes every batch in a queue. The DataLoader prefetches (workers, `prefetch_factor`) but hands its
batches out in the order they were sampled, so the batch the script takes next is always the queue's
head: the step a batch belongs to is the step that takes it, never the one that sampled it.

A recording draws what the script draws without replay: the sampler (a RandomSampler's seed, a
WeightedRandomSampler's multinomial), the DataLoader's base seed for its workers and, without worker
processes, each fetch (an augmentation in `__getitem__`, a collate's masking) all draw from the global
generators, where and when they would. What makes the stream replayable from any checkpoint:
- **Each pass (epoch) keeps the generators' states it began with.** A checkpoint says where the stream
  stands (its pass, the position in it) and, for every pass that had begun before it, the Python, numpy and
  torch states its sampler began drawing from and torch's state as the DataLoader iterator serving it was
  made (its base seed's draw), and the states of the sampler's own generators (a `RandomSampler(generator=)`,
  the one Accelerate gives it) as it began. A replay or a resumed run makes that iterator and samples that pass again
  with those states swapped in, skips to the position (indices only: nothing is fetched), and puts the
  training's states back: the sampler's order carries on as recorded, and the training's generators are
  not drawn from for what the record drew before the checkpoint. With persistent workers the record made
  its iterator once; a replay's is made with its states too.
- **Without worker processes, a batch is fetched from the global generators** as it would be. A fetch
  inside a step follows the checkpoint's restored states, as in the record; a batch fetched before the
  checkpoint and trained after it (the script's prefetch, the Trainer's batches of its next step) is kept
  with the states its fetch began with, which a replay swaps in for its fetch and collate.
- **With worker processes, each batch is fetched under a seed of its place in the stream** (the loader's
  seed and the batch's number): a worker restarted in the middle of an epoch by a replay cannot draw what
  the record's worker drew after its earlier fetches. A recording whose worker fetches do draw random
  numbers (`__getitem__`, the collate) says so in one line when it sees the first: those draws differ from
  the script's without replay (docs/your-loop.md).
- **`set_epoch(n)`** is called on the sampler at the start of the loader's n-th pass, when it has one
  (DistributedSampler), as accelerate does: the loader, not the script, numbers the passes.

Accelerate's prepared loader (`DataLoaderShard`) iterates a DataLoader of its own: that one is tapped, and
the stream iterates Accelerate's, which synchronises its sampler's generator across the ranks, numbers the
epochs and tells `accelerator.accumulate` where the data ends. Its `DataLoaderDispatcher`
(`dispatch_batches=True`) samples and fetches on rank 0 only, the batches of every rank at once, and sends each
rank its slice: rank 0's DataLoader is tapped, each batch it fetches carries its samples' indices beside it
through the dispatcher's concatenation, broadcast and slicing (so each rank learns the indices of the slice it
trains on), and rank 0 tells the others where in its stream each dispatch stands, so that every rank's
checkpoint says the same place and rank 0 alone samples again from it (`_Dispatch`).

The loader is an endless stream: `iter(loop.loader(dl))` passes over the data again and again, starting
each pass itself; `len()` and every other attribute are the DataLoader's. A driver that iterates the
DataLoader itself, epoch by epoch (the Trainer: recorder/hf_trainer.py), uses the same tap through
`driven()`: each time it iterates the DataLoader a pass begins, and it calls `take()` for every batch it
trains on, in order.
"""

from __future__ import annotations

import hashlib
import itertools
import multiprocessing
import random
import sys
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

FORMAT = 2   # a checkpoint's loader state: 2, the global generators' states (1 drew from the loader's own)
WORKERS_DRAW = ("replay: this DataLoader's worker processes draw random numbers in a fetch (the dataset's "
                "__getitem__ or the collate); a recording fetches each batch under a seed of its place in the "
                "stream, so those draws differ from the script's without replay (docs/your-loop.md)")

Raw = tuple[Any, Any, torch.Tensor]   # Python's, numpy's and torch's CPU generator states, as they give them


@dataclass
class Pass:
    """A pass (epoch) over the sampler, begun."""

    number: int
    start: Raw                      # the global generators' states its sampler began drawing from
    iterator: torch.Tensor | None   # torch's state as the DataLoader iterator serving it was made (non-persistent)
    own: list[torch.Tensor]         # the states of the sampler's own generators as it began (`_own_generators`)


@dataclass
class Batch:
    """A batch the tap sampled: its indices and where it stands in the loader's stream. Through accelerate's
    dispatcher, the slice a rank trains on of one dispatch, standing where the dispatch's first batch does."""

    ids: np.ndarray
    number: int           # in the stream since the run began (the record's numbering, in a replay too)
    pass_: Pass
    position: int         # in its pass
    fetched_from: Raw | None = None             # no worker processes: the states its fetch began with
    scheduled: tuple[int, int] | None = None    # a replay: the recorded (step, micro-batch) it is
    parts: list[Batch] | None = None            # a dispatch on rank 0: the batches the tap sampled for it


@dataclass(frozen=True)
class _Dispatch:
    """accelerate's `DataLoaderDispatcher`: rank 0's DataLoader samples and fetches `per` batches a dispatch (the
    number of ranks; one, split between them, with `split_batches`), and every rank trains on its slice."""

    per: int
    rank: int
    world: int
    device: torch.device
    drop_last: bool   # an epoch's batches left over after its last whole dispatch are fetched and dropped


@dataclass
class Scheduled:
    """A replay's next batch, as the record has it."""

    step: int
    micro: int
    ids: np.ndarray
    skipped: bool   # of a step the replay skips: sampled past, never handed out
    digests: np.ndarray | None = None   # a stream's (recorder/stream.py): each sample's, as recorded


class RecordedLoader:
    """`loop.loader(dataloader)`; `take` is told of every batch the script takes (recorder/loop.py). `tell`:
    say so on stderr when a worker's fetch draws random numbers (a recording's rank 0). `follows()`: whether
    the global generators still draw as the record's did (a replay's skipped step or attention plan moves
    them): until then the sampler must yield the record's batches; after, a replay hands out the record's."""

    def __init__(self, dataloader: DataLoader, take: Callable[[Batch], None], seed: int, tell: bool = False,
                 follows: Callable[[], bool] = lambda: True):
        self._outer = dataloader   # what the stream iterates: the DataLoader, or accelerate's loader around one
        dataloader, self._dispatch = _tapped(dataloader)
        _check(dataloader)
        self._dl, self._take, self._follows = dataloader, take, follows
        self._batched = dataloader.batch_sampler is not None
        self._inner: Any = dataloader.batch_sampler if self._batched else dataloader.sampler
        self._workers = dataloader.num_workers > 0
        self._persistent = self._workers and dataloader.persistent_workers
        self._seed = seed
        self._queue: deque[Batch] = deque()
        self._pass_no, self._position, self._number = 0, 0, 0   # the next batch the tap samples
        self._pass: Pass | None = None        # pass `_pass_no`, once begun
        self._made: torch.Tensor | None = None   # torch's state as the DataLoader's last iterator was made
        self._skip_to = 0                     # a restored pass: positions sampled past before the first yield
        self._restored: deque[Pass] = deque()    # a restore: the passes begun before its checkpoint, in order
        self._restored_iterator: torch.Tensor | None = None   # ... and, persistent workers, the record's iterator
        self._fetched: dict[int, Raw] = {}    # ... and the states of the batches fetched before it, by number
        self._schedule: deque[Scheduled] = deque()   # a replay's recorded batches, in stream order
        self._it: Iterator[Any] | None = None
        self._driving = False     # the DataLoader is iterated by a driver (`driven`), not by this stream
        self._driver_skips = False   # ... which leaves a restored pass's batches before the checkpoint to the tap
        self._driven_passes = 0   # how many passes the driver began
        # a dispatcher: where the stream stands after the dispatches handed out (the same on every rank), the pass
        # they belong to on ranks other than 0, and the restored pass that rank's tap begins, if it is iterated
        self._next: tuple[int, int, int] | None = None
        self._dispatch_pass: Pass | None = None
        self._tap_restored: Pass | None = None
        self._exhausted = False   # the tap's pass has no more batches to sample
        drew = multiprocessing.Value("b", 0) if tell and self._workers else None   # shared with the workers
        tap = _Tap(self._inner, self._sample_pass)
        ids = self._dispatch is not None   # the indices travel with the batch through the dispatcher
        object.__setattr__(dataloader, "batch_sampler" if self._batched else "sampler", tap)   # past its guard:
        object.__setattr__(dataloader, "dataset", _SeededDataset(dataloader.dataset, drew, ids))  # never iterated
        dataloader.collate_fn = _SeededCollate(dataloader.collate_fn, drew)
        object.__setattr__(dataloader, "_get_iterator", self._make_iterator)   # what DataLoader.__iter__ calls

    # -- what the checkpoint keeps, and a restore from it --------------------------------------------

    def restore(self, state: dict[str, Any], schedule: list[Scheduled]) -> None:
        """Continue the stream from a checkpoint's `state` (`position`, below); a replay hands out the
        record's batches from there (`schedule`), checking that the sampler draws them too."""
        if self._it is not None:
            raise UsageError("loop.loader(...): the loader was iterated before the run's first step restored its "
                             "checkpoint; take its first batch inside `for step in loop.steps()` or just before it")
        if state.get("kind") == "stream":
            raise UsageError("loop.loader(...): the checkpoint this run starts from was recorded with a loader over an "
                             "IterableDataset (a stream), this one samples a map-style dataset: run the script as it "
                             "was recorded")
        if state.get("format") != FORMAT:
            raise UsageError("loop.loader(...): this checkpoint's data loader state was recorded by an earlier "
                             "version of replay (its sampler drew from the loader's own generators): replay or resume "
                             "it with that version")
        self._seed = int(state["seed"])
        self._pass_no, self._skip_to, self._number = int(state["pass"]), int(state["position"]), int(state["number"])
        self._restored = deque(Pass(self._pass_no + i, from_storable(p["start"]), _tensor(p["iterator"]),
                                    list(p.get("own", [])))   # a checkpoint from before `own`: none
                               for i, p in enumerate(state["passes"]))
        self._restored_iterator = _tensor(state["iterator"])
        self._fetched = {int(number): from_storable(s) for number, s in state["fetched"]}
        self._schedule = deque(schedule)
        self._next = (self._pass_no, self._skip_to, self._number) if self._dispatch is not None else None
        self._dispatch_pass = self._tap_restored = None

    def reposition(self, state: dict[str, Any], schedule: list[Scheduled]) -> None:
        """Start the stream again from a checkpoint's `state` (a script kept up between replays,
        recorder/serving.py): the DataLoader's iterator (its workers with it) and the batches sampled ahead of
        the script are let go, then `restore`."""
        self.close()
        self._queue.clear()
        self._pass = None
        self.restore(state, schedule)

    def position(self, untrained: list[Batch]) -> dict[str, Any]:
        """Where the stream stands for the step that begins: at the first of `untrained` (batches the script
        took ahead of it, a prefetch) or of the batches sampled and not yet taken, else at the next batch to
        sample; with what a replay needs to sample and fetch again what was sampled before it."""
        # sampled before the checkpoint, trained after, in stream order
        pending = [*(part for b in untrained for part in (b.parts or [b])), *self._queue]
        if pending and (self._dispatch is None or self._dispatch.rank == 0):
            at = pending[0]
            where = (at.pass_.number, at.position, at.number)
            passes = list({id(b.pass_): b.pass_ for b in pending}.values())
        elif self._dispatch is not None:   # a dispatcher: where every rank's stream stands, rank 0's
            first = untrained[0] if untrained else None
            where = (first.pass_.number, first.position, first.number) if first else self._next or (0, 0, 0)
            current = self._dispatch_pass if self._dispatch.rank else None
            begun: list[Pass | None] = list({id(b.pass_): b.pass_ for b in untrained}.values()) or [current]
            passes = [p for p in begun if p is not None and p.number >= where[0]]
        else:
            where = (self._pass_no, self._position, self._number)
            passes = [self._pass] if self._pass is not None else []
        return {"format": FORMAT, "seed": self._seed, "pass": where[0], "position": where[1], "number": where[2],
                "passes": [{"start": storable(p.start), "iterator": p.iterator, "own": p.own} for p in passes],
                "iterator": self._persistent_iterator(),
                "fetched": [[b.number, storable(b.fetched_from)] for b in pending if b.fetched_from is not None]}

    def _persistent_iterator(self) -> torch.Tensor | None:
        """Persistent workers: torch's state as the record made the DataLoader's one iterator, if it has."""
        if not self._persistent:
            return None
        if self._restored_iterator is not None:   # restored, not made again yet
            return self._restored_iterator
        return self._made if self._dl._iterator is not None else None

    # -- a driver's passes ----------------------------------------------------------------------------

    def driven(self, skips: bool = False) -> RecordedLoader:
        """Leave the passes to a driver that iterates the DataLoader itself, epoch by epoch: each iteration
        is the stream's next pass, the driver calls `take()` for every batch it trains on, in order, and runs
        the batches of a step the replay skips too (its update left out). A restored pass yields the batches
        before the checkpoint's position unnoted, for the driver to skip itself (accelerate's
        `skip_first_batches`), or with `skips` passes over them itself, telling the sampler its pass number
        first (Lightning, which neither skips nor numbers its sampler's epochs before it iterates a restored
        one). Called before the DataLoader is iterated."""
        assert self._it is None and not self._driving, "driven before any batch is sampled"
        if self._dispatch is not None:
            raise UsageError("a driver's DataLoader through accelerate's DataLoaderDispatcher cannot be recorded: "
                             "prepare it with DataLoaderConfiguration(dispatch_batches=False)")
        self._driving, self._driver_skips = True, skips
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
        self._driven_passes += 1
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
                self._it, self._pass = None, None
                self._pass_no, self._position, self._skip_to = self._pass_no + 1, 0, 0
                continue
            if self._dispatch is None:
                self._take(self._queue.popleft())
                return data
            data, taken = self._dispatched(data)
            if taken is not None:   # else a dispatch of a step the replay skips: drawn on every rank and dropped
                self._take(taken)
                return data

    def __len__(self) -> int:
        return len(self._outer)

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
        return getattr(self._outer, name)

    def _begin_pass(self) -> None:
        self._tell_epoch()
        if self._outer is not self._dl:   # accelerate's loader sets the epoch from its own count of passes
            self._outer.iteration = self._pass_no
        self._queue.clear()
        self._it = iter(self._outer)

    def _tell_epoch(self) -> None:
        """The sampler told the pass's number: a batch sampler's own `set_epoch` (or the sampler's it batches),
        or the plain sampler's."""
        told: Any = self._inner if hasattr(self._inner, "set_epoch") else getattr(self._inner, "sampler", None)
        if hasattr(told, "set_epoch"):
            told.set_epoch(self._pass_no)

    def _make_iterator(self) -> Any:
        """The DataLoader makes an iterator (drawing its workers' base seed from torch's generator): in a
        restore, one the record made before its checkpoint is made from the record's state, and the
        training's generator is not drawn from."""
        if self._persistent:
            recorded, self._restored_iterator = self._restored_iterator, None
        elif self._dispatch is not None and self._dispatch.rank:   # its tap may never be iterated: taken here
            self._tap_restored = self._restored.popleft() if self._restored else None
            recorded = self._tap_restored.iterator if self._tap_restored else None
        else:
            recorded = self._restored[0].iterator if self._restored else None
        if recorded is None or self._dl.generator is not None:
            self._made = torch.get_rng_state()
            return DataLoader._get_iterator(self._dl)
        self._made = recorded
        self._dl.generator = torch.Generator()
        self._dl.generator.set_state(recorded)
        try:
            return DataLoader._get_iterator(self._dl)
        finally:
            self._dl.generator = None

    def _sample_pass(self) -> Iterator[Any]:
        """The tap's pass: the inner sampler's batches, noted (and, in a replay, checked against the record's)."""
        if self._driving:
            self._driver_pass()
            if self._driver_skips:
                self._tell_epoch()
        if self._dispatch is not None and self._dispatch.rank and not self._persistent:   # taken as its iterator was
            restored, self._tap_restored = self._tap_restored, None                       # made (`_make_iterator`)
        else:
            restored = self._restored.popleft() if self._restored else None   # begun before the restored checkpoint
        self._exhausted = False
        own = _own_generators(self._inner)
        for generator, state in zip(own, restored.own if restored else [], strict=False):
            generator.set_state(state)   # the sampler draws on from where the record's began this pass
        with _swapped(restored.start if restored else None):
            begun = restored or Pass(self._pass_no, _raw(), None if self._persistent else self._made,
                                     [g.get_state() for g in own])
            inner = iter(self._inner)
            before = list(itertools.islice(inner, self._skip_to))   # a restored pass: on to the checkpoint's position
            sampled = next(inner, None) if len(before) == self._skip_to else None
        self._pass, self._position = begun, self._skip_to
        if self._driving and not self._driver_skips:   # unnoted: the driver skips them itself
            yield from before
        sampled = self._past_skipped(sampled, inner)
        while sampled is not None:
            # a dispatcher's slices are checked against the record where each rank takes its own (`_dispatched`)
            scheduled = self._schedule.popleft() if self._schedule and self._dispatch is None else None
            ids = _indices(sampled)
            if scheduled is not None and not np.array_equal(ids, scheduled.ids):
                if self._follows():
                    raise ReplayError(f"step {scheduled.step}, micro-batch {scheduled.micro}: the loader's sampler "
                                      f"yields samples {ids[:4].tolist()}..., the record has "
                                      f"{scheduled.ids[:4].tolist()}...: it is not the recorded sampler, or its "
                                      "randomness is not the global generators' (a generator of its own?)")
                ids = scheduled.ids   # drawn from generators the replay has moved: the record's batch instead
                sampled = ids.tolist() if self._batched else int(ids[0])
            fetched = None if self._workers else self._fetched.pop(self._number, None)
            batch = Batch(ids, self._number, begun, self._position, None if self._workers else fetched or _raw(),
                          None if scheduled is None else (scheduled.step, scheduled.micro))
            self._queue.append(batch)
            self._number += 1
            self._position += 1
            yield self._tagged(sampled, batch.number, fetched)
            sampled = self._past_skipped(next(inner, None), inner)
        self._exhausted = True

    def _dispatched(self, data: Any) -> tuple[Any, Batch | None]:
        """A dispatch the dispatcher handed this rank: its slice of the batch and the slice's indices, as
        rank 0's DataLoader put them beside it (`_SeededCollate`). Rank 0 takes the batches its tap sampled for
        the dispatch and tells every rank where the dispatch stands: its pass, its position and number (those
        of its first batch), how many batches it took, and whether the pass is over. In a replay, the slice is
        checked against the rank's recorded micro-batch; None for one of a step the replay skips."""
        assert self._dispatch is not None and isinstance(data, tuple) and len(data) == 2, "a dispatch carries its ids"
        data, ids = data
        ids = ids.detach().cpu().numpy().astype(np.int64).reshape(-1)
        parts: list[Batch] = []
        if self._dispatch.rank == 0:
            assert self._queue, "the dispatcher hands out batches the tap sampled"
            head = self._queue[0]
            while self._queue and len(parts) < self._dispatch.per and self._queue[0].pass_ is head.pass_:
                parts.append(self._queue.popleft())
            count = len(parts)
            left = sum(1 for b in self._queue if b.pass_ is head.pass_)
            if self._exhausted and self._dispatch.drop_last and 0 < left < self._dispatch.per:
                for _ in range(left):   # too few for a dispatch: the dispatcher fetched them and drops them
                    self._queue.popleft()
                count, left = count + left, 0
            told = [head.pass_.number, head.position, head.number, count, int(self._exhausted and not left)]
        else:
            told = [0] * 5
        if self._dispatch.world > 1:
            shared = torch.tensor(told, dtype=torch.int64, device=self._dispatch.device)
            torch.distributed.broadcast(shared, src=0)
            told = shared.tolist()
        pass_no, position, number, count, ended = told
        if self._dispatch.rank == 0:
            current = parts[0].pass_
        else:
            if self._dispatch_pass is None or self._dispatch_pass.number != pass_no:   # its own generators' states
                begun = self._pass if self._pass is not None and self._pass.number == pass_no else None
                self._dispatch_pass = begun or Pass(pass_no, _raw(), None if self._persistent else self._made, [])
            current = self._dispatch_pass
        self._next = (pass_no + 1, 0, number + count) if ended else (pass_no, position + count, number + count)
        scheduled = self._schedule.popleft() if self._schedule else None
        if scheduled is not None and scheduled.skipped:
            return data, None
        if scheduled is not None and not np.array_equal(ids, scheduled.ids.reshape(-1)):
            why = ("it is not the recorded sampler, or its randomness is not the global generators' (a generator of "
                   "its own?)" if self._follows() else
                   "the replay has moved the generators its sampler draws from, and a dispatcher cannot be given the "
                   "record's batches instead: seed the sampler (DataLoaderConfiguration(use_seedable_sampler=True)) "
                   "or prepare with dispatch_batches=False")
            raise ReplayError(f"step {scheduled.step}, micro-batch {scheduled.micro}: accelerate's dispatcher hands "
                              f"this rank samples {ids[:4].tolist()}..., the record has "
                              f"{scheduled.ids.reshape(-1)[:4].tolist()}...: {why}")
        return data, Batch(ids, number, current, position, None, None if scheduled is None else
                           (scheduled.step, scheduled.micro), parts or None)

    def _past_skipped(self, sampled: Any, inner: Iterator[Any]) -> Any:
        """`sampled`, the sampler's next batch (None at the pass's end), or in a replay the first after the
        batches of the steps it skips, sampled as the record took them (the stream's numbering and the sampler
        stay the record's; a skipped step's batches left at a pass's end are the next pass's first). A driver
        trains on them, without their update: to it they are handed out as any other."""
        while (sampled is not None and not self._driving and self._dispatch is None and self._schedule
               and self._schedule[0].skipped):
            self._schedule.popleft()
            self._fetched.pop(self._number, None)
            self._number += 1
            self._position += 1
            sampled = next(inner, None)
        return sampled

    def _tagged(self, sampled: Any, number: int, fetched: Raw | None) -> Any:
        """What the DataLoader fetches: the sampled indices, each with its batch's seed (worker processes) or
        the states its fetch began with in the record (a batch fetched before the restored checkpoint)."""
        if not self._workers and fetched is None:
            return sampled
        seed = fetch_seed(self._seed, number) if self._workers else None
        if not self._batched:
            return _Tagged(int(sampled), seed, fetched)
        return [_Tagged(int(i), seed, fetched) for i in sampled]


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


def _tapped(dataloader: Any) -> tuple[Any, _Dispatch | None]:
    """The DataLoader whose sampler is tapped: accelerate's prepared loaders (`DataLoaderShard`,
    `DataLoaderDispatcher`) iterate a DataLoader of their own (`base_dataloader`) and pass as one
    (`isinstance`); the stream iterates them, so their synchronised generator, device placement, end-of-data
    flag and, for a dispatcher, its sending of the slices are theirs."""
    base = getattr(dataloader, "base_dataloader", None)
    if base is None:
        return dataloader, None
    if type(dataloader).__name__ != "DataLoaderDispatcher":   # type(): its __class__ says DataLoader
        return base, None
    from accelerate.utils import slice_tensors  # lazy: accelerate is the script's, present when it prepared one

    state = dataloader.state
    if dataloader.slice_fn is not slice_tensors or getattr(dataloader, "submesh_tp", None) is not None:
        raise UsageError("loop.loader(...) records accelerate's DataLoaderDispatcher with its own slicing over "
                         "data-parallel ranks; a slice_fn_for_dispatch or a tensor-parallel mesh is not: prepare "
                         "the loader with DataLoaderConfiguration(dispatch_batches=False)")
    dispatch = _Dispatch(1 if dataloader.split_batches else state.num_processes, state.process_index,
                         state.num_processes, torch.device(state.device), bool(dataloader._drop_last))
    if base.batch_sampler is None:
        raise UsageError("loop.loader(...): accelerate's DataLoaderDispatcher over a DataLoader without automatic "
                         "batching (batch_size=None) cannot be recorded: give the DataLoader a batch size")
    uneven = _uneven_end(base.batch_sampler, dispatch)
    if not dataloader._drop_last and uneven is None:
        raise UsageError("loop.loader(...): accelerate's DataLoaderDispatcher over a batch sampler that does not say "
                         "its batch_size and its sampler's length cannot be recorded without drop_last=True (whether "
                         "an epoch's last dispatch is padded from its first depends on them)")
    if not dataloader._drop_last and uneven:
        raise UsageError("loop.loader(...): accelerate's DataLoaderDispatcher pads each epoch's last, uneven dispatch "
                         "with samples of the epoch's first, which a run resumed or replayed inside the epoch cannot "
                         "draw again: make the samples an epoch a multiple of the batch size times the number of "
                         "ranks, or set drop_last=True on the DataLoader")
    return base, dispatch


def _uneven_end(batch_sampler: Any, dispatch: _Dispatch) -> bool | None:
    """Whether an epoch's last dispatch holds a number of samples the ranks cannot share evenly (accelerate then
    pads it from the epoch's first dispatch); None where the batch sampler does not say how many it yields."""
    size, sampler = getattr(batch_sampler, "batch_size", None), getattr(batch_sampler, "sampler", None)
    if sampler is None or not isinstance(size, int):
        return None
    try:
        samples, batches = len(sampler), len(batch_sampler)
    except TypeError:
        return None
    if batches == 0:
        return False
    last_batch = size if getattr(batch_sampler, "drop_last", False) else samples - (batches - 1) * size
    in_last = (batches - dispatch.per * ((batches - 1) // dispatch.per) - 1) * size + last_batch
    return in_last % dispatch.world != 0


def _own_generators(sampler: Any) -> list[torch.Generator]:
    """The generators a sampler (or the sampler a batch sampler batches, down the chain) draws from instead of
    the global ones: a RandomSampler's `generator=`, accelerate's synchronised one. A pass keeps their states
    as it began, so that a replay samples it again as the record did."""
    found: list[torch.Generator] = []
    seen: set[int] = set()
    node = sampler
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        generator = getattr(node, "generator", None)
        if isinstance(generator, torch.Generator):
            found.append(generator)
        node = getattr(node, "batch_sampler", None) or getattr(node, "sampler", None)
    return found


def _check(dataloader: Any) -> None:
    if not isinstance(dataloader, DataLoader):
        raise UsageError(f"loop.loader(...) takes a torch.utils.data.DataLoader, not a {type(dataloader).__name__}")
    assert not isinstance(dataloader.dataset, IterableDataset), "a stream's loader is recorder/stream.py's"
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


def _tensor(value: Any) -> torch.Tensor | None:
    return None if value is None else torch.as_tensor(value).clone()


# -- the fetches: seeded by their place in the stream (workers), or from the record's states ---------------

def fetch_seed(seed: int, number: int) -> int:
    """The seed of the stream's batch `number`: its samples are fetched, then collated, drawing from it."""
    digest = hashlib.blake2b(f"{seed}:{number}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


@dataclass(frozen=True)
class _Tagged:
    index: int
    seed: int | None         # a worker's fetch: its generators seeded by it
    fetched_from: Raw | None  # a fetch in this process: the record's states, swapped in until after the collate


@dataclass
class _Fetched:
    """A batch's samples (or a sample that is the batch: no automatic batching) on their way to the collate."""

    data: Any
    saved: Raw | None = None    # the training's states, put back after the collate
    seeded: Raw | None = None   # a worker's states as seeded: did the fetch draw from them?
    ids: list[int] | None = None   # accelerate's dispatcher: the indices, collated beside the samples


def _raw() -> Raw:
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _set_raw(state: Raw) -> None:
    random.setstate(state[0])
    np.random.set_state(state[1])
    torch.set_rng_state(state[2])


def _same(a: Raw, b: Raw) -> bool:
    return (a[0] == b[0] and a[1][0] == b[1][0] and np.array_equal(a[1][1], b[1][1]) and a[1][2:] == b[1][2:]
            and torch.equal(a[2], b[2]))


class _SeededDataset(torch.utils.data.Dataset):
    """The user's dataset; a tagged batch is fetched (and then collated) from its seed or its recorded states.
    With `ids` (accelerate's dispatcher) every batch's indices go to the collate with its samples."""

    def __init__(self, dataset: Any, drew: Any = None, ids: bool = False):
        self.dataset, self.drew, self.ids = dataset, drew, ids

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: Any) -> Any:
        if not isinstance(item, _Tagged):   # as sampled, or a read of the script's own (a length grouping)
            return self.dataset[item]
        fetched = self._before(item)
        fetched.data = self.dataset[item.index]
        return fetched

    def __getitems__(self, items: list[Any]) -> Any:
        if not items or not isinstance(items[0], _Tagged):
            return _Fetched(self._fetch(items), ids=list(items)) if self.ids else self._fetch(items)
        fetched = self._before(items[0])
        fetched.data = self._fetch([item.index for item in items])
        fetched.ids = [item.index for item in items] if self.ids else None
        return fetched

    def _fetch(self, indices: list[Any]) -> Any:
        """As the DataLoader fetches: through the dataset's own `__getitems__` when it has one."""
        getitems = getattr(self.dataset, "__getitems__", None)
        return getitems(indices) if getitems else [self.dataset[i] for i in indices]

    def _before(self, item: _Tagged) -> _Fetched:
        if item.fetched_from is not None:
            fetched = _Fetched(None, saved=_raw())
            _set_raw(item.fetched_from)
            return fetched
        assert item.seed is not None, "a tagged batch has a seed or recorded states"
        random.seed(item.seed)
        np.random.seed(item.seed % 2**32)
        torch.default_generator.manual_seed(item.seed)   # the CPU's: torch.manual_seed would queue every CUDA device's
        return _Fetched(None, seeded=_raw() if self.drew is not None and not self.drew.value else None)

    def __getattr__(self, name: str) -> Any:   # unpickled in a worker: no attribute yet
        if name in ("dataset", "drew", "ids"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


class _SeededCollate:
    """The DataLoader's collate function; after a tagged batch, the training's generators are put back, and
    a worker's draws from its seed are told once (`drew`, shared by the workers)."""

    def __init__(self, collate: Callable[[Any], Any], drew: Any = None):
        self.collate, self.drew = collate, drew

    def __call__(self, samples: Any) -> Any:
        if not isinstance(samples, _Fetched):
            return self.collate(samples)
        try:
            collated = self.collate(samples.data)
            return collated if samples.ids is None else (collated, torch.tensor(samples.ids, dtype=torch.int64))
        finally:
            if samples.saved is not None:
                _set_raw(samples.saved)
            elif samples.seeded is not None and not _same(samples.seeded, _raw()):
                self._tell()

    def _tell(self) -> None:
        with self.drew.get_lock():
            first, self.drew.value = not self.drew.value, 1
        if first:
            print(WORKERS_DRAW, file=sys.stderr, flush=True)


# -- generator states --------------------------------------------------------------------------------

@contextmanager
def _swapped(states: Raw | None) -> Iterator[None]:
    """The global generators at `states` in the block, and as they were after it (nothing when None)."""
    if states is None:
        yield
        return
    saved = _raw()
    _set_raw(states)
    try:
        yield
    finally:
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
