"""A store in a local directory (or on a shared filesystem every node mounts): store/location.py's backend
for paths. Whole-file writes go to a temporary file renamed into place; an exclusive create is a hard link
of a complete temporary file; durability is fsync (store/integrity.py); chunks are written with writev
and read by mapping the files into memory (store/chunks.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
from zarr.storage import LocalStore

from replay.store.chunks import read_chunks, write_chunks
from replay.store.integrity import fsync_dir, sync_filesystem, write_file


class LocalBackend:
    def read(self, key: str) -> bytes | None:
        try:
            return Path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    def read_range(self, key: str, start: int, length: int) -> bytes | None:
        try:
            fd = os.open(key, os.O_RDONLY)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        try:
            return os.pread(fd, length, start)
        finally:
            os.close(fd)

    def size(self, key: str) -> int | None:
        path = Path(key)
        return path.stat().st_size if path.is_file() else None

    def write(self, key: str, data: bytes, durable: bool) -> None:
        path = Path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, data, durable)

    def create(self, key: str, data: bytes, durable: bool) -> bool:
        path = Path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        write_file(tmp, data, durable=durable, atomic=False)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            tmp.unlink()
        if durable:
            fsync_dir(path.parent)   # the new name, on disk
        return True

    def exists(self, key: str) -> bool:
        return Path(key).is_file()

    def children(self, key: str) -> list[str]:
        path = Path(key)
        return sorted(p.name for p in path.iterdir()) if path.is_dir() else []

    def remove_tree(self, key: str) -> None:
        path = Path(key)
        if path.is_dir():
            shutil.rmtree(path)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def holds_anything(self, key: str) -> bool:
        path = Path(key)   # empty folders, as a kill inside a write can leave, hold nothing
        return path.is_file() or any(not p.is_dir() for p in path.rglob("*"))

    def sync(self, key: str) -> None:
        sync_filesystem(Path(key))

    def zarr_store(self, key: str, read_only: bool) -> LocalStore:
        return LocalStore(key, read_only=read_only)

    def write_chunks(self, key: str, segments: list[tuple[int, np.ndarray]], n: int, chunk: int,
                     after_chunk: Callable[[int, int], object] | None) -> None:
        write_chunks(Path(key), segments, n, chunk, after_chunk)

    def read_chunks(self, key: str, first: int, last: int, chunk: int, what: str,
                    contents: Callable[[int], str]) -> np.ndarray:
        return read_chunks(Path(key), first, last, chunk, what, contents)


BACKEND = LocalBackend()
