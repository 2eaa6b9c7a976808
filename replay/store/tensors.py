"""Tensors and state trees to arrays plus JSON, and back, with no pickle.

A state tree is what `state_dict()` returns: nested dicts, lists and tuples of tensors, numpy arrays
and plain scalars. `flatten` splits it into a JSON skeleton and a flat {key: numpy array} map, with
bfloat16 kept exactly as its raw bits (uint16); `unflatten` inverts it. Anything else (an arbitrary
object) is refused: the store holds nothing that needs code to be read.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np
import torch

# torch dtypes that have a numpy twin of the same width; bfloat16 travels as its raw bits.
_TORCH_TO_NUMPY = {
    torch.float64: np.float64,
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}
_NAME_TO_TORCH = {str(t).removeprefix("torch."): t for t in [*_TORCH_TO_NUMPY, torch.bfloat16]}


def tensor_to_numpy(t: torch.Tensor) -> tuple[np.ndarray, str]:
    """A CPU numpy array holding the tensor's exact bits, and the torch dtype name to restore it."""
    t = t.detach().cpu().contiguous()
    name = str(t.dtype).removeprefix("torch.")
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16), name
    if t.dtype not in _TORCH_TO_NUMPY:
        raise TypeError(f"cannot store tensors of dtype {t.dtype}")
    return t.numpy(), name


def numpy_to_tensor(a: np.ndarray, dtype_name: str) -> torch.Tensor:
    dtype = _NAME_TO_TORCH[dtype_name]
    a = np.array(a, order="C")  # a copy; np.ascontiguousarray would turn 0-d arrays into 1-d
    if dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def checksum(a: np.ndarray) -> str:
    """CRC-32 of the array's bytes in C order, with dtype and shape so a reshaped array cannot pass."""
    a = np.asarray(a)
    head = f"{a.dtype.str}{a.shape}".encode()
    a = np.ascontiguousarray(a)
    return f"crc32:{zlib.crc32(a.reshape(-1).view(np.uint8), zlib.crc32(head)):08x}"


def flatten(tree: Any, prefix: str = "") -> tuple[Any, dict[str, tuple[np.ndarray, str]]]:
    """(JSON skeleton, {key: (array, torch dtype name or "numpy")}). Keys are '/'-joined paths."""
    arrays: dict[str, tuple[np.ndarray, str]] = {}

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor):
            arrays[path] = tensor_to_numpy(node)
            return {"__tensor__": path}
        if isinstance(node, np.ndarray):
            arrays[path] = (np.array(node, order="C"), "numpy")
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

    return walk(tree, prefix), arrays


def unflatten(skeleton: Any, arrays: dict[str, np.ndarray | torch.Tensor]) -> Any:
    """Rebuild the tree; `arrays` maps keys to tensors (already restored) or numpy arrays."""

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, dict):
            if "__tensor__" in node or "__ndarray__" in node:
                return arrays[node.get("__tensor__") or node["__ndarray__"]]
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
