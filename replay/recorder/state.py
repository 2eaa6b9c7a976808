"""Training state as the recorder sees it: what each rank checkpoints, and how it is restored.

Every checkpoint tree is {"replicated": ..., "local": ...}: the replicated part (identical on all ranks:
model, and the optimizer when it is not partitioned) is written by rank 0 only; the local part (a
DeepSpeed ZeRO optimizer partition) by every rank for itself. RNG states are added by the recorder.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from weakref import WeakKeyDictionary

import torch

from replay.errors import UsageError
from replay.recorder.digest import Watch, model_and_optimizer, watch_model_and_optimizer
from replay.store import RunStore
from replay.store.sharding import Sharding


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)


# model -> the DCP directory recorder/dcp.py's load_dcp loaded it from; here, not there, so that a recording
# learns it without importing torch.distributed.checkpoint (half a second of every rank's start-up)
_ORIGINS: WeakKeyDictionary[torch.nn.Module, str] = WeakKeyDictionary()


def note_origin(model: torch.nn.Module, path: str) -> None:
    _ORIGINS[unwrap(model)] = path


def origin_of(model: torch.nn.Module) -> str | None:
    """The DCP directory `model` was loaded from, if load_dcp loaded it."""
    return _ORIGINS.get(unwrap(model))


class TorchTrainState:
    """Model, optimizer, LR scheduler and (for FP16) grad scaler of a plain or DDP training loop."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler=None, scaler=None):
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler

    def state_dict(self, rank: int) -> dict[str, Any]:
        if rank != 0:
            return {"replicated": {}, "local": {}}
        tree = {"model": unwrap(self.model).state_dict(), "optimizer": self.optimizer.state_dict()}
        if self.scheduler is not None:
            tree["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            tree["scaler"] = self.scaler.state_dict()
        return {"replicated": tree, "local": {}}

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """What the per-step digest covers (recorder/digest.py): on every rank, its model and optimizer state."""
        return model_and_optimizer(unwrap(self.model), self.optimizer)

    def tensors_watch(self, tensors: list[tuple[str, torch.Tensor]]) -> Watch | None:
        """A watch that holds while `named_tensors` would give `tensors` again (recorder/digest.py)."""
        return watch_model_and_optimizer(unwrap(self.model), self.optimizer, tensors)

    def load_state_dict(self, replicated: dict[str, Any], local: dict[str, Any], read_local=None) -> None:
        unwrap(self.model).load_state_dict(replicated["model"])
        self.optimizer.load_state_dict(replicated["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(replicated["scheduler"])
        if self.scaler is not None:
            self.scaler.load_state_dict(replicated["scaler"])


class DeepSpeedTrainState:
    """A DeepSpeed engine: the module and scheduler are replicated; the optimizer (a ZeRO partition
    under stages 1 and 2, DeepSpeed's BF16 optimizer, or the client optimizer) is written per rank."""

    def __init__(self, engine):
        self.engine = engine

    def state_dict(self, rank: int) -> dict[str, Any]:
        replicated = {}
        if rank == 0:
            replicated["model"] = self.engine.module.state_dict()
            if self.engine.lr_scheduler is not None:
                replicated["scheduler"] = self.engine.lr_scheduler.state_dict()
        optimizer = storable(self.engine.optimizer.state_dict())
        return {"replicated": replicated, "local": {"optimizer": optimizer,
                                                     "global_steps": self.engine.global_steps,
                                                     "global_samples": self.engine.global_samples}}

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """What the per-step digest covers (recorder/digest.py): the module, and this rank's optimizer state
        (under ZeRO its partition: the FP32 master weights and their moments)."""
        optimizer = self.engine.optimizer
        base = getattr(optimizer, "optimizer", optimizer)   # ZeRO's and the BF16 optimizer's inner one
        out = model_and_optimizer(self.engine.module, base)
        for g, group in enumerate(base.param_groups):
            out += [(f"optimizer/group{g}.{i}", p) for i, p in enumerate(group["params"])]
        return out

    def load_state_dict(self, replicated: dict[str, Any], local: dict[str, Any], read_local=None) -> None:
        """`read_local(rank)` gives another rank's local tree: ZeRO loads from the list of all of them."""
        self.engine.module.load_state_dict(replicated["model"])
        if self.engine.lr_scheduler is not None:
            self.engine.lr_scheduler.load_state_dict(replicated["scheduler"])
        optimizer = self.engine.optimizer
        if hasattr(optimizer, "single_partition_of_fp32_groups") or hasattr(optimizer, "bf16_groups"):
            # ZeRO-1/2 and BF16 optimizers restore from one state dict per saved rank, indexed by dp rank
            # (only their own for the rigid layout; all of them for the elastic one).
            world = self.engine.dp_world_size
            states = [restore_objects(read_local(r)["optimizer"], optimizer) for r in range(world)]
            optimizer.load_state_dict(states, load_optimizer_states=True, load_from_fp32_weights=True)
        else:
            optimizer.load_state_dict(restore_objects(local["optimizer"], optimizer))
        self.engine.global_steps = int(local["global_steps"])
        self.engine.global_samples = int(local["global_samples"])


def restore_objects(state: dict[str, Any], owner: Any) -> dict[str, Any]:
    """Put the fields `storable` kept back onto the owner's live objects (e.g. its loss scaler)."""
    out = dict(state)
    for key, value in state.items():
        if isinstance(value, dict) and "__object__" in value and hasattr(owner, key):
            live = getattr(owner, key)
            for field, v in value.items():
                if field != "__object__":
                    setattr(live, field, v)
            out[key] = live
    return out


def storable(tree: Any) -> Any:
    """DeepSpeed state dicts carry a few small objects (loss scaler, fragment addresses): keep their
    plain fields, so the store stays arrays plus JSON."""
    if isinstance(tree, dict):
        return {k: storable(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(storable(v) for v in tree)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return {f.name: storable(getattr(tree, f.name)) for f in dataclasses.fields(tree)}
    if tree is None or isinstance(tree, (bool, int, float, str, torch.Tensor)):
        return tree
    if hasattr(tree, "__dict__"):
        return {"__object__": type(tree).__name__,
                **{k: storable(v) for k, v in vars(tree).items()
                   if v is None or isinstance(v, (bool, int, float, str, torch.Tensor))}}
    return str(tree)


def note_sharding(store: RunStore, recorded: Sharding | None, sharding: Sharding, rank: int) -> None:
    """Check the model is sharded as `recorded` (the run's it replays or resumes; None: a new run) says, on
    every rank (so all refuse alike), and put the sharding into this run's manifest (rank 0)."""
    if recorded is not None:
        was, now = recorded.details.get("mixed_precision"), sharding.details.get("mixed_precision")
        if was != now:
            raise UsageError(f"the script shards its model with mixed precision {now or 'none'}, the record with "
                             f"{was or 'none'}: run it with the recorded MixedPrecisionPolicy")
        if recorded.to_dict() != sharding.to_dict():
            raise UsageError(f"the script shards its model over mesh {sharding.details.get('mesh')} into other pieces "
                             f"than the record's (mesh {recorded.details.get('mesh')}): run it as it was recorded")
    if rank == 0 and store.manifest.sharding is None:
        store.update_manifest(sharding=sharding)
