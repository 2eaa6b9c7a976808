"""A stream's batches, recorded by their place in the stream and a digest of every sample: `loop.loader(dl)`
where `dl` iterates an `IterableDataset` (a stream read from files or a server, sharded over ranks and worker
processes by the dataset itself) and has no sampler to tap, so there are no dataset indices to record.

- **What a step records.** Each sample's id is its place in this rank's stream (0, 1, 2, ... over every
  batch the stream yielded, across passes), and the step log keeps each sample's CRC-32C beside it
  (`sample_digest`: the bytes of every tensor, array, number or string it holds, in the batch's order).
- **What a checkpoint keeps.** Where the stream stands for the step that begins (its pass, the batches into
  the pass, the place and number of the next batch) and how to get there again: a loader with
  `state_dict()`/`load_state_dict()` (torchdata's `StatefulDataLoader`, torchtitan's loader, a DataLoader of
  your own that has them) gives its state as it was before that batch was drawn; any other loader, or one
  given with `state=False` (a state that does not bring the stream back: below), is iterated again from the
  start of that pass (its iterator made from torch's generator state the record made
  it from, so its workers get the same seeds) and the batches before the position are drawn and dropped.
- **What a replay proves.** Every batch the stream yields in a replay is compared, sample by sample, with the
  record's digests for its step: a stream that yields anything else (another file, another shard, a
  tokenizer that changed) stops the replay in one line naming the step and the sample. The batches of a step
  the replay skips are drawn and dropped.

A loader's state is trusted only as far as the digests confirm it: a state_dict that does not bring the stream
back to where it was (Hugging Face `datasets` 4.7: a streamed JSON file's `.map(...)` keeps, in its state, the
Arrow shard's read position, past the whole file, so a restored stream is empty) stops the replay at its first
sample, and `loop.loader(dl, state=False)` draws the pass again instead.

Batches the script draws ahead of the step that trains them (a prefetch) belong to the step that takes them,
as with a sampler's loader (recorder/loader.py): the checkpoint's position is the first one not yet trained.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from replay.errors import ReplayError, UsageError
from replay.recorder.loader import Scheduled
from replay.store.integrity import crc32c, crc32c_spans

FORMAT = 1   # a checkpoint's stream position


@dataclass
class StreamBatch:
    """A batch the stream yielded: its samples' places and digests, and the position before it."""

    ids: np.ndarray                  # places in this rank's stream
    digests: np.ndarray              # uint32, one per sample
    before: dict[str, Any]           # the stream's position just before it was drawn
    scheduled: tuple[int, int] | None = None   # a replay: the recorded (step, micro-batch) it is


class StreamLoader:
    """`loop.loader(dataloader)` over an IterableDataset; `take` is told of every batch the script takes."""

    def __init__(self, dataloader: Any, take: Callable[[StreamBatch], None],
                 follows: Callable[[], bool] = lambda: True, state: bool = True):
        self._dl, self._take, self._follows = dataloader, take, follows
        self._base = getattr(dataloader, "base_dataloader", dataloader)   # accelerate's prepared loaders wrap one
        self._stateful = state and _stateful(dataloader)   # state=False: drawn again to the position instead
        self._state_base: Any = None   # the class whose state_dict() is storable, where the loader's is not
        if not self._stateful and getattr(self._base, "persistent_workers", False):
            raise UsageError("loop.loader(...): a stream through a DataLoader with persistent_workers=True cannot be "
                             "continued inside a later pass (its workers' generators carry on from pass to pass): use "
                             "persistent_workers=False, or a loader with state_dict() (torchdata's StatefulDataLoader)")
        self._pass_no, self._position, self._place, self._number = 0, 0, 0, 0
        self._made: torch.Tensor | None = None   # the generator state this pass's DataLoader iterator was made from
        self._skip_to = 0                        # a restored pass (no state_dict): batches to draw and drop
        self._made_from: torch.Tensor | None = None   # ... and the state its iterator is to be made from
        self._schedule: deque[Scheduled] = deque()
        self._it: Iterator[Any] | None = None
        if not self._stateful and isinstance(self._base, DataLoader):   # past its guard: never iterated yet
            object.__setattr__(self._base, "_get_iterator", self._make_iterator)

    # -- what the checkpoint keeps, and a restore from it --------------------------------------------

    def position(self, untrained: list[StreamBatch]) -> dict[str, Any]:
        """Where the stream stands for the step that begins: before the first of `untrained` (batches the
        script took ahead of it), else before the next batch."""
        return untrained[0].before if untrained else self._where()

    def _where(self) -> dict[str, Any]:
        return {"format": FORMAT, "kind": "stream", "pass": self._pass_no, "position": self._position,
                "place": self._place, "number": self._number,
                "loader": self._loader_state() if self._stateful else None,
                "loader_class": self._state_base.__name__ if self._state_base is not None else None,
                # a position inside a pass: the state the pass's iterator was made from, for a replay to make it so
                # (at a pass's start the replay makes it as the record did, from the generator as it then is)
                "iterator": self._made if not self._stateful and self._position > 0 else None}

    def _loader_state(self) -> Any:
        """The loader's state_dict() now, copied (a state may hold the live buffers a later batch changes: a
        packing dataset's tokens), as the store can keep it (no pickle). A loader that pickles the state of the
        StatefulDataLoader it is (torchtitan's, per data-parallel rank) gives that state unpickled instead."""
        if self._state_base is not None:
            return copy.deepcopy(self._state_base.state_dict(self._dl))
        state = self._dl.state_dict()
        if storable_tree(state):
            return copy.deepcopy(state)
        base: Any = next((c for c in type(self._dl).__mro__[1:] if c.__name__ == "StatefulDataLoader"), None)
        if base is None or not storable_tree(state := base.state_dict(self._dl)):
            raise UsageError(f"loop.loader(...): the loader's state_dict() holds what the store keeps only as pickle "
                             f"({_unstorable(state)}); replay stores no pickle: give loop.loader a loader whose state "
                             "is numbers, strings, lists, dicts and tensors")
        self._state_base = base
        return copy.deepcopy(state)

    def restore(self, state: dict[str, Any], schedule: list[Scheduled]) -> None:
        """Continue the stream from a checkpoint's `state`; a replay checks each batch against `schedule`."""
        if self._it is not None:
            raise UsageError("loop.loader(...): the stream was iterated before the run's first step restored its "
                             "checkpoint; take its first batch inside `for step in loop.steps()` or just before it")
        if state.get("kind") != "stream" or state.get("format") != FORMAT:
            raise UsageError("loop.loader(...): the checkpoint this run starts from was recorded with a loader over a "
                             "map-style dataset (its sampler's indices), this one iterates an IterableDataset: run "
                             "the script as it was recorded")
        if (state["loader"] is not None) != self._stateful:
            has = "has" if self._stateful else "has no"
            raise UsageError(f"loop.loader(...): this loader {has} state_dict()/load_state_dict(), the recorded one "
                             f"{'had not' if self._stateful else 'had'}: run the script as it was recorded")
        self._pass_no, self._place, self._number = int(state["pass"]), int(state["place"]), int(state["number"])
        if self._stateful:
            if state.get("loader_class"):   # the state of the StatefulDataLoader it is (`_loader_state`)
                self._state_base = next(c for c in type(self._dl).__mro__ if c.__name__ == state["loader_class"])
            (self._state_base or type(self._dl)).load_state_dict(self._dl, state["loader"])
            self._position, self._skip_to, self._made_from = int(state["position"]), 0, None
        else:
            self._position, self._skip_to = 0, int(state["position"])
            self._made_from = None if state["iterator"] is None else torch.as_tensor(state["iterator"]).clone()
        self._schedule = deque(schedule)

    def reposition(self, state: dict[str, Any], schedule: list[Scheduled]) -> None:
        """Start the stream again from a checkpoint's `state` (a script kept up between replays)."""
        self.close()
        self.restore(state, schedule)

    # -- the stream ----------------------------------------------------------------------------------

    def __iter__(self) -> StreamLoader:
        return self

    def __next__(self) -> Any:
        while True:
            if self._it is None:
                self._begin_pass()
            before = self._where()
            assert self._it is not None, "a pass is under way"
            try:
                data = next(self._it)
            except StopIteration:
                self._it = None
                self._pass_no, self._position = self._pass_no + 1, 0
                continue
            batch = self._batch(data, before)
            if batch is None:   # of a step the replay skips: drawn and dropped
                continue
            self._take(batch)
            return data

    def _batch(self, data: Any, before: dict[str, Any]) -> StreamBatch | None:
        digests = sample_digests(data)
        if not len(digests):
            raise UsageError("loop.loader(...): the stream yielded a batch of no samples; replay records each sample")
        ids = np.arange(self._place, self._place + len(digests), dtype=np.int64)
        self._number, self._position, self._place = self._number + 1, self._position + 1, self._place + len(ids)
        scheduled = self._schedule.popleft() if self._schedule else None
        if scheduled is None:
            return StreamBatch(ids, digests, before)
        if scheduled.digests is not None:
            _check(scheduled, ids, digests, self._follows())
        if scheduled.skipped:
            return None
        return StreamBatch(ids, digests, before, (scheduled.step, scheduled.micro))

    def _begin_pass(self) -> None:
        set_epoch = getattr(getattr(self._dl, "dataset", None), "set_epoch", None)
        if callable(set_epoch):   # an HF datasets stream reshuffles its shards by it
            set_epoch(self._pass_no)
        if hasattr(self._dl, "iteration"):   # accelerate's loader sets the epoch from its own count of passes
            self._dl.iteration = self._pass_no
        self._it = iter(self._dl)
        for _ in range(self._skip_to):   # a restored pass of a loader without state: on to the position
            if next(self._it, None) is None:
                raise ReplayError(f"the stream's pass {self._pass_no} ended after fewer batches than the record "
                                  f"drew before its checkpoint ({self._skip_to}): it is not the recorded stream")
            self._position += 1
        self._skip_to = 0

    def __len__(self) -> int:
        return len(self._dl)

    def _make_iterator(self) -> Any:
        """The DataLoader makes an iterator, drawing its workers' base seed from its own generator or torch's: in a
        restored pass, from the state the record drew it from (the training's generator is not drawn from)."""
        base = self._base
        own = base.generator
        recorded, self._made_from = self._made_from, None
        if recorded is None:
            self._made = own.get_state() if own is not None else torch.get_rng_state()
            return type(base)._get_iterator(base)
        self._made = recorded
        if own is not None:
            own.set_state(recorded)
            return type(base)._get_iterator(base)
        base.generator = torch.Generator()
        base.generator.set_state(recorded)
        try:
            return type(base)._get_iterator(base)
        finally:
            base.generator = None

    def close(self) -> None:
        """Let go of the loader's iterator, whose workers then stop."""
        self._it = None
        if getattr(self._base, "_iterator", None) is not None:   # persistent workers: the DataLoader keeps it too
            self._base._iterator = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._dl, name)


def _stateful(dataloader: Any) -> bool:
    """Whether the loader says where it stands: `state_dict()` and `load_state_dict()`, which accelerate's prepared
    loaders have always and serve only when prepared with `use_stateful_dataloader=True` (over torchdata's)."""
    if getattr(dataloader, "use_stateful_dataloader", True) is False:
        return False
    return callable(getattr(dataloader, "state_dict", None)) and callable(getattr(dataloader, "load_state_dict", None))


def storable_tree(tree: Any) -> bool:
    return _unstorable(tree) is None


def _unstorable(tree: Any) -> str | None:
    """The first value of a state tree the store cannot keep without pickle, named by its type; None if none."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            if not isinstance(key, str):
                return f"a {type(key).__name__} key"
            if (found := _unstorable(value)) is not None:
                return found
        return None
    if isinstance(tree, (list, tuple)):
        return next((found for value in tree if (found := _unstorable(value)) is not None), None)
    if tree is None or isinstance(tree, (bool, int, float, str, torch.Tensor, np.ndarray)):
        return None
    return type(tree).__name__


def _check(scheduled: Scheduled, ids: np.ndarray, digests: np.ndarray, follows: bool) -> None:
    """A replay's batch against the record's: the same places, the same samples. `follows`: the replay's
    generators still draw as the record's (no skipped step or attention plan has moved them yet)."""
    assert scheduled.digests is not None
    where = f"step {scheduled.step}, micro-batch {scheduled.micro}"
    if len(ids) != len(scheduled.ids) or not np.array_equal(ids, scheduled.ids):
        raise ReplayError(f"{where}: the stream yields samples {ids[0]}..{ids[-1]} of its stream, the record has "
                          f"{scheduled.ids[0]}..{scheduled.ids[-1]}: it does not draw as the record did (another "
                          "batch size, a batch of its own taken from it?)")
    differ = np.flatnonzero(digests != scheduled.digests)
    if len(differ):
        i = int(differ[0])
        why = ("the data, its order or its preprocessing changed since the recording, or the stream is not "
               "deterministic") if follows else (
               "this replay moved torch's generator (a skipped step, an attention plan) before a new pass began, and "
               "the stream's workers draw from the seeds it gives them: such a stream replays bit for bit only "
               "without overrides past a pass's end")
        raise ReplayError(f"{where}: the stream's sample {ids[i]} is not the recorded one (its digest "
                          f"{int(digests[i]):08x}, the record's {int(scheduled.digests[i]):08x}; {len(differ)} of the "
                          f"batch's {len(ids)} samples differ): {why}")


# -- each sample's digest ------------------------------------------------------------------------------

def sample_digests(batch: Any) -> np.ndarray:
    """The CRC-32C of each sample of a batch: a tensor or array (its first dimension the samples), or a dict,
    list or tuple of them (and of per-sample lists of numbers or strings), all of one length; a sample's digest
    covers every field, in the batch's order."""
    fields = [_field_digests(leaf) for leaf in _leaves(batch)]
    if not fields:
        raise UsageError(f"loop.loader(...): a batch of the stream holds no tensor, array or list of samples "
                         f"({type(batch).__name__}): replay digests each sample of it")
    sizes = {len(f) for f in fields}
    if len(sizes) > 1:
        raise UsageError(f"loop.loader(...): the fields of a batch hold different numbers of samples "
                         f"({sorted(sizes)}): replay digests each sample, the first dimension of every field")
    if len(fields) == 1:
        return fields[0]
    rows = np.ascontiguousarray(np.stack(fields, axis=1))   # (sample, field)
    return _row_crcs(rows.view(np.uint8).reshape(len(rows), -1))


def _leaves(tree: Any) -> Iterator[Any]:
    if isinstance(tree, dict):
        for key in tree:
            yield from _leaves(tree[key])
    elif isinstance(tree, (list, tuple)) and tree and isinstance(tree[0], (torch.Tensor, np.ndarray, dict)):
        for value in tree:
            yield from _leaves(value)
    elif tree is not None:
        yield tree


def _field_digests(leaf: Any) -> np.ndarray:
    if isinstance(leaf, torch.Tensor):
        leaf = leaf.detach().cpu().contiguous()
        if leaf.dim() == 0:
            raise UsageError("loop.loader(...): a batch of the stream holds a scalar tensor; replay digests each "
                             "sample, along the first dimension of every field")
        rows = leaf.reshape(len(leaf), -1).view(torch.uint8) if leaf.numel() else leaf.reshape(len(leaf), 0)
        return _row_crcs(rows.numpy() if rows.dtype == torch.uint8 else rows.view(torch.uint8).numpy())
    if isinstance(leaf, np.ndarray):
        if leaf.ndim == 0 or leaf.dtype == object:
            raise UsageError("loop.loader(...): a batch of the stream holds a numpy array that is a scalar or of "
                             "Python objects; replay digests each sample's bytes")
        return _row_crcs(np.ascontiguousarray(leaf).reshape(len(leaf), -1).view(np.uint8))
    if isinstance(leaf, (list, tuple)):
        return np.array([crc32c(_encoded(value)) for value in leaf], dtype=np.uint32)
    raise UsageError(f"loop.loader(...): a batch of the stream holds a {type(leaf).__name__}; replay digests "
                     "tensors, arrays and lists of numbers or strings")


def _encoded(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytes):
        return value
    if isinstance(value, bool | int):
        return int(value).to_bytes(16, "little", signed=True)
    if isinstance(value, float):
        return np.float64(value).tobytes()
    if isinstance(value, (list, tuple)):
        return b"\x00".join(_encoded(v) for v in value)
    raise UsageError(f"loop.loader(...): a sample of the stream holds a {type(value).__name__} ({value!r}); replay "
                     "digests tensors, arrays, numbers and strings")


def _row_crcs(rows: np.ndarray) -> np.ndarray:
    """The CRC-32C of each row of a C-contiguous uint8 matrix, in one call."""
    out = np.zeros(len(rows), dtype=np.uint32)
    if rows.shape[1] == 0:
        return out
    spans = np.stack([rows.ctypes.data + rows.strides[0] * np.arange(len(rows), dtype=np.int64),
                      np.full(len(rows), rows.shape[1], dtype=np.int64)], axis=1)
    crc32c_spans(np.ascontiguousarray(spans), out)
    return out
