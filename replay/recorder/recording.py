"""The loop recording: the script run as it is (rank 0 creates the store, or rewinds it to resume), or a
launcher's recording into the store it prepared. Its answers to the loop are the plain ones: the sample ids
as drawn, the run's precision, no step skipped."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from replay.config import Launcher, RunConfig
from replay.errors import ReplayError, UsageError
from replay.recorder import command as cmd
from replay.recorder.modes import Start
from replay.recorder.overrides import ReplayOverrides
from replay.recorder.recorder import RecorderConfig
from replay.recorder.run_options import RunOptions
from replay.recorder.state import origin_of
from replay.store import RunStore
from replay.store.lease import Lease
from replay.store.lifecycle import continue_command, create_run, no_data, resume_run
from replay.store.location import Location
from replay.store.manifest import PROBE_SAMPLES, PROBE_TOKENS, ReplaySpec
from replay.store.object_lease import ObjectLease
from replay.store.run_store import check_empty


class Recording:
    window: ReplaySpec | None = None
    start_from: tuple[RunStore, int] | None = None
    follows_record = True

    def __init__(self, start: Start, model: torch.nn.Module, options: RunOptions, rank: int, world: int):
        """`model`: unwrapped (not DDP's)."""
        self.model, self.rank, self.world = model, rank, world
        self.overrides = ReplayOverrides(start=-1)   # none, never begun
        self._own_lease: Lease | ObjectLease | None = None   # taken by rank 0 of the script's own recording
        if start.lease is None:
            self.lease = self._prepare(start.store, options.config(model, world), start.resume, options)
        else:
            self.lease = start.lease
        self.cfg = RunStore.open(start.store).manifest.config   # as stored
        self.recorder_config = RecorderConfig(total_steps=self.cfg.steps, **dataclasses.asdict(self.cfg.cadence),
                                              spike=self.cfg.spike)
        self._probe: Any = None

    # -- the store, before any step ----------------------------------------------------------------

    def _prepare(self, path: Location, cfg: RunConfig, resume: bool, options: RunOptions) -> str:
        """Rank 0 creates (or, resuming, rewinds) the store under its lease; every rank gets the lease's
        spec, or rank 0's error, after a barrier."""
        message, spec = None, None
        if self.rank == 0:
            try:
                self._own_lease = Lease.acquire(path, f"a training script ({Path(sys.argv[0]).name or 'python'})")
                spec = self._own_lease.spec
                if resume and (path / "zarr.json").exists():
                    self._rewind(path)
                else:
                    self._create(path, cfg, options)
            except BaseException as e:
                self._release()
                if not isinstance(e, ReplayError):
                    raise
                message = str(e)
        if self.world > 1:
            box = [message, spec]
            dist.broadcast_object_list(box, src=0)
            message, spec = box
        if message is not None:
            raise UsageError(message) if self.rank == 0 else ReplayError(f"rank 0 could not prepare {path}: {message}")
        assert spec is not None, "rank 0 prepared the store under its lease"
        return spec

    def _create(self, path: Location, cfg: RunConfig, options: RunOptions) -> None:
        check_empty(path)
        layout, info = options.model_manifest(self.model, cfg)
        create_run(path, cfg, world_size=self.world, launcher=Launcher.CUSTOM,
                   data=no_data(options.description or "a training script of the user's own"),
                   command=cmd.capture(self.world), layout=layout, model=info, init_from=origin_of(self.model))

    def _rewind(self, path: Location) -> None:
        store = RunStore.open(path, mode="a")
        m = store.manifest
        if m.kind != "run" or store.capabilities.builtin or not store.capabilities.relaunches_script:
            builtin = m.kind == "run" and store.capabilities.builtin and m.status != "complete"
            raise UsageError(f"Loop(resume=True): {path} was not recorded by a Loop: choose a new store"
                             + (f" (the built-in trainer's run continues with `{continue_command(store)}`)" if builtin
                                else ""))
        assert m.command is not None, "a script's run keeps its command"
        if m.world_size != self.world:
            raise UsageError(f"Loop(resume=True) with {self.world} ranks, but {path} was recorded with "
                             f"{m.world_size}: resume with the same world size")
        if os.environ.get("REPLAY_ALLOW_CHANGED") != "1":
            cmd.check_unchanged(m.command, "resuming", allow="set REPLAY_ALLOW_CHANGED=1")
        resume_run(store, self.world)

    def _release(self) -> None:
        if self._own_lease is not None:
            self._own_lease.release()
            self._own_lease = None

    # -- the analysis probe ------------------------------------------------------------------------

    def opened(self, store: RunStore) -> None:
        info = store.manifest.model
        if info is not None and info.probe is None:
            self._probe = self.model.register_forward_pre_hook(
                lambda module, args, kwargs: self._take_probe(store, module, args, kwargs), with_kwargs=True)

    def _take_probe(self, store: RunStore, module: torch.nn.Module, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> None:
        """The analysis probe's batch of a transformers model: the first training forward's input_ids."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not module.training or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            return
        self._probe.remove()
        self._probe = None
        rows = ids[:PROBE_SAMPLES, :PROBE_TOKENS].detach().cpu().tolist()
        info = store.manifest.model
        assert info is not None, "a probe is taken of a model the manifest describes"
        store.update_manifest(model=dataclasses.replace(info, probe=rows))

    # -- the loop's questions ----------------------------------------------------------------------

    def started(self, step: int) -> None:
        pass

    def begin(self, step: int) -> bool:
        return False

    def sample(self, step: int, micro: int, drawn: np.ndarray,
               drawn_as: tuple[int, int] | None) -> np.ndarray | None:
        return None

    def skip(self, step: int) -> np.ndarray:
        raise AssertionError("a recording skips no step")

    def check_step(self, autocast_used: bool) -> None:
        pass

    def counted(self) -> np.ndarray | None:
        return None

    def reached(self, step: int, totals: np.ndarray | None) -> None:
        pass

    def precision(self) -> str:
        return self.cfg.precision

    def in_window(self) -> bool:
        return False

    def recorded_ids(self, step: int) -> np.ndarray:
        raise AssertionError("a recording has no recorded ids to read")

    def recorded_batches(self, step: int) -> list[np.ndarray]:
        raise AssertionError("a recording has no recorded ids to read")

    def recorded_digests(self, step: int) -> list[np.ndarray]:
        raise AssertionError("a recording has no recorded digests to read")

    def close(self) -> None:
        if self._probe is not None:
            self._probe.remove()
            self._probe = None
        self._release()
