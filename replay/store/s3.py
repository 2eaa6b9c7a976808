"""A store at s3://bucket/prefix, on S3 or an S3-compatible server: store/location.py's backend for objects,
through obstore (zarr's `ObjectStore` for the Zarr arrays).

Configured by the standard variables only: AWS_ENDPOINT_URL (an S3-compatible server), AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION. Plain HTTP is allowed for an endpoint on this machine
(127.0.0.1, localhost); elsewhere only with AWS_ALLOW_HTTP=true.

An object store has no rename, no fsync and no directory: a put replaces an object whole (a reader sees
the old object or the new one), so whole-document writes need no temporary; `create` is a put with
If-None-Match (PutMode "create"), atomic at the server; a chunk of 16 MiB goes up in parallel parts; a
folder is a key prefix, and listing one is a delimiter listing.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import numpy as np
import obstore
from obstore import exceptions as ox
from obstore.store import S3Store
from zarr.storage import ObjectStore

from replay.errors import ChecksumError, StoreError
from replay.store.chunks import THREADS, each, put_chunks
from replay.store.integrity import crc32c

if TYPE_CHECKING:
    from obstore.store import ClientConfig, RetryConfig

PART_BYTES = 8 << 20        # a chunk above this goes up as a multipart upload, its parts in parallel
PART_CONCURRENCY = 4
_LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


# the configuration a process needs to reach the store (a Ray cluster's workers get it from the driver)
ENV_VARS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION",
            "AWS_ALLOW_HTTP", "REPLAY_S3_RETRY_SECONDS")


def configuration() -> dict[str, str]:
    """The variables of ENV_VARS this process has."""
    return {name: os.environ[name] for name in ENV_VARS if name in os.environ}


def endpoint() -> str:
    return os.environ.get("AWS_ENDPOINT_URL", "") or "AWS S3"


def _client_options() -> ClientConfig:
    url = os.environ.get("AWS_ENDPOINT_URL", "")
    if urlparse(url).scheme != "http":
        return {}
    if urlparse(url).hostname in _LOCAL_HOSTS or os.environ.get("AWS_ALLOW_HTTP", "").lower() == "true":
        return {"allow_http": True}
    raise StoreError(f"AWS_ENDPOINT_URL={url} is plain HTTP to another machine, which would send the credentials "
                     "in the clear: use https, or set AWS_ALLOW_HTTP=true if that network is yours")


def _retry(seconds: float | None = None) -> RetryConfig:
    # a server restarting (or a network blip) is waited out for this long before an operation fails
    seconds = float(os.environ.get("REPLAY_S3_RETRY_SECONDS", "60")) if seconds is None else seconds
    return {"max_retries": 100, "retry_timeout": timedelta(seconds=seconds),
            "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=2),
                        "base": 2.0}}


def _s3(bucket: str, prefix: str | None = None, retry_seconds: float | None = None) -> S3Store:
    try:
        return S3Store(bucket, prefix=prefix or None, client_options=_client_options(),
                       retry_config=_retry(retry_seconds))
    except (ValueError, ox.BaseError) as e:
        raise StoreError(f"cannot configure S3 for bucket {bucket}: {str(e).splitlines()[0]} (set "
                         "AWS_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and, for another server, "
                         "AWS_ENDPOINT_URL)") from None


@contextlib.contextmanager
def errors(bucket: str, key: str) -> Iterator[None]:
    """An S3 failure as one line naming the object and what to do."""
    where = f"s3://{bucket}/{key}"
    try:
        yield
    except (ox.UnauthenticatedError, ox.PermissionDeniedError) as e:
        raise StoreError(f"{endpoint()} refused access to {where} ({_first(e)}): check AWS_ACCESS_KEY_ID and "
                         "AWS_SECRET_ACCESS_KEY") from None
    except (FileNotFoundError, ox.NotFoundError, ox.AlreadyExistsError, ox.PreconditionError):
        raise
    except ox.BaseError as e:
        raise StoreError(_explain(e, bucket, f"cannot reach {where} on {endpoint()}")) from None


def _explain(e: BaseException, bucket: str, otherwise: str) -> str:
    if "NoSuchBucket" in str(e):
        return f"bucket {bucket} does not exist on {endpoint()}: create it first"
    if "169.254.169.254" in str(e):   # no key in the environment, so obstore asked for an instance's role
        return (f"no S3 credentials for bucket {bucket}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and "
                "AWS_ENDPOINT_URL for a server other than AWS)")
    if isinstance(e, ox.GenericError) and "retries" in str(e):
        seconds = os.environ.get("REPLAY_S3_RETRY_SECONDS", "60")
        return (f"{otherwise}: the server did not answer for {seconds} s (REPLAY_S3_RETRY_SECONDS) ({_first(e)}): "
                "check that it is up; what was committed is intact: run the command again (`replay record` and "
                "`replay run` with --resume)")
    return f"{otherwise}: {_first(e)}"


def _probe(bucket: str) -> None:
    """Fail in one line, within seconds, where the endpoint cannot be reached at all (a mistyped address):
    once reached, a server that goes away is waited out for REPLAY_S3_RETRY_SECONDS."""
    try:
        seconds = min(8.0, float(os.environ.get("REPLAY_S3_RETRY_SECONDS", "60")))
        obstore.head(_s3(bucket, retry_seconds=seconds), ".replay-probe")
    except (FileNotFoundError, ox.NotFoundError, ox.PermissionDeniedError, ox.UnauthenticatedError):
        pass   # an answer: the server is there
    except ox.BaseError as e:
        raise StoreError(_explain(e, bucket, f"cannot reach the S3 endpoint {endpoint()} for bucket {bucket} "
                                             "(check AWS_ENDPOINT_URL)")) from None


def _first(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:300]


class S3Backend:
    def __init__(self, bucket: str):
        self.bucket = bucket
        _probe(bucket)
        self.store = _s3(bucket)

    def read(self, key: str) -> bytes | None:
        with errors(self.bucket, key):
            try:
                return bytes(obstore.get(self.store, key).bytes())
            except (FileNotFoundError, ox.NotFoundError):
                return None

    def read_range(self, key: str, start: int, length: int) -> bytes | None:
        if length <= 0:
            return b"" if self.exists(key) else None
        with errors(self.bucket, key):
            try:
                return bytes(obstore.get_range(self.store, key, start=start, length=length))
            except (FileNotFoundError, ox.NotFoundError):
                return None

    def size(self, key: str) -> int | None:
        head = self.head(key)
        return None if head is None else int(head["size"])

    def write(self, key: str, data: bytes, durable: bool) -> None:
        with errors(self.bucket, key):
            obstore.put(self.store, key, data)

    def create(self, key: str, data: bytes, durable: bool) -> bool:
        with errors(self.bucket, key):
            try:
                obstore.put(self.store, key, data, mode="create")
            except (ox.AlreadyExistsError, ox.PreconditionError):
                return False
        return True

    def create_versioned(self, key: str, data: bytes) -> str | None:
        """`create`, returning the new object's e_tag (None if there was one already)."""
        with errors(self.bucket, key):
            try:
                return str(obstore.put(self.store, key, data, mode="create")["e_tag"])
            except (ox.AlreadyExistsError, ox.PreconditionError):
                return None

    def head(self, key: str) -> dict[str, Any] | None:
        """An object's size, e_tag and last_modified; None where there is none."""
        with errors(self.bucket, key):
            try:
                return dict(obstore.head(self.store, key))
            except (FileNotFoundError, ox.NotFoundError):
                return None

    def read_versioned(self, key: str) -> tuple[bytes, str, float] | None:
        """An object's bytes, its e_tag and the server's time of its last write; None where there is none."""
        with errors(self.bucket, key):
            try:
                got = obstore.get(self.store, key)
                return bytes(got.bytes()), str(got.meta["e_tag"]), got.meta["last_modified"].timestamp()
            except (FileNotFoundError, ox.NotFoundError):
                return None

    def replace(self, key: str, data: bytes, e_tag: str) -> str | None:
        """Put `data` only if the object still has `e_tag` (If-Match); its new e_tag, or None if it changed."""
        with errors(self.bucket, key):
            try:
                return str(obstore.put(self.store, key, data, mode={"e_tag": e_tag})["e_tag"])
            except (ox.PreconditionError, FileNotFoundError, ox.NotFoundError):
                return None

    def delete(self, key: str) -> None:
        with errors(self.bucket, key), contextlib.suppress(FileNotFoundError, ox.NotFoundError):
            obstore.delete(self.store, key)

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    def children(self, key: str) -> list[str]:
        prefix = key + "/" if key else ""
        with errors(self.bucket, key):
            listing = obstore.list_with_delimiter(self.store, prefix or None)
        names = [p[len(prefix):].strip("/") for p in listing["common_prefixes"]]
        names += [o["path"][len(prefix):] for o in listing["objects"]]
        return sorted(n for n in names if n)

    def holds_anything(self, key: str) -> bool:
        with errors(self.bucket, key):
            first = next(iter(obstore.list(self.store, key + "/", chunk_size=1)), [])
        return bool(first) or self.exists(key)

    def remove_tree(self, key: str) -> None:
        with errors(self.bucket, key):
            keys = [o["path"] for batch in obstore.list(self.store, key + "/") for o in batch]
            if self.exists(key):
                keys.append(key)
            for i in range(0, len(keys), 1000):
                obstore.delete(self.store, keys[i:i + 1000])

    def sync(self, key: str) -> None:
        """Nothing to do: a put has returned only once the object is stored."""

    def zarr_store(self, key: str, read_only: bool) -> ObjectStore[S3Store]:
        return ObjectStore(_s3(self.bucket, key), read_only=read_only)

    def write_chunks(self, key: str, segments: list[tuple[int, np.ndarray]], n: int, chunk: int,
                     after_chunk: Callable[[int, int], object] | None) -> None:
        """Chunk objects `<key>/c/<i>`: the bytes then their CRC-32C, as Zarr's crc32c codec writes them, each
        uploaded in parallel parts (from the tensors' own memory where one segment covers the chunk)."""
        def put(i: int, buffers: list[memoryview | bytes]) -> None:
            with errors(self.bucket, f"{key}/c/{i}"):
                obstore.put(self.store, f"{key}/c/{i}", buffers, chunk_size=PART_BYTES,
                            max_concurrency=PART_CONCURRENCY)

        put_chunks(put, segments, n, chunk, after_chunk)

    def read_chunks(self, key: str, first: int, last: int, chunk: int, what: str,
                    contents: Callable[[int], str]) -> np.ndarray:
        out = np.empty((last - first + 1) * chunk, dtype=np.uint8)

        def read(i: int) -> None:
            where = f"s3://{self.bucket}/{key}/c/{i}"
            with errors(self.bucket, f"{key}/c/{i}"):
                try:
                    raw = obstore.get(self.store, f"{key}/c/{i}").bytes()
                except (FileNotFoundError, ox.NotFoundError):
                    raise ChecksumError(f"{what} chunk {i}{contents(i)} is missing ({where}): the store is "
                                        "corrupted there") from None
            got = np.frombuffer(memoryview(raw), dtype=np.uint8)
            if len(got) != chunk + 4:
                raise ChecksumError(f"{what} chunk {i}{contents(i)} has {len(got)} bytes, not {chunk + 4} "
                                    f"({where}): the store is corrupted there")
            data = out[(i - first) * chunk: (i - first + 1) * chunk]
            data[:] = got[:chunk]
            if crc32c(data) != int.from_bytes(got[chunk:].tobytes(), "little"):
                raise ChecksumError(f"{what} chunk {i}{contents(i)} does not match its checksum ({where}): the "
                                    "store is corrupted there")

        each(read, range(first, last + 1), threads=THREADS * 2)
        return out


def backend(bucket: str) -> S3Backend:
    """The bucket's backend (one client per bucket and configuration, kept for the process)."""
    return _backend(bucket, tuple(os.environ.get(name, "") for name in ENV_VARS))


@functools.cache
def _backend(bucket: str, config: tuple[str, ...]) -> S3Backend:
    return S3Backend(bucket)
