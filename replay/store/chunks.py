"""A checkpoint's bytes as the chunks of a Zarr array, written and read without an extra copy.

The array is one-dimensional uint8 with Zarr's codecs `bytes` then `crc32c`: each chunk file
(`<array>/c/<i>`) is the chunk's bytes followed by their CRC-32C, exactly what Zarr itself writes, so
any Zarr reader opens it (and verifies it). Writing it here instead of through Zarr saves the copies
Zarr's codec pipeline makes (it appends the checksum to a new buffer) and lets chunks be written
straight from the tensors' own memory, several at once (the writes release the GIL).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from replay.errors import ChecksumError
from replay.store.integrity import crc32c

CHUNK_BYTES = 16 << 20   # the unit of a partial read
THREADS = 2              # chunk files written or read at once


def chunking(size: int) -> tuple[int, int]:
    """(chunks, bytes per chunk) for `size` bytes: chunks of equal size, a whole number of memory pages (so
    that they map side by side), so that only the last one carries (fewer than a page x chunks) bytes of
    zero padding."""
    n = max(1, -(-size // CHUNK_BYTES))
    return n, max(mmap.PAGESIZE, -(-size // n // mmap.PAGESIZE) * mmap.PAGESIZE)


def put_chunks(put: Callable[[int, list[memoryview | bytes]], object], segments: list[tuple[int, np.ndarray]],
               n: int, chunk: int, after_chunk: Callable[[int, int], object] | None = None) -> None:
    """Chunks 0..n-1 of the bytes given as (offset, uint8 array) segments (gaps and the tail are zero), each
    handed to `put(i, [its bytes, their CRC-32C])`, several at once. `after_chunk(i, n)` runs once the i-th
    chunk to finish is put."""
    scratch = threading.local()
    done = 0
    lock = threading.Lock()

    def write(i: int) -> None:
        nonlocal done
        data = chunk_bytes(segments, i * chunk, chunk, scratch)
        put(i, [data.data, crc32c(data).to_bytes(4, "little")])
        with lock:
            done += 1
            if after_chunk:
                after_chunk(done, n)

    each(write, range(n))


def write_chunks(array_dir: Path, segments: list[tuple[int, np.ndarray]], n: int, chunk: int,
                 after_chunk: Callable[[int, int], object] | None = None) -> None:
    """`put_chunks` into the chunk files `array_dir/c/<i>`."""
    chunk_dir = array_dir / "c"
    chunk_dir.mkdir(parents=True, exist_ok=True)

    def put(i: int, buffers: list[memoryview | bytes]) -> None:
        fd = os.open(chunk_dir / str(i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, buffers)
        finally:
            os.close(fd)

    put_chunks(put, segments, n, chunk, after_chunk)


def chunk_bytes(segments: list[tuple[int, np.ndarray]], lo: int, size: int, scratch: threading.local) -> np.ndarray:
    """Bytes [lo, lo + size): a view of one segment when it covers them all, else gathered into this
    thread's scratch buffer."""
    hi = lo + size
    parts = [(o, a) for o, a in segments if o < hi and o + len(a) > lo]
    if len(parts) == 1 and parts[0][0] <= lo and parts[0][0] + len(parts[0][1]) >= hi:
        o, a = parts[0]
        return a[lo - o: hi - o]
    buf = getattr(scratch, "buffer", None)
    if buf is None or len(buf) != size:
        buf = scratch.buffer = np.empty(size, dtype=np.uint8)
    buf[:] = 0
    for o, a in parts:
        start, stop = max(lo, o), min(hi, o + len(a))
        buf[start - lo: stop - lo] = a[start - o: stop - o]
    return buf


def _write_all(fd: int, buffers: list[memoryview | bytes]) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        written = os.writev(fd, views)
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


def read_chunks(array_dir: Path, first: int, last: int, chunk: int, what: str,
                contents: Callable[[int], str] = lambda i: "") -> np.ndarray:
    """Chunks first..last (inclusive) as one array, each verified against its CRC-32C. `what` names the
    array, and `contents(i)` what chunk i holds, in the error a damaged or missing chunk raises.

    The chunk files are mapped into memory side by side (copy-on-write: writing to the array or to a
    tensor viewing it never reaches the files), not copied: a checkpoint just written is read straight
    from the page cache, and nothing is allocated for it until a tensor of it is written to."""
    mapping = _Mapping((last - first + 1) * chunk)
    for i in range(first, last + 1):
        path = array_dir / "c" / str(i)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise ChecksumError(f"{what} chunk {i}{contents(i)} is missing ({path}): the store is corrupted "
                                "there") from None
        try:
            if os.fstat(fd).st_size != chunk + 4:   # never map past the end of a file: reading there is SIGBUS
                raise ChecksumError(f"{what} chunk {i}{contents(i)} has {os.fstat(fd).st_size} bytes, not "
                                    f"{chunk + 4} ({path}): the store is corrupted there")
            mapping.map_file((i - first) * chunk, fd, chunk)
            trailer = os.pread(fd, 4, chunk)
        finally:
            os.close(fd)
        data = mapping.array[(i - first) * chunk: (i - first + 1) * chunk]
        if crc32c(data) != int.from_bytes(trailer, "little"):
            raise ChecksumError(f"{what} chunk {i}{contents(i)} does not match its checksum ({path}): the "
                                "store is corrupted there")
    return mapping.array


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FIXED = 0x10   # the same on Linux and macOS; Python's mmap module does not export it
_PROT_NONE = 0


class _Mapping:
    """A range of addresses into which files are mapped side by side; unmapped once the last array (or
    tensor) viewing it is gone."""

    def __init__(self, size: int):
        self.size = size
        self.addr = _libc.mmap(None, size, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if self.addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"cannot reserve {size} bytes of address space")
        view = (ctypes.c_uint8 * size).from_address(self.addr)
        # the array below keeps `view` alive, and `view` keeps the mapping (ctypes instances take attributes;
        # typeshed does not declare them)
        view.owner = self   # type: ignore[attr-defined]
        self.array = np.ctypeslib.as_array(view)

    def map_file(self, offset: int, fd: int, length: int) -> None:
        """Bytes [0, length) of the file over bytes [offset, offset + length) of the range."""
        want = self.addr + offset
        got = _libc.mmap(want, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | _MAP_FIXED, fd, 0)
        if got != want:
            raise OSError(ctypes.get_errno(), "cannot map a chunk file")

    def __del__(self) -> None:
        _libc.munmap(self.addr, self.size)


def each(fn: Callable[[int], None], items: range, threads: int = THREADS) -> None:
    """fn(i) for every i, `threads` at a time (I/O and copies release the GIL); inline for one."""
    if len(items) == 1:
        fn(items[0])
        return
    with ThreadPoolExecutor(min(threads, len(items))) as pool:
        list(pool.map(fn, items))
