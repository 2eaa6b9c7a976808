"""Checksums of everything the store holds, verified on read, and durable small writes.

- Array chunks carry Zarr's own `crc32c` codec: 4 bytes of CRC-32C after each chunk, which Zarr (and
  replay's checkpoint reader) verify on every read.
- JSON documents the store writes (the manifest, the step log's and spikes' attributes, a checkpoint's
  shard index and commit record) are *sealed*: they hold the CRC-32C of their own canonical JSON.
- A checkpoint's commit record holds the CRC-32C of the raw bytes of every other JSON file of the
  checkpoint, so that not a byte of it goes unchecked.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np

from replay.errors import ChecksumError

try:
    from replay.store import _crc32c
except ImportError:   # a source tree whose C module is not built (`pip install -e .` builds it)
    _crc32c = None  # type: ignore[assignment]

SEAL = "crc32c"


def crc32c(data: bytes | np.ndarray | ctypes.Array[ctypes.c_char]) -> int:
    """CRC-32C of bytes, or of a contiguous array's or memory's bytes (read in place, never copied)."""
    return int(google_crc32c.value(data))


def crc32c_spans(spans: np.ndarray, out: np.ndarray) -> None:
    """The CRC-32C of each span of memory, the (address, length) rows of `spans` (int64, C order), into `out`
    (uint32, one per row): one call for all of them (_crc32c.c, the GIL released), which the memory must outlive."""
    if _crc32c is not None:
        _crc32c.spans(spans, out)
        return
    for i, (address, length) in enumerate(spans.tolist()):
        out[i] = crc32c((ctypes.c_char * length).from_address(address))


def canonical(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


def seal(doc: dict[str, Any]) -> dict[str, Any]:
    body = {k: v for k, v in doc.items() if k != SEAL}
    return {**body, SEAL: f"{crc32c(canonical(body)):08x}"}


def unseal(doc: dict[str, Any], what: str) -> dict[str, Any]:
    """The document without its seal, after checking it; `what` names it in the error."""
    body = {k: v for k, v in doc.items() if k != SEAL}
    if doc.get(SEAL) != f"{crc32c(canonical(body)):08x}":
        raise ChecksumError(f"{what} does not match its checksum: the store is corrupted there")
    return body


def write_file(path: Path, data: bytes, durable: bool, atomic: bool = True) -> None:
    """Write `data` to `path`: atomically (a temporary file renamed over it), unless the file is not read
    before something written after it says so; with `durable`, on disk (file and directory entry) before
    this returns."""
    tmp = path.with_name(f".{path.name}.tmp") if atomic else path
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    if atomic:
        os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_filesystem(path: Path) -> None:
    """Everything written to the filesystem holding `path` so far is on disk (Linux syncfs; else sync)."""
    if sys.platform.startswith("linux"):
        fd = os.open(path, os.O_RDONLY)
        try:
            if ctypes.CDLL(None, use_errno=True).syncfs(fd) == 0:
                return
        finally:
            os.close(fd)
    os.sync()


def group_json(attributes: dict[str, Any]) -> bytes:
    """A Zarr v3 group's metadata document (zarr.json) holding `attributes`."""
    # compact: with indent, json falls back to its pure-Python encoder (a shard's index is large)
    return json.dumps({"attributes": attributes, "zarr_format": 3, "node_type": "group"}, separators=(",", ":"),
                      allow_nan=True).encode()


def group_attributes(raw: bytes, what: str) -> dict[str, Any]:
    """The attributes of a group's zarr.json, given its raw bytes; a damaged document is named, not parsed wrong."""
    try:
        doc = json.loads(raw)
        if doc.get("node_type") != "group" or doc.get("zarr_format") != 3 or not isinstance(doc["attributes"], dict):
            raise ValueError("not a Zarr v3 group document")
    except (ValueError, KeyError, UnicodeDecodeError, AttributeError) as e:
        raise ChecksumError(f"{what} is damaged: {str(e).splitlines()[0]}") from None
    attributes: dict[str, Any] = doc["attributes"]
    return attributes
