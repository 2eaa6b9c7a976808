"""A model sharded across ranks (FSDP2's DTensor shards, DeepSpeed ZeRO-3's flat partitions): where each rank's
piece of each parameter lies, so that a whole parameter is assembled from the ranks' shards of a checkpoint.

A sharded run's checkpoints keep no whole model anywhere: rank r's shard holds its pieces of the model's
tensors at `state/local/model/<name>` (a TrainState's local tree: recorder/state.py), and the manifest's
`sharding` says, per state-dict name, the whole tensor's shape and each rank's piece: an [offset, length]
along one dimension (FSDP2's `Shard(dim)`), or in the flattened tensor (ZeRO-3, whose partitions are
slices of each flattened parameter, the last one padded). `RunStore.read_model` is the one reader: whole
tensors by name from any run, sharded or not, each rank's shard read only for the pieces it holds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from replay.errors import StoreError

if TYPE_CHECKING:
    import torch

LOCAL_MODEL = "/state/local/model/"


def local_key(name: str) -> str:
    """The key of a rank's piece of the model's tensor `name` in that rank's shard."""
    return LOCAL_MODEL + name


@dataclass
class Piece:
    offset: int
    length: int


@dataclass
class ShardedTensor:
    shape: list[int]                 # the whole tensor's
    dim: int | None                  # the dimension it is cut along; None: cut in the flattened tensor (ZeRO-3)
    pieces: list[Piece]              # rank r's piece, for every rank (length 0: it holds none)

    def check(self, name: str) -> None:
        extent = math.prod(self.shape) if self.dim is None else self.shape[self.dim]
        covered = sorted((p.offset, p.offset + p.length) for p in self.pieces if p.length)
        end = 0
        for lo, hi in covered:
            if lo != end:
                raise StoreError(f"the manifest's sharding of {name} leaves a gap or overlap at {end}")
            end = hi
        if end < extent:   # ZeRO-3's last partition is padded past the end: more is fine, less is not
            raise StoreError(f"the manifest's sharding of {name} covers {end} of its {extent}")


@dataclass
class Sharding:
    kind: str                                     # "fsdp2" or "zero3"
    tensors: dict[str, ShardedTensor] = field(default_factory=dict)   # by the model's state-dict name
    details: dict[str, Any] = field(default_factory=dict)            # the mesh, mixed precision, ...

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sharding:
        tensors = {name: ShardedTensor(shape=list(t["shape"]), dim=t["dim"],
                                       pieces=[Piece(**p) for p in t["pieces"]]) for name, t in d["tensors"].items()}
        return cls(kind=d["kind"], tensors=tensors, details=dict(d.get("details") or {}))


def assemble(spec: ShardedTensor, pieces: list[torch.Tensor | None]) -> torch.Tensor:
    """The whole tensor from every rank's piece (in rank order; a rank holding none gives an empty one)."""
    import torch  # lazy: torch (0.7 s); the store's launchers never assemble

    held = [(p, t) for p, t in zip(spec.pieces, pieces, strict=True) if p.length and t is not None]
    held.sort(key=lambda pt: pt[0].offset)
    if spec.dim is None:
        flat = torch.cat([t.reshape(-1)[:p.length] for p, t in held])
        return flat[:math.prod(spec.shape)].reshape(spec.shape)
    return torch.cat([t for _, t in held], dim=spec.dim)
