"""Reading checkpoints of schema-1 stores (written before checksums covered every byte).

A schema-1 checkpoint keeps each rank's tensors in one Zarr byte array without a chunk checksum, and a
CRC-32 (zlib) of every tensor, with its dtype and shape, in the commit record; its JSON carries no
checksum. Such stores open, replay and analyse as before; their run is read-only (store/run_store.py).
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import zarr

from replay.errors import ChecksumError, StoreError
from replay.store.nodes import attributes, member
from replay.store.tensors import as_tensor, entry_view, unflatten


def _crc32(a: np.ndarray) -> str:
    head = f"{a.dtype.str}{a.shape}".encode()
    data = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    # an ndarray is a buffer; numpy's stubs declare it (__buffer__) only for Python >= 3.12
    return f"crc32:{zlib.crc32(data, zlib.crc32(head)):08x}"   # type: ignore[arg-type]


def shard_index(group: zarr.Group) -> dict[str, dict[str, Any]]:
    return dict(attributes(group)["index"])


def read_shard(group: zarr.Group, commit: dict[str, Any], step: int, rank: int, keys: list[str] | None) -> Any:
    """One rank's tree (or {key: tensor} for `keys`), every tensor checked against the commit's CRC-32."""
    if str(rank) not in commit["checksums"]:
        raise StoreError(f"checkpoint {step} has no shard for rank {rank}")
    attrs = attributes(group)
    index, expected = attrs["index"], commit["checksums"][str(rank)]
    wanted = list(index) if keys is None else keys
    unknown = sorted(set(wanted) - set(index))
    if unknown:
        raise StoreError(f"checkpoint {step} rank {rank} has no tensor {unknown[0]}")
    lo = min((index[k]["offset"] for k in wanted), default=0)
    hi = max((index[k]["offset"] + index[k]["nbytes"] for k in wanted), default=0)
    buffer = np.asarray(member(group, "tensors", zarr.Array)[lo:hi])
    tensors = {}
    for key in wanted:
        a = entry_view(buffer, index[key], lo)
        if _crc32(a) != expected[key]:
            raise ChecksumError(f"checkpoint {step} rank {rank}: tensor {key.strip('/')} does not match its checksum: "
                                "the store is corrupted there")
        tensors[key] = as_tensor(a, index[key]["dtype"])
    return tensors if keys is not None else unflatten(attrs["skeleton"], tensors)
