"""The recorder: the Python API a training loop calls on every rank, once per optimizer step.

    create_run_store(store_path, RunConfig(...), world_size=world)   # once, before the ranks start
                                                                # (resume_run_store(...) to resume)
    state = TorchTrainState(model, optimizer, scheduler)        # or DeepSpeedTrainState(engine)
    rec = Recorder(store_path, state, rank=rank, world_size=world, cfg=RecorderConfig(...))
    start = rec.start()                                         # restores the last checkpoint on resume
    for step in range(start, total_steps):
        ... forward / backward / optimizer step on the batch `ids` ...
        rec.record_step(step, sample_ids=ids, loss=local_loss, grad_norm=norm, lr=lr, tokens=n)
    rec.close()

Per step it gathers every rank's loss and sample ids (one small collective), feeds the spike detector,
and hands the step log to the coordinator (rank 0). Checkpoints: every `checkpoint_every` steps the
state is copied in memory on the training thread and written by a background thread; every
`snapshot_every` steps a copy goes into a ring of recent snapshots, which is written only if a spike
fires. Each rank writes its own shard; rank 0 commits once all shards are done.
"""

from __future__ import annotations

import functools
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from replay import faults
from replay.config import Cadence, Launcher, RunConfig, SpikeConfig
from replay.errors import ReplayError, UsageError
from replay.recorder.digest import StateDigest
from replay.recorder.environment import rng_state, set_rng_state
from replay.recorder.spikes import SpikeDetector, SpikeEvent
from replay.recorder.writer import BackgroundWriter
from replay.store import RunStore
from replay.store.lease import Lease, require
from replay.store.lifecycle import create_run, no_data, resume_run
from replay.store.location import Location, Where
from replay.store.run_store import DigestInfo
from replay.store.tensors import Packed, pack, same_bits, whole_buffer


class TrainState(Protocol):
    """What a checkpoint holds besides RNG states (see replay.recorder.state): {"replicated", "local"}."""

    def state_dict(self, rank: int) -> dict[str, Any]: ...
    def load_state_dict(self, replicated: dict[str, Any], local: dict[str, Any],
                        read_local: Callable[[int], dict[str, Any]]) -> None: ...


@dataclass
class RecorderConfig:
    total_steps: int
    checkpoint_every: int = 20
    snapshot_every: int = 0
    snapshot_ring: int = 3
    flush_every: int = 50          # step-log rows buffered before a write (always flushed at checkpoints)
    spike: SpikeConfig = field(default_factory=SpikeConfig)

    def __post_init__(self) -> None:
        for key in ("total_steps", "flush_every"):
            if getattr(self, key) < 1:
                raise UsageError(f"RecorderConfig.{key}={getattr(self, key)!r}: a whole number >= 1")
        self.cadence.check("RecorderConfig.")

    @property
    def cadence(self) -> Cadence:
        return Cadence(self.checkpoint_every, self.snapshot_every, self.snapshot_ring)


def create_run_store(path: Where, config: RunConfig, world_size: int = 1, description: str = "") -> RunStore:
    """A new run store for a training loop of your own. `config` describes the run as far as it can
    (model shape, steps, precision); `description` says what the data was (it is not embedded)."""
    location = Location.parse(path)
    with Lease.acquire(location, "create_run_store"):
        return create_run(location, config, world_size=world_size, launcher=Launcher.CUSTOM,
                          data=no_data(description or "a custom training loop"))


def resume_run_store(path: Where, world_size: int = 1) -> int | None:
    """Before the ranks of your own loop restart (once): cut the run back to its last committed checkpoint
    and return its step; None when nothing was committed (`Recorder.start` then begins at step 0)."""
    with Lease.acquire(path, "resume_run_store"):
        return resume_run(RunStore.open(path, mode="a"), world_size)


class Recorder:
    """`lease`: the spec of the lease this rank writes under (store/lease.py), when the command that
    started it holds one; without it, rank 0 takes the store's lease itself (released by `close`).
    `played`: how many recorded ranks this process plays, from `rank` on (`replay run --ranks`: a replay
    on fewer processes, train/fewer_ranks.py); its steps' losses and ids are theirs, its checkpoints hold
    a shard for each."""

    def __init__(self, store_path: Where, state: TrainState, cfg: RecorderConfig, rank: int = 0,
                 world_size: int = 1, resume: bool = False, start_from: tuple[RunStore, int] | None = None,
                 lease: str | None = None, extra: Callable[[], dict[str, Any]] | None = None, played: int = 1):
        assert world_size % played == 0 and (played == 1 or cfg.snapshot_every == 0), "a replay's, taking no snapshots"
        location = Location.parse(store_path)
        self._lease = None
        guard: Callable[[], None] | None
        if lease is not None:
            require(lease)
            guard = functools.partial(require, lease)
        elif rank == 0:
            self._lease = Lease.acquire(location, f"a Python Recorder ({Path(sys.argv[0]).name or 'python'})")
            guard = self._lease.check
        else:
            guard = None
        self.store = RunStore.open(location, mode="a")
        self.state, self.cfg = state, cfg
        self.rank, self.world = rank, world_size
        self.ranks = range(rank, rank + played)
        self.processes = world_size // played
        self.coordinator = rank == 0
        self.resume = resume
        self.start_from = start_from
        self.detector = SpikeDetector(cfg.spike)
        self.digest = StateDigest(state, rank)
        self._digests_noted = False
        self.counted: np.ndarray | None = None   # the last step's counts, summed over the processes
        self.ring: deque[tuple[int, Packed]] = deque(maxlen=max(1, cfg.snapshot_ring))
        self.cadence = cfg.cadence   # built once, read after every step
        self._spare: deque[np.ndarray] = deque()   # buffers of written checkpoints, reused by the next capture
        self.writer = BackgroundWriter(f"replay-writer-rank{rank}", guard)
        self._rows: list[dict[str, Any]] = []
        self._rows_start = 0
        self._last_time = time.perf_counter()
        self.spikes: list[SpikeEvent] = []
        self.last_loss = float("nan")
        self._extra = extra   # what the caller keeps in every checkpoint besides the state (recorder/loop.py)
        self._ids_shape: tuple[int, int] | None = None   # (micro, sample) of every step's ids, padded
        self._shard: tuple[int, dict[str, Any]] | None = None   # the checkpoint `start` restores, read ahead
        self._restores: list[tuple[RunStore, int] | None] = []   # which one that is, once known

    # -- start and stop ----------------------------------------------------------------------------

    def start(self) -> int:
        """The step to train next: 0 for a new run (checkpoint 0 is written); on resume, the last committed
        checkpoint's step, with the state restored from it; for a replay, the step of the parent
        checkpoint it starts from (`start_from`), with the state restored from the parent."""
        source = self._source()
        if source is None:   # a new run, or one stopped before its first commit: from the start
            self._checkpoint(0, "regular")
            self._last_time = time.perf_counter()
            return 0
        self._restore(*source)
        return source[1]

    def _source(self) -> tuple[RunStore, int] | None:
        """The checkpoint `start` restores: a replay's parent's, a resumed run's last committed, or none (read
        once: the checkpoints committed later are the run's own)."""
        if not self._restores:
            committed = self.store.checkpoints() if self.resume and self.start_from is None else []
            self._restores = [self.start_from or ((self.store, committed[-1].step) if committed else None)]
        return self._restores[0]

    def first_step(self) -> int:
        """The step `start` returns: that of the checkpoint it restores, or 0."""
        source = self._source()
        return 0 if source is None else source[1]

    def restored_extra(self) -> dict[str, Any] | None:
        """What the caller kept (`extra`) in the checkpoint `start` will restore; None for a new run. Read
        ahead of `start`, for a caller that needs it before (a prefetched batch, a data loader's position)."""
        source = self._source()
        if source is None:
            return None
        return dict(self._read_own(*source).get("loop") or {})

    def _read_own(self, store: RunStore, step: int) -> dict[str, Any]:
        if self._shard is None or self._shard[0] != step:
            self._shard = (step, store.read_shard(step, self.rank))
        return self._shard[1]

    def reload(self) -> None:
        """Put the state and RNG states of the checkpoint `start` restores back, without starting from it (a
        served replay's steps that are trained and undone, recorder/loop.py)."""
        source = self._source()
        assert source is not None, "a replay restores a checkpoint"
        self._load(*source)

    def _restore(self, store: RunStore, step: int) -> None:
        self._load(store, step)
        recorded = store.read_steps(["sample_ids"], start=step, stop=step + 1)["sample_ids"]
        if recorded.ndim == 4:   # the run's shape of a step's ids, for the steps from here on
            self._ids_shape = (int(recorded.shape[2]), int(recorded.shape[3]))
        losses = store.read_steps(["loss"])["loss"][: step - store.first_step]
        for i, loss in enumerate(losses):   # the detector's memory, as it was at that step
            self.detector.update(store.first_step + i, float(loss))
        self._rows_start = step
        self._last_time = time.perf_counter()

    def _load(self, store: RunStore, step: int) -> None:
        own = self._read_own(store, step)
        self._shard = None
        # of other ranks' shards, the branch needed only: a sharded model's pieces are each rank's own to read
        replicated = (own["state"]["replicated"] if self.rank == 0
                      else store.read_subtree(step, 0, ("state", "replicated")))
        self.state.load_state_dict(replicated, own["state"]["local"],
                                   lambda r: store.read_subtree(step, r, ("state", "local")))
        set_rng_state(own["rng"])
        for rank in self.ranks[1:]:   # one process, one set of generators: the ranks it plays must agree
            if not same_bits(store.read_subtree(step, rank, ("rng",)), own["rng"]):
                raise ReplayError(f"recorded ranks {self.ranks[0]} and {rank} hold different RNG states at step "
                                  f"{step}: one process cannot play both; replay on the recorded ranks")

    def flush(self) -> None:
        """Wait until everything recorded so far is on disk (checkpoints committed)."""
        if self.coordinator:
            self._flush_rows()
        self.writer.flush()

    def close(self) -> None:
        """Flush everything and wait for the disk; the last step's checkpoint is written by the cadence."""
        try:
            if self.coordinator:
                self._flush_rows()
            self.writer.close()
        finally:
            if self._lease is not None:
                self._lease.release()

    # -- per step ----------------------------------------------------------------------------------

    def record_step(self, step: int, *, sample_ids: np.ndarray | list[np.ndarray], loss: float | list[float],
                    grad_norm: float,
                    lr: float, tokens: int, numerics: dict[str, np.ndarray] | None = None,
                    counts: np.ndarray | None = None, finish: bool = True,
                    sample_digests: list[np.ndarray] | None = None) -> SpikeEvent | None:
        """Record optimizer step `step` (its state is now the one *after* the step: its digest is taken here,
        recorder/digest.py). `sample_ids`: this rank's
        micro-batches' ids, (micro, sample) or a list of micro-batches of any sizes; every rank must train on
        as many micro-batches and samples as every other (checked: one line on every rank otherwise). Stored
        padded with -1 to the run's first step's shape (a process playing several ranks: theirs in order, and
        a loss for each). `numerics`: this
        rank's per-layer attention numerics (replay.kernels.numerics), stored from rank 0 when given.
        `counts`: what a replay's overrides replaced in the step on this process (recorder/overrides.py),
        summed over the processes into `counted`, which every process reads after the call.
        `finish=False` leaves the step's checkpoint cadence (and a spike's snapshots) to `finish_step`,
        for a caller whose state may still change after it records the step's metrics. `sample_digests`: a
        stream's (recorder/stream.py), each sample's CRC-32C, shaped as `sample_ids`, on every rank or on none."""
        now = time.perf_counter()
        step_time, self._last_time = now - self._last_time, now
        digest = self.digest()
        micro = [np.asarray(a, dtype=np.int64).reshape(-1) for a in sample_ids]
        sample_ids, width = self._agree(step, micro, len(digest))
        if sample_digests is not None:   # laid out as the ids (uint32 < 2**53: exact in the ids' gather)
            digests_laid = _laid_out([np.asarray(d, dtype=np.int64).reshape(-1) for d in sample_digests],
                                     sample_ids.shape[0], sample_ids.shape[1:], 0)
            sample_ids = np.concatenate([sample_ids, digests_laid], axis=-1)
        rank_loss, all_ids, all_tokens, digests, self.counted = self._gather(loss, sample_ids, tokens,
                                                                             _padded(digest, width), counts)
        by_digest: dict[str, np.ndarray] = {}
        if sample_digests is not None:
            half = all_ids.shape[-1] // 2
            all_ids, by_digest = all_ids[..., :half], {"sample_digest": all_ids[..., half:].astype(np.uint32)}
        global_loss = self.last_loss = float(rank_loss[0] if len(rank_loss) == 1 else np.mean(rank_loss))
        if self.coordinator and step == 0 and self.world > 1 and self.start_from is None:
            _warn_if_unsplit(all_ids, by_digest.get("sample_digest"))
        if self.coordinator:
            self._rows.append({"loss": global_loss, "rank_loss": rank_loss, "grad_norm": float(grad_norm),
                               "lr": float(lr), "tokens": int(all_tokens), "step_time": step_time,
                               "sample_ids": all_ids, "state_digest": digests, **by_digest, **(numerics or {})})
        event = self.detector.update(step, global_loss)   # every rank sees the same gathered losses
        if finish:
            self.finish_step(step, event)
        return event

    def finish_step(self, step: int, event: SpikeEvent | None) -> None:
        """The end of a recorded step: its checkpoint (on the cadence) of the state as it is now, and, after a
        spike, the snapshots before it."""
        self._after_step(step)
        if event is not None:
            self.spikes.append(event)
            self._flush_ring()
            if self.coordinator:
                self._flush_rows()
                spike = event.to_dict()
                self.writer.submit(lambda: self.store.add_spike(spike))
        if self.coordinator and len(self._rows) >= self.cfg.flush_every:
            self._flush_rows()

    def record_skipped(self, step: int, *, sample_ids: np.ndarray, lr: float,
                       numerics: dict[str, np.ndarray] | None = None, finish: bool = True,
                       streamed: bool = False) -> None:
        """A step whose batch was deliberately not trained on (a replay's --skip): a row of NaN metrics
        with sample ids -1 and no state digests (zeros; verification leaves skipped steps out), unseen by the
        spike detector; checkpoint cadence as usual (`finish` as for `record_step`). `streamed`: the run's data is
        a stream, whose sample digests the row has too (zeros)."""
        if self.coordinator:
            self._last_time = time.perf_counter()
            self._rows.append({"loss": np.nan, "rank_loss": np.full(self.world, np.nan), "grad_norm": np.nan,
                               "lr": float(lr), "tokens": 0, "step_time": 0.0,
                               "sample_ids": np.full((self.world, *self._skipped_shape(sample_ids)), -1),
                               "state_digest": np.zeros((self.world, self._digest_width()), dtype=np.uint32),
                               **({"sample_digest": np.zeros((self.world, *self._skipped_shape(sample_ids)),
                                                             dtype=np.uint32)} if streamed else {}),
                               **(numerics or {})})
        if finish:
            self.finish_step(step, None)

    def _after_step(self, step: int) -> None:
        """Checkpoint cadence: the state after `step` is checkpoint `step + 1`."""
        nxt = step + 1
        due = self.cadence.due(nxt, self.cfg.total_steps)
        if due == "checkpoint":
            self._checkpoint(nxt, "regular")
            self._clear_ring()
        elif due == "snapshot":
            if len(self.ring) == self.ring.maxlen:
                self._give_back(self.ring.popleft()[1])
            self.ring.append((nxt, self._capture()))

    def _clear_ring(self) -> None:
        while self.ring:
            self._give_back(self.ring.popleft()[1])

    def _agree(self, step: int, micro: list[np.ndarray], digests: int) -> tuple[np.ndarray, int]:
        """This rank's micro-batches as the run's (micro, sample) array, padded with -1, once every rank has
        seen that all ranks drew as many (one small collective before the ids' own: never a mismatch); and the
        most state digests any rank took (`digests`: this rank's), to which every rank pads its own."""
        known = self._ids_shape
        if self.processes == 1 and len(self.ranks) == 1 and known is not None and _fills(micro, known):
            return np.concatenate(micro).reshape(1, *known), digests   # nothing to pad or agree on
        per = len(micro) // len(self.ranks)
        groups = [micro[i * per:(i + 1) * per] for i in range(len(self.ranks))]
        mine = [(len(g), sum(len(a) for a in g), max((len(a) for a in g), default=0), digests) for g in groups]
        if self.processes > 1:
            counts = [torch.zeros((len(mine), 4), dtype=torch.int64) for _ in range(self.processes)]
            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
            out = [c.to(device) for c in counts]
            dist.all_gather(out, torch.tensor(mine, dtype=torch.int64, device=device))
            rows = [(int(row[0]), int(row[1]), int(row[2]), int(row[3])) for c in out for row in c.cpu()]
        else:
            rows = mine
        if len({r[:2] for r in rows}) > 1:
            drew = ", ".join(f"rank {r}: {n} micro-batch(es), {k} samples" for r, (n, k, _, _) in enumerate(rows))
            raise UsageError(f"step {step}: the ranks drew different training batches ({drew}); every rank must "
                             "pass as many training micro-batches through the loop, and evaluation draws must run "
                             "in model.eval(), under torch.no_grad() or in `with loop.evaluating():`")
        shape = (max(r[0] for r in rows), max(r[2] for r in rows))
        if self._ids_shape is None:
            self._ids_shape = shape
        elif shape[0] > self._ids_shape[0] or shape[1] > self._ids_shape[1]:
            raise UsageError(f"step {step} trains on {shape[0]} micro-batch(es) of up to {shape[1]} samples; the run's "
                             f"first step trained on {self._ids_shape[0]} of {self._ids_shape[1]}: later steps may "
                             "train on fewer or smaller micro-batches, never more or larger")
        return _laid_out(micro, len(groups), self._ids_shape, -1), max(r[3] for r in rows)

    def _skipped_shape(self, sample_ids: np.ndarray) -> tuple[int, ...]:
        return self._ids_shape if self._ids_shape is not None else np.shape(sample_ids)

    def _gather(self, loss: float | list[float], ids: np.ndarray, tokens: int, digest: np.ndarray,
                counts: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, int, np.ndarray, np.ndarray | None]:
        """Every recorded rank's loss, (micro, sample) ids and state digests, in rank order, the tokens of all,
        and `counts` summed over the processes; `ids`: this process's ranks', `digest`: its state's (each rank
        it plays holds that state). One all_gather of float64 (ids < 2**53, a stream's 32-bit sample digests beside
        them, 32-bit state digests, counts: exact)."""
        losses = np.asarray(loss, dtype=np.float64).reshape(len(self.ranks))
        played = len(self.ranks)
        counts = None if counts is None else np.asarray(counts, dtype=np.int64)
        if self.processes == 1:
            digests = digest[None] if played == 1 else np.tile(digest, (played, 1))
            return losses, ids, tokens, digests, counts
        parts = [np.asarray([tokens], np.float64), losses, ids.reshape(-1).astype(np.float64),
                 digest.astype(np.float64), (counts if counts is not None else np.zeros(0)).astype(np.float64)]
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        mine = torch.from_numpy(np.concatenate(parts)).to(device)
        out = [torch.empty_like(mine) for _ in range(self.processes)]
        dist.all_gather(out, mine)
        rows = torch.stack(out).cpu().numpy()
        edges = np.cumsum([0, *(len(p) for p in parts)])
        tokens_, losses_, ids_, digests, counts_ = (rows[:, a:b] for a, b in zip(edges[:-1], edges[1:], strict=True))
        return (losses_.reshape(-1).copy(), ids_.astype(np.int64).reshape(self.world, *ids.shape[1:]),
                int(tokens_.sum()), np.repeat(digests.astype(np.uint32), played, axis=0),
                None if counts is None else counts_.sum(axis=0).astype(np.int64))

    def _digest_width(self) -> int:
        return len(self.digest.names) if self.digest.names is not None else len(self.digest())

    # -- checkpoints -------------------------------------------------------------------------------

    def _capture(self, rank: int | None = None) -> Packed:
        """This rank's state, copied into one CPU buffer now, so later optimizer steps cannot reach it. The
        buffer is one a finished write gave back, when there is one: its memory is mapped already, and
        the copy (the time the training thread is blocked) runs at memory speed."""
        spare = self._spare.pop() if self._spare else None
        tree = {"state": self.state.state_dict(self.rank if rank is None else rank), "rng": rng_state()}
        if self._extra is not None:
            tree["loop"] = self._extra()
        return pack(tree, into=spare)

    def _give_back(self, packed: Packed) -> None:
        self._spare.append(whole_buffer(packed.buffer))

    def _checkpoint(self, step: int, kind: str, packed: Packed | None = None) -> None:
        shards = [(self.rank, packed)] if packed is not None else [(rank, self._capture(rank)) for rank in self.ranks]
        if self.coordinator:
            self._flush_rows()
        for rank, shard in shards:
            self._write_shard(step, rank, shard)
        if self.coordinator:
            world, store = self.world, self.store
            self.writer.submit(lambda: store.commit_checkpoint(step, kind, world))

    def _write_shard(self, step: int, rank: int, packed: Packed) -> None:
        store = self.store

        def half_way(i: int, n: int) -> None:
            if i == max(1, n // 2):
                faults.hit("shard-half", step, rank)
                faults.hit("shard-pause", step, rank)

        def write() -> None:
            store.write_shard(step, rank, packed, after_chunk=half_way)
            self._give_back(packed)
            faults.hit("before-commit", step, rank)

        self.writer.submit(write)

    def _note_digests(self) -> None:
        """Name the step log's digest columns before its first rows with digests are written (rank 0)."""
        if self._digests_noted or self.digest.names is None:
            return
        self._digests_noted = True
        info = DigestInfo(kind=str(self.digest.kind), names=self.digest.names, since=self._rows_start)
        store = self.store

        def note() -> None:
            if store.digests is None:   # a resumed run has them named already
                store.note_digests(info)

        self.writer.submit(note)

    def _flush_ring(self) -> None:
        for step, packed in self.ring:
            self._checkpoint(step, "snapshot", packed)
        self.ring.clear()

    def _flush_rows(self) -> None:
        if not self._rows:
            return
        self._note_digests()
        rows, start = self._rows, self._rows_start
        self._rows, self._rows_start = [], start + len(rows)
        records = {k: np.stack([np.asarray(r[k]) for r in rows]) for k in rows[0]}
        self.writer.submit(lambda: self.store.append_steps(start, records))


def _warn_if_unsplit(ids: np.ndarray, digests: np.ndarray | None = None) -> None:
    """One line on stderr when every rank trained on the same samples at step 0: the data is not split. A
    stream's samples are told apart by their digests (their ids are places in each rank's own stream)."""
    same = digests if digests is not None else ids
    if all(np.array_equal(same[0], same[r]) for r in range(1, len(same))):
        shown = ", ".join(map(str, ids[0][ids[0] >= 0][:4].tolist()))
        what = f"samples at step 0 ({shown}, ...)" if digests is None else "samples at step 0 (their digests)"
        print(f"warning: all {len(ids)} ranks trained on the same {what}: the data is not split across the "
              "ranks, so each repeats the others' work (give the DataLoader a DistributedSampler, or let "
              "accelerate's prepare or Lightning wrap the loader before loop.loader(...); a stream shards itself "
              "by rank)", file=sys.stderr, flush=True)


def _laid_out(micro: list[np.ndarray], played: int, shape: tuple[int, ...], fill: int) -> np.ndarray:
    """The micro-batches of the `played` ranks (theirs in order, as many each) as (rank, micro, sample), padded
    with `fill`."""
    out = np.full((played, *shape), fill, dtype=np.int64)
    per = len(micro) // played
    for rank in range(played):
        for i, a in enumerate(micro[rank * per:(rank + 1) * per]):
            out[rank, i, :len(a)] = a
    return out


def _fills(micro: list[np.ndarray], shape: tuple[int, int]) -> bool:
    """The micro-batches fill a (micro, sample) shape exactly."""
    return len(micro) == shape[0] and all(len(a) == shape[1] for a in micro)


def _padded(digest: np.ndarray, width: int) -> np.ndarray:
    return digest if len(digest) == width else np.concatenate([digest, np.zeros(width - len(digest), np.uint32)])


