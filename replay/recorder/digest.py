"""A digest of a rank's training state, taken after every optimizer step: one 32-bit checksum per tensor of
its model (parameters and persistent buffers) and of its optimizer state, in a fixed order of names.

A replay takes the same digests, so "bit for bit" covers the whole state after every update, not only the
losses and the gradient norm: in FP32 a changed attention often moves the loss by less than its last bit
for a step or two while the weights have parted already (replayer/replays.py compares them).

- A tensor in host memory: the CRC-32C of its bytes (store/integrity.py; about 16 GB/s on one core).
- A tensor on a GPU: two wrapping 64-bit integer sums of its words (the words, and their squares) reduced
  on the device, so that only 16 bytes per tensor cross to the host; their CRC-32C is the digest. Integer
  sums wrap modulo 2**64 whatever their order, so the digest is the same on every run of the same bits.

The names are the first step's; a tensor that appears later (an optimizer state created late) is folded
into the last slot, `LATE`, so nothing of the state goes unchecked.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from replay.store.integrity import crc32c

LATE = "(tensors that appeared after the first step)"
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def named_tensors(state: Any, rank: int) -> list[tuple[str, torch.Tensor]]:
    """The tensors a train state (recorder/state.py) holds on rank `rank`, by name: its own
    `named_tensors()`, else every tensor of that rank's checkpoint tree."""
    own = getattr(state, "named_tensors", None)
    if own is not None:
        return list(own())
    return list(_walk(state.state_dict(rank), ""))


def _walk(tree: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        yield path or "/", tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from _walk(value, f"{path}/{key}")
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from _walk(value, f"{path}/{i}")


def model_and_optimizer(model: torch.nn.Module, optimizer: Any) -> list[tuple[str, torch.Tensor]]:
    """A plain (or DDP's inner) model's parameters and persistent buffers, each stored tensor once (tied
    weights share one), and the optimizer's state of each parameter, by the parameter's name."""
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[tuple[int, torch.dtype, tuple[int, ...]]] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        local = _local(t)
        key = (local.data_ptr(), local.dtype, tuple(local.shape))
        if key not in seen:
            seen.add(key)
            out.append((f"model/{name}", local))
    names: dict[int, str] = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    for g, group in enumerate(getattr(optimizer, "param_groups", [])):
        for i, p in enumerate(group["params"]):
            param = names.get(id(p), f"group{g}.{i}")
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    out.append((f"optimizer/{param}/{key}", _local(value)))
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) tensor's piece on this rank."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


class StateDigest:
    """Call it after each optimizer step: this rank's digests, in the order of `names` (fixed at the first
    call). `kind` says how they were taken ("crc32c" in host memory, "crc32c+sum64" with tensors on a GPU):
    digests of two kinds are not compared."""

    def __init__(self, state: Any, rank: int):
        self.state, self.rank = state, rank
        self.names: list[str] | None = None
        self.kind: str | None = None
        self._index: dict[str, int] = {}

    def __call__(self) -> np.ndarray:
        tensors = named_tensors(self.state, self.rank)
        if self.names is None:
            self.names = [name for name, _ in tensors] + [LATE]
            self._index = {name: i for i, name in enumerate(self.names)}
            self.kind = "crc32c+sum64" if any(t.is_cuda for _, t in tensors) else "crc32c"
        out = np.zeros(len(self.names), dtype=np.uint32)
        late: list[int] = []
        on_device = [(name, t) for name, t in tensors if t.is_cuda]
        sums = _device_sums([t for _, t in on_device])
        for name, t in tensors:
            value = sums.pop(0) if t.is_cuda else _crc(t)
            i = self._index.get(name)
            if i is None:
                late.append(value)
            else:
                out[i] = value
        if late:
            out[-1] = crc32c(np.asarray(late, dtype=np.uint32))
        return out


def _crc(t: torch.Tensor) -> int:
    """The CRC-32C of a host tensor's bytes, read in place (a copy only of a non-contiguous one): the bytes
    seen through ctypes rather than numpy, which costs a third of the dispatch per tensor."""
    if not t.is_contiguous():
        t = t.contiguous()
    return crc32c((ctypes.c_char * t.nbytes).from_address(t.data_ptr()))


def _device_sums(tensors: list[torch.Tensor]) -> list[int]:
    """Each GPU tensor's digest, its reductions on the device and one copy of 16 bytes per tensor to the host."""
    if not tensors:
        return []
    rows = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        if flat.element_size() not in _WORDS:
            flat = flat.contiguous().view(torch.uint8)
        words = flat.view(_WORDS[flat.element_size()]).to(torch.int64)
        rows.append(torch.stack([words.sum(), (words * words).sum()]))
    host = torch.stack(rows).cpu().tolist()
    return [crc32c(struct.pack("<qq", a, b)) for a, b in host]
