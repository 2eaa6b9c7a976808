"""The loop replaying a window of its record (started by `replay run`, or a launcher's replay store): it
restores the parent's checkpoint at or before the window, hands out the recorded sample ids (checking that
the loader drew them too), applies the overrides from the window on (recorder/overrides.py), keeps what they
reached in the replay's manifest (rank 0), and ends after the window's last step."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from replay.errors import ReplayError
from replay.kernels.plan import AttentionPlan
from replay.kernels.reach import AttentionReach
from replay.recorder.modes import Start
from replay.recorder.overrides import ReplayOverrides, UnreachedOverride
from replay.recorder.recorder import RecorderConfig
from replay.store import RunStore
from replay.store.manifest import ReplaySpec
from replay.store.run_store import micro_batches


class Replaying:
    def __init__(self, start: Start, ranks: range, optimizer: torch.optim.Optimizer, scheduler: Any,
                 apply_attention: Callable[[AttentionPlan, AttentionReach], Any]):
        store = RunStore.open(start.store)
        spec = store.manifest.replay
        assert spec is not None, "a replay's store has its spec"
        self.window: ReplaySpec | None = spec
        self._spec = spec
        self.parent = RunStore.open(store.location.resolve(spec.parent))
        self.cfg = self.parent.manifest.config   # as recorded
        self.overrides = ReplayOverrides.read(spec, store.manifest.config, self.cfg)
        assert start.lease is not None, "a replay's store is prepared under its launcher's lease"
        self.lease = start.lease
        self.start_from = None if start.resume else (self.parent, spec.start_checkpoint)
        stop = spec.stop + 1
        self.recorder_config = RecorderConfig(total_steps=stop, checkpoint_every=spec.checkpoint_every or stop + 1,
                                              snapshot_every=0, snapshot_ring=self.cfg.snapshot_ring,
                                              spike=self.cfg.spike)
        # (step, rank, call, sample): what the parent trained on, from the start checkpoint's step to the end
        fields = self.parent.read_steps(["sample_ids", "sample_digest"], start=spec.start_checkpoint, stop=stop)
        self._ids, self._digests = fields["sample_ids"], fields["sample_digest"]   # digests: a stream's run only
        self._ranks, self._optimizer, self._scheduler = ranks, optimizer, scheduler
        self._apply_attention = apply_attention
        self._check_draws = True   # the loader draws the recorded ids, until a skipped step moves its randomness
        self._store = store
        prior = spec.reached   # a resumed replay's, so far
        self._reached: tuple[list[int], list[list[int]]] = (
            (list(prior.steps), list(prior.counts)) if prior else ([], []))
        self._refused: str | None = None

    @property
    def follows_record(self) -> bool:
        return self._check_draws

    def opened(self, store: RunStore) -> None:
        pass

    def started(self, step: int) -> None:
        if any(s < step for s in self.overrides.skip):   # resumed after a skip: its restored RNG states are
            self._check_draws = False                   # its own, no longer the record's

    def begin(self, step: int) -> bool:
        if step >= self.overrides.start and not self.overrides.active:
            self.overrides.begin(step, self._optimizer, self._scheduler, self._apply_attention)
            if self.overrides.plan is not None:   # its backends draw their dropout masks their own way: the
                self._check_draws = False          # global generators (a script's loader too) move on differently
        return self.overrides.skips(step)

    def recorded_ids(self, step: int) -> np.ndarray:
        return self._ids[step - self._spec.start_checkpoint]

    def recorded_batches(self, step: int) -> list[np.ndarray]:
        """The micro-batches this process trains of `step`: those of the recorded rank(s) it plays, in order."""
        return [b for rank in self._ranks for b in micro_batches(self.recorded_ids(step)[rank])]

    def recorded_digests(self, step: int) -> list[np.ndarray]:
        if not len(self._digests):
            raise ReplayError(f"{self.parent.location} was recorded without the digests of a stream's samples (its "
                              "loader was not over an IterableDataset): run the script as it was recorded")
        row = step - self._spec.start_checkpoint
        return [d for rank in self._ranks for d in micro_batches(self._ids[row][rank], self._digests[row][rank])]

    def sample(self, step: int, micro: int, drawn: np.ndarray, drawn_as: tuple[int, int] | None) -> np.ndarray:
        if step > self._spec.stop:   # drawn ahead for a step past the window: never trained
            return drawn
        batches = self.recorded_batches(step)
        if micro >= len(batches) or batches[micro].size != drawn.size:
            raise ReplayError(f"step {step}: the script draws micro-batch {micro} of {drawn.size} samples, the record "
                              f"has {len(batches)} of {[len(b) for b in batches]}: run the script and settings it was "
                              f"recorded with (`replay info {self.parent.location}` shows them)")
        if drawn_as is not None and self._check_draws and drawn_as[0] <= self._spec.stop:
            as_drawn = self.recorded_batches(drawn_as[0])
            expected = as_drawn[drawn_as[1]] if drawn_as[1] < len(as_drawn) else np.zeros(0, np.int64)
            if not np.array_equal(expected.reshape(-1), drawn.reshape(-1)):
                raise ReplayError(f"step {drawn_as[0]}, rank {self._ranks[0]}: the loader drew samples "
                                  f"{drawn.reshape(-1)[:4].tolist()}..., the record has "
                                  f"{expected[:4].tolist()}...: its randomness is not the recorded RNG states' (a "
                                  "generator of its own, or a changed script): draw from Python's, numpy's or "
                                  "torch's global generators, and run the recorded script")
        return batches[micro].reshape(drawn.shape)

    def skip(self, step: int) -> np.ndarray:
        self._check_draws = False   # the loader's randomness no longer follows the record's
        return self.recorded_ids(step)[self._ranks[0]]

    def check_step(self, autocast_used: bool) -> None:
        self.overrides.check_step(autocast_used)

    def counted(self) -> np.ndarray | None:
        return self.overrides.counted() if self.overrides.counters else None

    def reached(self, step: int, totals: np.ndarray | None) -> None:
        """The step's counts, summed over the ranks: kept (rank 0), then checked on every rank alike; an
        override that reached nothing is written into the replay's manifest before the replay stops."""
        if totals is None or not self.overrides.active:
            return
        steps, counts = self._reached
        while steps and steps[-1] >= step:   # a resumed replay runs the steps after its checkpoint again
            steps.pop()
            counts.pop()
        steps.append(step)
        counts.append(totals.tolist())
        try:
            self.overrides.check(step, totals)
        except UnreachedOverride as e:
            self._refused = str(e)
            self._keep_reached()
            raise

    def _keep_reached(self) -> None:
        if self._ranks[0] == 0 and self.overrides.counters:
            store = RunStore.open(self._store.location, mode="a")
            store.update_manifest(replay=dataclasses.replace(
                store.manifest.replay_spec, reached=self.overrides.reached(*self._reached, refused=self._refused)))

    def precision(self) -> str:
        return self.overrides.autocast_precision(self.cfg.precision)

    def in_window(self) -> bool:
        return self.overrides.active

    def close(self) -> None:
        try:
            if self.overrides.active and self._refused is None:
                self._keep_reached()
        finally:
            self.overrides.close()
