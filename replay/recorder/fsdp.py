"""A model sharded with FSDP2 (`torch.distributed.fsdp.fully_shard`): every rank checkpoints its own pieces.

Its parameters are DTensors cut along one dimension (`Shard(dim)`) over a one-dimensional mesh of the ranks;
the optimizer's state follows them. A checkpoint holds, per rank, the local tensors of both (no gather to
one rank: a rank's checkpoint memory is its shard's), and rank 0 the plain buffers, scheduler and scaler.
The manifest's `sharding` (store/sharding.py) says where each rank's piece lies in the whole tensor, so
`RunStore.read_model` assembles whole weights; a restore copies each piece back into the same sharding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from replay.errors import UsageError
from replay.recorder.digest import model_and_optimizer
from replay.store.sharding import Piece, ShardedTensor, Sharding


def is_fsdp2(model: torch.nn.Module) -> bool:
    """The model's parameters are DTensors (fully_shard'ed)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


class FSDP2TrainState:
    """Model, optimizer, LR scheduler and grad scaler of a loop whose model is fully_shard'ed (FSDP2)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None,
                 scaler: Any = None):
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        for name, t in model.state_dict().items():
            if isinstance(t, DTensor):
                _check_placement(name, t)

    def state_dict(self, rank: int) -> dict[str, Any]:
        model = self.model.state_dict()
        replicated: dict[str, Any] = {}
        if rank == 0:
            replicated["model"] = {n: t for n, t in model.items() if not isinstance(t, DTensor)}
            if self.scheduler is not None:
                replicated["scheduler"] = self.scheduler.state_dict()
            if self.scaler is not None:
                replicated["scaler"] = self.scaler.state_dict()
        optimizer = self.optimizer.state_dict()
        local = {"model": {n: t.to_local() for n, t in model.items() if isinstance(t, DTensor)},
                 "optimizer": {**optimizer, "state": {i: {k: _local(v) for k, v in s.items()}
                                                      for i, s in optimizer["state"].items()}}}
        return {"replicated": replicated, "local": local}

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """What the per-step digest covers (recorder/digest.py): this rank's pieces of the model and optimizer."""
        return model_and_optimizer(self.model, self.optimizer)

    def load_state_dict(self, replicated: dict[str, Any], local: dict[str, Any],
                        read_local: Callable[[int], dict[str, Any]] | None = None) -> None:
        with torch.no_grad():
            for name, t in self.model.state_dict().items():
                if isinstance(t, DTensor):
                    mine, saved = t.to_local(), local["model"][name]
                    if mine.shape != saved.shape:
                        raise UsageError(f"{name}: this rank holds a piece of shape {list(mine.shape)}, the checkpoint "
                                         f"{list(saved.shape)}: shard the model as it was recorded (same world size "
                                         "and mesh)")
                    mine.copy_(saved)
                else:
                    t.copy_(replicated["model"][name])
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        saved = local["optimizer"]
        state = {i: {k: _like(params[int(i)], v) for k, v in s.items()} for i, s in saved["state"].items()}
        self.optimizer.load_state_dict({**saved, "state": state})
        if self.scheduler is not None:
            self.scheduler.load_state_dict(replicated["scheduler"])
        if self.scaler is not None:
            self.scaler.load_state_dict(replicated["scaler"])

    def sharding(self, world: int) -> Sharding:
        """Every rank's piece of every sharded tensor (one all_gather of this rank's, on every rank)."""
        mine: dict[str, tuple[int, int]] = {}
        tensors: dict[str, DTensor] = {n: t for n, t in self.model.state_dict().items() if isinstance(t, DTensor)}
        for name, t in tensors.items():
            dim = _check_placement(name, t)
            shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            mine[name] = (offset[dim] if shape[dim] else 0, shape[dim])
        every: list[Any] = [None] * world
        if world > 1:
            dist.all_gather_object(every, mine)
        else:
            every = [mine]
        out = {name: ShardedTensor(shape=list(t.shape), dim=_check_placement(name, t),
                                   pieces=[Piece(*rank[name]) for rank in every]) for name, t in tensors.items()}
        mesh = next(iter(tensors.values())).device_mesh if tensors else None
        details: dict[str, Any] = {"mesh": mesh.mesh.tolist() if mesh is not None else []}
        policy = _mixed_precision(self.model)
        if policy:
            details["mixed_precision"] = policy
        return Sharding(kind="fsdp2", tensors=out, details=details)


def _check_placement(name: str, t: DTensor) -> int:
    """The dimension `t` is cut along; a layout this state cannot restore is refused."""
    if t.device_mesh.ndim != 1:
        raise UsageError(f"{name} is sharded over a {t.device_mesh.ndim}-dimensional mesh (HSDP): replay records "
                         "FSDP2 over a one-dimensional mesh only")
    placement = t.placements[0]
    if not isinstance(placement, Shard):
        raise UsageError(f"{name} is placed {placement} across the ranks: replay records FSDP2's Shard(dim) only")
    return placement.dim


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def _like(param: torch.Tensor, value: Any) -> Any:
    """An optimizer-state tensor restored as the DTensor it was: one shaped like the param's local piece."""
    if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    if value.shape != param.to_local().shape:
        return value
    return DTensor.from_local(value.to(param.device), param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def _mixed_precision(model: torch.nn.Module) -> dict[str, str] | None:
    """The root module's MixedPrecisionPolicy (the dtypes it sets), or None."""
    get_state = getattr(model, "_get_fsdp_state", None)
    policy = getattr(get_state(), "_mp_policy", None) if get_state is not None else None
    if policy is None or (policy.param_dtype is None and policy.reduce_dtype is None):
        return None
    return {"param_dtype": str(policy.param_dtype), "reduce_dtype": str(policy.reduce_dtype)}
