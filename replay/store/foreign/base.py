"""What every foreign checkpoint format shares: a checkpoint's step and identity, and the model's shape read
off its weights (store/foreign/__init__.py says what a series is)."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replay.errors import StoreError, UsageError
from replay.store.layout import Layout
from replay.store.location import Location


@dataclass(frozen=True)
class ForeignCheckpoint:
    step: int
    location: Location        # the checkpoint's folder (HF Trainer, DCP) or file (nanoGPT)
    identity: str             # changes when the checkpoint is rewritten: its sizes and a digest of its headers


@dataclass
class Shape:
    """A model's size as a format describes it before its weights are checked."""
    n_layer: int
    n_head: int
    n_kv_head: int
    n_embd: int


def trailing_step(name: str) -> int | None:
    """The step a folder's name ends with (`checkpoint-40`, `step-40`, `40`), if it does."""
    found = re.search(r"(\d+)$", name)
    return int(found.group(1)) if found else None


def digest(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:24]


SAMPLES, SAMPLE_BYTES = 16, 64 << 10


def sampled_digest(path: Path, start: int = 0) -> str:
    """A digest of a local file's bytes from `start`: all of them up to 1 MiB, else 16 blocks of 64 KiB spread
    evenly (a checkpoint's rewrite changes its weights everywhere, its header and size not at all)."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        span = size - start
        if span <= SAMPLES * SAMPLE_BYTES:
            f.seek(start)
            h.update(f.read())
        else:
            for i in range(SAMPLES):
                f.seek(start + i * (span - SAMPLE_BYTES) // (SAMPLES - 1))
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:24]


def object_tag(loc: Location) -> str:
    """An object's size and e_tag (the server's tag of its bytes), read without reading the object."""
    from replay.store.s3 import S3Backend  # lazy: obstore, only for a location on S3

    backend = loc.backend
    assert isinstance(backend, S3Backend), "object_tag is for locations on an object store"
    meta = backend.head(loc.key)
    if meta is None:
        raise StoreError(f"{loc} is gone: was the checkpoint removed while it was read?")
    return f"{meta['size']}:{meta['e_tag']}"


def config_shape(config: dict[str, Any]) -> dict[str, int]:
    """What a transformers-style config.json says of the model's shape (GPT-2's names or Llama's)."""
    names = {"n_head": ("num_attention_heads", "n_head"), "n_kv_head": ("num_key_value_heads",),
             "n_layer": ("num_hidden_layers", "n_layer"), "n_embd": ("hidden_size", "n_embd")}
    out = {}
    for ours, theirs in names.items():
        value = next((config[k] for k in theirs if isinstance(config.get(k), int)), None)
        if value is not None:
            out[ours] = value
    return out


def weight_shape(layout: Layout, shapes: dict[str, list[int]], n_head: int, where: str) -> Shape:
    """The model's layers, width and key/value heads, from its weights' shapes and its query head count."""
    n_layer = 0
    while all(k in shapes for k in layout.keys(n_layer).values()):
        n_layer += 1
    if n_layer == 0:
        missing = next(k for k in layout.keys(0).values() if k not in shapes)
        raise UsageError(f"{where} holds no {missing} (layout {layout.name}): pass the layout its tensors have")

    def io(key: str) -> list[int]:
        shape = shapes[key]
        if len(shape) != 2:
            raise UsageError(f"{where}: {key} is not a matrix ({shape}): is layout {layout.name} its layout?")
        return shape if layout.orientation == "in_out" else shape[::-1]

    keys = layout.keys(0)
    n_embd, q_width = io(keys["qkv"] if "qkv" in keys else keys["q"])
    if "qkv" in keys:
        q_width //= 3
    if n_head <= 0 or q_width % n_head:
        raise UsageError(f"{where}: {n_head} heads do not divide the queries' width {q_width}: pass the model's "
                         "head count (--heads N)")
    head_dim = q_width // n_head
    kv_width = io(keys["k"])[1] if "k" in keys else q_width
    n_kv_head = kv_width // head_dim
    if kv_width % head_dim or n_kv_head == 0 or n_head % n_kv_head:
        raise UsageError(f"{where}: with {n_head} heads of width {head_dim} the keys' width {kv_width} is no "
                         "whole number of key/value heads dividing them: pass the model's head count (--heads N)")
    return Shape(n_layer, n_head, n_kv_head, n_embd)


def fits(layout: Layout, shapes: dict[str, list[int]]) -> bool:
    """Whether the weights have the layout's layer-0 keys, as matrices of its orientation: the queries read
    the residual stream W_O writes (this tells nanoGPT's nn.Linear from GPT-2's Conv1D under the same names)."""
    keys = layout.keys(0)
    if not all(k in shapes and len(shapes[k]) == 2 for k in keys.values()):
        return False
    q, o = shapes[keys["qkv"] if "qkv" in keys else keys["q"]], shapes[keys["o"]]
    return q[0] == o[1] if layout.orientation == "in_out" else q[1] == o[0]
