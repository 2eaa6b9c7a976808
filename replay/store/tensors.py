"""State trees to one byte buffer plus JSON, and back, with no pickle.

A state tree is what `state_dict()` returns: nested dicts, lists and tuples of tensors, numpy arrays
and plain scalars. `pack` copies every tensor once into one contiguous CPU byte buffer (the copy a
checkpoint needs anyway, so that later optimizer steps cannot reach it), described by an index of
{key: dtype, shape, offset, nbytes}, and keeps everything else as a JSON skeleton. bfloat16 is stored as
its raw bits. Tensors sharing memory (tied weights) are stored once. Anything that is not a tensor,
an array or a plain scalar is refused: the store holds nothing that needs code to be read.

One buffer becomes one Zarr array, so a checkpoint costs one array's overhead rather than one per
tensor, and any single tensor can still be read alone by its byte range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_STORABLE = {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
             torch.int16, torch.int8, torch.uint8, torch.bool}
_ALIGN = 64   # byte alignment of every tensor in the buffer


@dataclass
class Layout:
    """Where every tensor of a tree goes in its byte buffer, without copying anything yet."""

    skeleton: Any                      # the tree with {"__tensor__": key} where tensors were
    index: dict[str, dict[str, Any]]   # key -> {"dtype", "shape", "offset", "nbytes"}
    size: int                          # bytes of the buffer
    tensors: dict[str, torch.Tensor]   # key -> the tensor whose bytes go at its offset (one per storage)

    def segments(self) -> list[tuple[int, np.ndarray]]:
        """(offset, bytes) of every tensor, as uint8 views of CPU memory (a copy only where a tensor is
        on another device or not contiguous)."""
        out = []
        for key, t in self.tensors.items():
            if t.numel():
                flat = t.detach().to("cpu").contiguous().reshape(-1)
                out.append((self.index[key]["offset"], flat.view(torch.uint8).numpy()))
        return out


@dataclass
class Packed:
    """A tree copied into one CPU buffer: what the recorder keeps, so later optimizer steps cannot reach it."""

    skeleton: Any
    index: dict[str, dict[str, Any]]
    buffer: np.ndarray                 # uint8, every tensor's bytes at its offset

    def view(self, key: str) -> np.ndarray:
        """One tensor's stored bits as a numpy array (a view, no copy)."""
        return entry_view(self.buffer, self.index[key], base=0)


def layout(tree: Any) -> Layout:
    tensors: dict[str, torch.Tensor] = {}
    index: dict[str, dict[str, Any]] = {}
    seen: dict[tuple[Any, ...], str] = {}
    size = 0

    def add(t: torch.Tensor, dtype_name: str, path: str) -> None:
        nonlocal size
        ident = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()), str(t.device))
        if t.numel() and ident in seen:          # tied weights: one copy, two names
            index[path] = dict(index[seen[ident]])
            return
        nbytes = t.numel() * t.element_size()
        index[path] = {"dtype": dtype_name, "shape": list(t.shape), "offset": size, "nbytes": nbytes}
        tensors[path] = t
        seen[ident] = path
        size += -(-nbytes // _ALIGN) * _ALIGN

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor):
            if node.dtype not in _STORABLE:
                raise TypeError(f"cannot store tensors of dtype {node.dtype} at {path}")
            add(node.detach(), str(node.dtype).removeprefix("torch."), path)
            return {"__tensor__": path}
        if isinstance(node, np.ndarray):
            if node.dtype.hasobject:
                raise TypeError(f"cannot store an object array at {path}")
            add(torch.from_numpy(np.ascontiguousarray(node)), "numpy:" + node.dtype.str, path)
            return {"__ndarray__": path}
        if isinstance(node, dict):
            return {"__dict__": [[_key(k), walk(v, f"{path}/{_segment(k)}")] for k, v in node.items()]}
        if isinstance(node, (list, tuple)):
            items = [walk(v, f"{path}/{i}") for i, v in enumerate(node)]
            return {"__tuple__": items} if isinstance(node, tuple) else items
        if isinstance(node, float) and not math.isfinite(node):
            return {"__float__": repr(node)}
        if isinstance(node, np.generic):
            return walk(node.item(), path)
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        raise TypeError(f"cannot store a {type(node).__name__} at {path or '/'}: only tensors, arrays and scalars")

    skeleton = walk(tree, "")
    return Layout(skeleton, index, size, tensors)


def pack(tree: Any, into: np.ndarray | None = None) -> Packed:
    """Copy every tensor of `tree`, from any device, into one CPU buffer: `into` if it is large enough
    (a buffer used before: its pages are already mapped, so the copy runs at memory speed), else a new one."""
    lay = layout(tree)
    buffer = into[:lay.size] if into is not None and len(into) >= lay.size else _host_buffer(lay)
    for path, t in lay.tensors.items():
        entry = lay.index[path]
        if t.numel():
            dst = torch.from_numpy(buffer[entry["offset"]: entry["offset"] + entry["nbytes"]])
            dst.view(t.dtype).view(t.shape).copy_(t)
    return Packed(lay.skeleton, lay.index, buffer)


def _host_buffer(lay: Layout) -> np.ndarray:
    """A new CPU buffer; page-locked when tensors come from a GPU, which then copies at full speed (on an
    H100, 30 GB/s against 8 GB/s into pageable memory: docs/gpu.md). Zeroed once: the alignment gaps between
    tensors are never written, and must not carry the process's leftover memory into the store."""
    if any(t.is_cuda for t in lay.tensors.values()):
        return torch.zeros(lay.size, dtype=torch.uint8, pin_memory=True).numpy()
    return np.zeros(lay.size, dtype=np.uint8)


def whole_buffer(buffer: np.ndarray) -> np.ndarray:
    """The buffer a `pack` result's buffer is a slice of (itself when it is whole)."""
    while isinstance(buffer.base, np.ndarray):
        buffer = buffer.base
    return buffer


def unpack(packed: Packed) -> Any:
    """The tree back; its tensors are views into the buffer (no copy)."""
    arrays = {key: packed.view(key) for key in packed.index}
    return unflatten(packed.skeleton, {key: as_tensor(a, packed.index[key]["dtype"]) for key, a in arrays.items()})


def entry_view(buffer: np.ndarray, entry: dict[str, Any], base: int) -> np.ndarray:
    """Bytes [offset, offset + nbytes) of `buffer`, which starts at byte `base`, as the stored array."""
    name = entry["dtype"]
    dtype = np.dtype(name.removeprefix("numpy:")) if name.startswith("numpy:") else _NUMPY_STORAGE[name]
    start = entry["offset"] - base
    return buffer[start: start + entry["nbytes"]].view(dtype).reshape(entry["shape"])


_NUMPY_STORAGE = {"float64": np.dtype(np.float64), "float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
                  "bfloat16": np.dtype(np.uint16), "int64": np.dtype(np.int64), "int32": np.dtype(np.int32),
                  "int16": np.dtype(np.int16), "int8": np.dtype(np.int8), "uint8": np.dtype(np.uint8),
                  "bool": np.dtype(np.bool_)}


def as_tensor(a: np.ndarray, dtype_name: str) -> torch.Tensor | np.ndarray:
    """A stored array as what was packed: a numpy array, or a tensor sharing its memory."""
    if dtype_name.startswith("numpy:"):
        return a
    t = torch.from_numpy(a if a.flags.writeable else a.copy())
    return t.view(torch.bfloat16) if dtype_name == "bfloat16" else t


def unflatten(skeleton: Any, tensors: dict[str, Any]) -> Any:
    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, dict):
            if "__tensor__" in node or "__ndarray__" in node:
                return tensors[node.get("__tensor__") or node["__ndarray__"]]
            if "__dict__" in node:
                return {_unkey(k): walk(v) for k, v in node["__dict__"]}
            if "__tuple__" in node:
                return tuple(walk(v) for v in node["__tuple__"])
            if "__float__" in node:
                return float(node["__float__"])
        return node

    return walk(skeleton)


def _key(k: Any) -> Any:
    if isinstance(k, bool) or not isinstance(k, (str, int)):
        raise TypeError(f"cannot store a dict key of type {type(k).__name__}")
    return k if isinstance(k, str) else {"int": k}


def _unkey(k: Any) -> Any:
    return k["int"] if isinstance(k, dict) else k


def _segment(k: Any) -> str:
    return str(k).replace("/", "|")


def same_bits(a: Any, b: Any) -> bool:
    """Two state trees (dicts, lists or tuples, tensors, arrays, scalars) hold the same values bit for bit: a
    tensor's or an array's type, shape and bytes (a NaN equals a NaN of its bits; -0.0 is not 0.0)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b)))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and a.tobytes() == b.tobytes())
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
