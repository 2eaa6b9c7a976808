"""The S3 backend (store/s3.py) against a real S3 server (SeaweedFS on 127.0.0.1, tests/s3server.py):
whole objects, exclusive creates, listings, checksummed chunks, conditional puts, and a server that goes
away for good or for a moment."""

from __future__ import annotations

import threading
import time

import numpy as np
import obstore
import pytest

from replay.errors import ChecksumError, StoreError
from replay.store import s3
from replay.store.location import Location
from tests.s3server import S3Server


def test_an_object_reads_back_as_written_and_a_missing_one_reads_as_none(s3_store):
    doc = s3_store / "checkpoints" / "00000010" / "zarr.json"
    assert doc.read() is None and not doc.exists()
    doc.write(b'{"step": 10}')
    assert doc.read() == b'{"step": 10}' and doc.exists()
    doc.write(b'{"step": 11}', durable=True)
    assert doc.read() == b'{"step": 11}'
    assert not (s3_store / "checkpoints").exists()   # a prefix is not an object


def test_a_range_and_a_size_read_only_what_is_asked(s3_store):
    f = s3_store / "blob"
    assert f.size() is None and f.read_range(0, 4) is None
    f.write(bytes(range(100)))
    assert f.size() == 100 and f.read_range(10, 5) == bytes(range(10, 15))
    assert f.read_range(95, 10) == bytes(range(95, 100))


def test_create_writes_only_where_there_is_nothing(s3_store):
    doc = s3_store / "lease.json"
    assert doc.create(b"first") is True
    assert doc.create(b"second") is False
    assert doc.read() == b"first"


def test_of_eight_threads_creating_one_object_exactly_one_wins(s3_store):
    doc = s3_store / "commit"
    start = threading.Barrier(8)
    won: dict[int, bool] = {}

    def race(i: int) -> None:
        start.wait()
        won[i] = doc.create(f"writer {i}".encode())

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, w in won.items() if w]
    assert len(won) == 8 and len(winners) == 1, won
    assert doc.read() == f"writer {winners[0]}".encode()


def test_children_are_the_objects_and_prefixes_directly_below_sorted(s3_store):
    for key in ("runs/b", "runs/a", "runs/sub/x", "runs/sub/deeper/y", "runs/zz/z", "top", "runs2/w"):
        (s3_store / key).write(b"-")
    assert s3_store.children() == ["runs", "runs2", "top"]
    assert (s3_store / "runs").children() == ["a", "b", "sub", "zz"]
    assert (s3_store / "runs" / "sub").children() == ["deeper", "x"]
    assert (s3_store / "nothing").children() == []


def test_remove_tree_removes_a_prefix_and_nothing_beside_it(s3_server, s3_store):
    for key in ("run/a", "run/sub/b", "run", "run2/c", "other"):
        (s3_store / key).write(b"-")
    (s3_store / "run").remove_tree()
    # every object, listed without a delimiter: SeaweedFS keeps an emptied prefix in a delimited listing
    # until it sweeps empty folders (seaweedfs#9810), which S3 itself never shows
    left = [o["path"] for batch in obstore.list(s3_server.client(), s3_store.key + "/") for o in batch]
    assert sorted(left) == [f"{s3_store.key}/other", f"{s3_store.key}/run2/c"]
    assert (s3_store / "run" / "sub" / "b").read() is None and not (s3_store / "run").exists()


CHUNK = s3.PART_BYTES + (1 << 20)   # every chunk goes up in two parts


def _segments(rng: np.random.Generator, n: int) -> tuple[list[tuple[int, np.ndarray]], np.ndarray]:
    """Two tensors' bytes with a gap between them and zeros after them, and the whole array they make."""
    a = rng.integers(0, 256, CHUNK // 2, dtype=np.uint8)
    b = rng.integers(0, 256, CHUNK * (n - 1) - 4096, dtype=np.uint8)
    whole = np.zeros(n * CHUNK, dtype=np.uint8)
    whole[:len(a)] = a
    whole[CHUNK - 100: CHUNK - 100 + len(b)] = b
    return [(0, a), (CHUNK - 100, b)], whole


def test_chunks_read_back_as_written_whole_and_in_part_each_in_multipart_objects(s3_server, s3_store):
    segments, whole = _segments(np.random.default_rng(0), 3)
    array = s3_store / "tensors"
    finished: list[tuple[int, int]] = []
    array.write_chunks(segments, 3, CHUNK, lambda i, n: finished.append((i, n)))
    assert sorted(finished) == [(1, 3), (2, 3), (3, 3)]
    assert np.array_equal(array.read_chunks(0, 2, CHUNK, "tensors"), whole)
    assert np.array_equal(array.read_chunks(1, 2, CHUNK, "tensors"), whole[CHUNK:])
    assert np.array_equal(array.read_chunks(1, 1, CHUNK, "tensors"), whole[CHUNK:2 * CHUNK])
    meta = obstore.head(s3_server.client(), f"{array.key}/c/1")
    assert meta["size"] == CHUNK + 4 and str(meta["e_tag"]).strip('"').endswith("-2")   # two parts


def test_a_flipped_bit_or_a_missing_chunk_is_a_checksum_error_naming_the_chunk(s3_server, s3_store):
    segments, _ = _segments(np.random.default_rng(1), 3)
    array = s3_store / "tensors"
    array.write_chunks(segments, 3, CHUNK, None)
    client = s3_server.client()
    key = f"{array.key}/c/1"
    data = bytearray(obstore.get(client, key).bytes())
    data[12345] ^= 0x10
    obstore.put(client, key, bytes(data))
    with pytest.raises(ChecksumError, match=r"tensors chunk 1 does not match its checksum \(s3://.*/c/1\)"):
        array.read_chunks(0, 2, CHUNK, "tensors")
    assert len(array.read_chunks(2, 2, CHUNK, "tensors")) == CHUNK   # the others still read

    obstore.delete(client, f"{array.key}/c/2")
    with pytest.raises(ChecksumError, match=r"tensors chunk 2 \(model\) is missing \(s3://.*/c/2\)"):
        array.read_chunks(2, 2, CHUNK, "tensors", lambda i: " (model)")


def test_a_conditional_put_succeeds_only_on_the_version_it_read(s3_store):
    backend = s3.backend(s3_store.bucket)
    key = f"{s3_store.key}/lease.json"
    assert backend.read_versioned(key) is None and backend.head(key) is None
    backend.write(key, b"holder: a", durable=False)
    data, tag, written = backend.read_versioned(key)
    assert data == b"holder: a" and abs(written - time.time()) < 60
    new_tag = backend.replace(key, b"holder: b", tag)
    assert new_tag is not None and new_tag != tag
    assert backend.replace(key, b"holder: c", tag) is None   # stale: someone wrote since
    assert backend.read(key) == b"holder: b"
    head = backend.head(key)
    assert head is not None and head["e_tag"] == new_tag and head["size"] == len(b"holder: b")
    backend.delete(key)
    assert backend.replace(key, b"holder: d", new_tag) is None and backend.read(key) is None
    backend.delete(key)   # deleting what is not there is no error


def test_a_server_gone_for_good_is_one_store_error_naming_it_within_the_retry_bound(tmp_path, monkeypatch):
    gone = S3Server(tmp_path / "gone")
    gone.start()
    try:
        for name, value in gone.env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("REPLAY_S3_RETRY_SECONDS", "3")
        doc = Location.parse(f"s3://{gone.bucket}/run/zarr.json")   # a new endpoint: a client with that bound
        doc.write(b"{}")
    finally:
        gone.kill()
    for operation in (doc.read, lambda: doc.write(b"{}")):
        t = time.monotonic()
        with pytest.raises(StoreError) as raised:
            operation()
        took = time.monotonic() - t
        message = str(raised.value)
        assert "\n" not in message and gone.endpoint in message and "s3://replay-tests/run/zarr.json" in message
        assert 2 < took < 10, took


def test_a_write_the_server_restarts_under_completes_and_reads_back_equal(s3_server, s3_store):
    n = 8
    data = np.random.default_rng(2).integers(0, 256, n * CHUNK, dtype=np.uint8)
    array = s3_store / "tensors"
    first_done = threading.Event()
    done: list[int] = []
    failed: list[BaseException] = []

    def after(i: int, total: int) -> None:
        done.append(i)
        first_done.set()

    def write() -> None:
        try:
            array.write_chunks([(0, data)], n, CHUNK, after)
        except BaseException as e:
            failed.append(e)

    writer = threading.Thread(target=write)
    writer.start()
    assert first_done.wait(60)
    s3_server.kill()
    at_kill = len(done)
    try:
        time.sleep(1.5)
    finally:
        s3_server.start()
    writer.join(60)
    assert not writer.is_alive() and not failed, failed
    assert at_kill < n, "the write finished before the server went down"
    assert len(done) == n
    assert np.array_equal(array.read_chunks(0, n - 1, CHUNK, "tensors"), data)
