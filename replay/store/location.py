"""Where a store lives: a local directory or a prefix in an S3 bucket, parsed once at the edge.

    loc = Location.parse("s3://runs/gpt2-spike")      # or a local path: Location.parse("runs/demo")
    raw = (loc / "zarr.json").read()                  # None where there is nothing
    (loc / "checkpoints" / "00000010" / "zarr.json").create(data)   # only if absent, atomically

A `Location` is a value (hashable, picklable, printed as its absolute path or its URL) that every layer
passes on; what it does goes to the backend of its scheme: store/local.py (files: atomic renames, fsync)
or store/s3.py (objects: conditional puts, multipart uploads). Nothing below the command line opens a
store from a string.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, Union

import numpy as np

from replay.errors import UsageError

if TYPE_CHECKING:
    from zarr.abc.store import Store

SCHEMES = ("s3",)   # besides local paths

# What the Python API (Loop, Recorder, RunStore.open) accepts as a store's location; the command line parses
# its arguments into a `Location` itself.
Where = Union["Location", str, "os.PathLike[str]"]


class Backend(Protocol):
    """What a scheme does for a location (store/local.py, store/s3.py). `key` is the location's key."""

    def read(self, key: str) -> bytes | None: ...
    def read_range(self, key: str, start: int, length: int) -> bytes | None: ...
    def size(self, key: str) -> int | None: ...
    def write(self, key: str, data: bytes, durable: bool) -> None: ...
    def create(self, key: str, data: bytes, durable: bool) -> bool: ...
    def exists(self, key: str) -> bool: ...
    def children(self, key: str) -> list[str]: ...
    def remove_tree(self, key: str) -> None: ...
    def holds_anything(self, key: str) -> bool: ...
    def sync(self, key: str) -> None: ...
    def zarr_store(self, key: str, read_only: bool) -> Store: ...
    def write_chunks(self, key: str, segments: list[tuple[int, np.ndarray]], n: int, chunk: int,
                     after_chunk: Callable[[int, int], object] | None) -> None: ...
    def read_chunks(self, key: str, first: int, last: int, chunk: int, what: str,
                    contents: Callable[[int], str]) -> np.ndarray: ...


@dataclass(frozen=True)
class Location:
    scheme: str     # "file" or "s3"
    bucket: str     # "" for a local directory
    key: str        # the absolute local path, or the object key prefix in the bucket (no "/" at either end)

    @classmethod
    def parse(cls, text: Where) -> Location:
        """A path or an s3://bucket/prefix URL; anything else is refused in one line."""
        if isinstance(text, Location):
            return text
        text = os.fspath(text)
        scheme, sep, rest = text.partition("://")
        if not sep:
            if not text:
                raise UsageError("a store location is empty: give a directory or s3://bucket/prefix")
            return cls("file", "", str(Path(text).expanduser().resolve()))
        if scheme not in SCHEMES:
            raise UsageError(f"{text}: a store lives in a local directory or at s3://bucket/prefix (S3 and "
                             f"S3-compatible servers); {scheme}:// is not supported")
        bucket, _, prefix = rest.partition("/")
        key = posixpath.normpath("/" + prefix).strip("/") if prefix.strip("/") else ""
        if not bucket or ".." in prefix.split("/"):
            raise UsageError(f"{text} is not a store URL: write s3://bucket/prefix")
        return cls(scheme, bucket, key)

    # -- naming ------------------------------------------------------------------------------------------

    def __str__(self) -> str:
        return self.key if self.scheme == "file" else f"{self.scheme}://{self.bucket}/{self.key}".rstrip("/")

    def __truediv__(self, part: str) -> Location:
        if self.scheme == "file":
            return Location("file", "", os.path.normpath(os.path.join(self.key, part)))
        return Location(self.scheme, self.bucket, posixpath.normpath(posixpath.join("/", self.key, part)).strip("/"))

    @property
    def name(self) -> str:
        return posixpath.basename(self.key) if self.scheme != "file" else os.path.basename(self.key)

    @property
    def parent(self) -> Location:
        return self / ".."

    @property
    def local(self) -> Path | None:
        """The directory, for a local location (None on an object store)."""
        return Path(self.key) if self.scheme == "file" else None

    def relative(self, start: Location) -> str:
        """This location as seen from `start` (a relative path when both share a root, else the whole URL):
        what a store records of another, so that a moved or copied store keeps its references."""
        if (self.scheme, self.bucket) != (start.scheme, start.bucket):
            return str(self)
        if self.scheme == "file":
            return os.path.relpath(self.key, start.key)
        return posixpath.relpath("/" + self.key, "/" + start.key)

    def resolve(self, reference: str) -> Location:
        """The location a store recorded as `reference` (`relative`'s result): a URL, or a path from here."""
        if "://" in reference or os.path.isabs(reference):   # `relative` across roots: the whole location
            return Location.parse(reference)
        return self / reference

    # -- contents (the scheme's backend) -----------------------------------------------------------------

    @property
    def backend(self) -> Backend:
        if self.scheme == "file":
            from replay.store import local  # lazy: a cycle (the backend builds on this module's type)

            return local.BACKEND
        from replay.store import s3  # lazy: obstore (and its client) only for a store on S3

        return s3.backend(self.bucket)

    def read(self) -> bytes | None:
        """The whole object or file; None where there is none."""
        return self.backend.read(self.key)

    def read_range(self, start: int, length: int) -> bytes | None:
        """Bytes [start, start + length) of the object or file (fewer at its end); None where there is none."""
        return self.backend.read_range(self.key, start, length)

    def size(self) -> int | None:
        """The object's or file's size in bytes; None where there is none."""
        return self.backend.size(self.key)

    def write(self, data: bytes, durable: bool = False) -> None:
        """Replace the object or file whole: a reader sees the old bytes or the new, never part of them
        (with `durable`, on disk before this returns; an object store's put always is)."""
        self.backend.write(self.key, data, durable)

    def create(self, data: bytes, durable: bool = True) -> bool:
        """Write the object or file only if there is none, atomically; False if there is one (with `durable`,
        on disk before this returns)."""
        return self.backend.create(self.key, data, durable)

    def exists(self) -> bool:
        """An object or file is here (not a folder or prefix)."""
        return self.backend.exists(self.key)

    def children(self) -> list[str]:
        """The names directly below this location (files and folders, objects and prefixes), sorted."""
        return self.backend.children(self.key)

    def remove_tree(self) -> None:
        """Remove everything at and below this location."""
        self.backend.remove_tree(self.key)

    def holds_anything(self) -> bool:
        """A file or object is here or below (an object store's server may list a prefix emptied a moment ago,
        or keep it as a folder, as SeaweedFS does)."""
        return self.backend.holds_anything(self.key)

    def sync(self) -> None:
        """Everything written below this location so far is durable (a local filesystem's flush)."""
        self.backend.sync(self.key)

    def zarr_store(self, read_only: bool) -> Store:
        """A Zarr store rooted here."""
        return self.backend.zarr_store(self.key, read_only)

    def write_chunks(self, segments: list[tuple[int, np.ndarray]], n: int, chunk: int,
                     after_chunk: Callable[[int, int], object] | None = None) -> None:
        """Chunks 0..n-1 of the Zarr byte array here (store/chunks.py says their form)."""
        self.backend.write_chunks(self.key, segments, n, chunk, after_chunk)

    def read_chunks(self, first: int, last: int, chunk: int, what: str,
                    contents: Callable[[int], str] = lambda i: "") -> np.ndarray:
        """Chunks first..last of the Zarr byte array here as one array, every checksum verified."""
        return self.backend.read_chunks(self.key, first, last, chunk, what, contents)

