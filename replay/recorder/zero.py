"""A DeepSpeed engine in a user's loop: `Loop(store, engine, optimizer, ...)` with what `deepspeed.initialize`
returned, under ZeRO stages 0 to 3.

Stages 0 to 2 keep the whole module on every rank: `DeepSpeedTrainState` (recorder/state.py) checkpoints it
from rank 0 and each rank's optimizer partition. ZeRO-3 partitions the parameters too: each one is a flat
`ds_tensor` per rank (the last padded), so each rank checkpoints its partitions of the parameters at
`state/local/model/<name>` and its optimizer partition, nothing is gathered, and the manifest's sharding
(store/sharding.py) says where each partition lies, for `RunStore.read_model`. A restore puts every rank's
own partitions and optimizer state back into the same partitioning (same world size, same config).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from replay.errors import UsageError
from replay.recorder.recorder import TrainState
from replay.recorder.state import DeepSpeedTrainState, restore_objects, storable
from replay.store.sharding import Piece, ShardedTensor, Sharding


def engine_state(model: Any, optimizer: Any) -> TrainState | None:
    """The train state of a DeepSpeed engine passed as the loop's model; None for any other model."""
    deepspeed = sys.modules.get("deepspeed")   # a DeepSpeed engine exists only where deepspeed is imported
    if deepspeed is None or not isinstance(model, deepspeed.DeepSpeedEngine):
        return None
    if optimizer is not model.optimizer:
        raise UsageError("Loop(store, engine, optimizer): pass the optimizer deepspeed.initialize returned "
                         "(engine.optimizer), the one the engine steps")
    return Zero3TrainState(model) if model.zero_optimization_stage() == 3 else DeepSpeedTrainState(model)


class Zero3TrainState:
    """A ZeRO-3 engine: every rank's partitions of the parameters and of the optimizer are its own; rank 0
    adds the module's buffers and the scheduler, which are replicated."""

    def __init__(self, engine: Any):
        self.engine = engine
        # every state-dict name of a parameter, tied ones under each of their names; each a Parameter that
        # DeepSpeed gave its partition (`ds_tensor`) and whole shape (`ds_shape`)
        self.params: dict[str, Any] = dict(engine.module.named_parameters(remove_duplicate=False))

    def sharding(self, world: int) -> Sharding:
        """Where each rank's partition of each parameter lies: rank r holds [r * n, (r + 1) * n) of the
        flattened parameter, n its partition's size (the same on every rank)."""
        tensors = {}
        for name, p in self.params.items():
            n = p.ds_tensor.ds_numel
            tensors[name] = ShardedTensor(shape=list(p.ds_shape), dim=None,
                                          pieces=[Piece(offset=r * n, length=n) for r in range(world)])
        dtype = next(iter(self.params.values())).ds_tensor.dtype if self.params else torch.float32
        return Sharding(kind="zero3", tensors=tensors,
                        details={"stage": 3, "dtype": str(dtype).removeprefix("torch."), "world_size": world})

    def state_dict(self, rank: int) -> dict[str, Any]:
        replicated: dict[str, Any] = {}
        if rank == 0:
            replicated["model"] = {k: v for k, v in self.engine.module.state_dict().items() if k not in self.params}
            if self.engine.lr_scheduler is not None:
                replicated["scheduler"] = self.engine.lr_scheduler.state_dict()
        model = {name: p.ds_tensor.detach() for name, p in self.params.items()}
        return {"replicated": replicated,
                "local": {"model": model, "optimizer": storable(self.engine.optimizer.state_dict()),
                          "global_steps": self.engine.global_steps, "global_samples": self.engine.global_samples}}

    def load_state_dict(self, replicated: dict[str, Any], local: dict[str, Any], read_local: Any = None) -> None:
        engine, optimizer = self.engine, self.engine.optimizer
        _, unexpected = engine.module.load_state_dict(replicated["model"], strict=False)   # the buffers
        assert not unexpected, f"the checkpoint's buffers are the module's: {unexpected}"
        if engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(replicated["scheduler"])
        optimizer.checkpoint_event_prologue()   # every parameter back to its partition alone
        # ZeRO-3 loads the entry of its own dp rank only: each rank's list holds its own state at every index
        own = restore_objects(local["optimizer"], optimizer)
        optimizer.load_state_dict([own] * engine.dp_world_size, load_optimizer_states=True,
                                  load_from_fp32_weights=True)
        with torch.no_grad():
            for name, p in self.params.items():
                p.ds_tensor.copy_(local["model"][name])
        optimizer.checkpoint_event_epilogue()   # gathers the parameters ZeRO-3 keeps whole (persistent) again
        engine.global_steps = int(local["global_steps"])
        engine.global_samples = int(local["global_samples"])
