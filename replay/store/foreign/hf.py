"""transformers Trainer checkpoints: `checkpoint-<step>` folders, each with config.json and the model's
safetensors (one `model.safetensors`, or `model.safetensors.index.json` and its shards), and usually
trainer_state.json.

A safetensors file is 8 bytes (the header's length, little-endian), a JSON header naming each tensor's
dtype, shape and byte range, then the bytes: a file or an object is read as its header, then only the
asked tensors' byte ranges.
"""

from __future__ import annotations

import json
import re
from typing import Any

from replay.errors import StoreError, UsageError
from replay.store.foreign.base import ForeignCheckpoint, digest, object_tag, sampled_digest
from replay.store.location import Location

CHECKPOINT = re.compile(r"checkpoint-(\d+)$")
CONFIG, STATE = "config.json", "trainer_state.json"
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json")
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
           "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}

Header = dict[str, dict[str, Any]]      # tensor name -> {"dtype", "shape", "data_offsets"}


def is_checkpoint(loc: Location) -> bool:
    return (loc / CONFIG).exists() and any((loc / name).exists() for name in (SINGLE, INDEX, *PICKLED))


def checkpoint_names(children: list[str], loc: Location) -> list[str]:
    return [c for c in children if CHECKPOINT.search(c) and (loc / c / CONFIG).exists()]


def json_of(loc: Location) -> dict[str, Any] | None:
    raw = loc.read()
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StoreError(f"{loc} is not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise StoreError(f"{loc} is not a JSON object")
    return doc


def weight_files(loc: Location) -> dict[str, str]:
    """Each tensor's safetensors file in the checkpoint folder `loc`, by tensor name (None: a single file,
    whose header names them)."""
    index = json_of(loc / INDEX)
    if index is not None:
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise StoreError(f"{loc / INDEX} has no weight_map")
        return {str(k): str(v) for k, v in weight_map.items()}
    if (loc / SINGLE).exists():
        return {}
    raise UsageError(f"{loc} holds its weights as a pickle ({' or '.join(PICKLED)}), which is not read: save "
                     "them as safetensors (save_pretrained's and the Trainer's default, save_safetensors=True)")


def _files(loc: Location) -> list[str]:
    return sorted(set(weight_files(loc).values())) or [SINGLE]


def checkpoint(loc: Location) -> ForeignCheckpoint:
    named = CHECKPOINT.search(loc.name)
    step = int(named.group(1)) if named else None
    state = json_of(loc / STATE)
    saved = state.get("global_step") if state else None
    if step is None:
        if not isinstance(saved, int):
            raise UsageError(f"{loc} is a checkpoint with no step: its folder is not named checkpoint-<step> and "
                             f"it has no {STATE} with a global_step")
        step = saved
    elif isinstance(saved, int) and saved != step:
        raise StoreError(f"{loc}: its {STATE} says global_step {saved}, its name step {step}")
    tags = []
    for name in _files(loc):
        f = loc / name
        if f.local is None:
            tags.append(object_tag(f))
        else:
            raw = _header(f)[0]
            tags.append(f"{digest(raw)}:{sampled_digest(f.local, len(raw))}")
    return ForeignCheckpoint(step, loc, digest((loc / INDEX).read() or b"", *tags))


def losses(state: dict[str, Any] | None) -> dict[int, float]:
    """The training losses trainer_state.json logged: the loss logged at global step s (the mean over the
    logging interval) is that of step s - 1 counted from 0, the last it covers (replay's step log's steps)."""
    out = {}
    for entry in (state or {}).get("log_history", []):
        loss, step = (entry.get("loss"), entry.get("step")) if isinstance(entry, dict) else (None, None)
        if isinstance(loss, int | float) and isinstance(step, int):
            out[step - 1] = float(loss)
    return out


# -- safetensors -------------------------------------------------------------------------------------------

def _parse(prefix: bytes, size: int, where: Location) -> tuple[int, Header]:
    """The header's length and the header, from the file's first bytes (at least 8 + the header)."""
    if len(prefix) < 8:
        raise StoreError(f"{where} is truncated or not a safetensors file ({size} bytes)")
    n = int.from_bytes(prefix[:8], "little")
    if 8 + n > size:
        raise StoreError(f"{where} is truncated or not a safetensors file (a header of {n} bytes in {size})")
    try:
        header = json.loads(prefix[8:8 + n])
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise StoreError(f"{where} is not a safetensors file (its header is not JSON)") from None
    header.pop("__metadata__", None)
    data = size - 8 - n
    for name, t in header.items():
        begin, end = t["data_offsets"]
        if end > data:
            raise StoreError(f"{where} is truncated: {name} ends at byte {end} of its data, which holds {data}")
        if t["dtype"] not in _DTYPES:
            raise StoreError(f"{where}: {name} has dtype {t['dtype']}, which is not read")
    return n, header


def _header(f: Location) -> tuple[bytes, int, Header]:
    """A safetensors file's raw header (the length and the JSON), the length of its JSON and the header,
    checked against the file's size; read alone, from a file or an object alike."""
    size = f.size()
    if size is None:
        raise StoreError(f"{f} is missing")
    head = f.read_range(0, 8) or b""
    n = int.from_bytes(head, "little") if len(head) == 8 else 0
    raw = head + ((f.read_range(8, min(n, size - 8)) or b"") if 0 < n else b"")
    return raw, *_parse(raw, size, f)


def header(f: Location) -> Header:
    return _header(f)[2]


def shapes(loc: Location) -> dict[str, list[int]]:
    out = {}
    for name in _files(loc):
        out.update({k: list(t["shape"]) for k, t in header(loc / name).items()})
    return out


def read(loc: Location, names: list[str]) -> dict[str, Any]:
    import torch  # lazy: torch (0.7 s), only where tensors are read

    where = weight_files(loc)
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(where.get(name, SINGLE) if where else SINGLE, []).append(name)
    out = {}
    for file, wanted in by_file.items():
        f = loc / file
        _, n, head = _header(f)
        chunks = {}
        for name in wanted:
            if name not in head:
                raise StoreError(f"{f} holds no tensor {name}")
            begin, end = head[name]["data_offsets"]
            buf = bytearray(f.read_range(8 + n + begin, end - begin) or b"")
            if len(buf) != end - begin:
                raise StoreError(f"{f} is truncated: {name} is cut short")
            chunks[name] = buf
        for name, buf in chunks.items():
            t = head[name]
            dtype = getattr(torch, _DTYPES[t["dtype"]])
            out[name] = (torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)).reshape(t["shape"])
    return out
