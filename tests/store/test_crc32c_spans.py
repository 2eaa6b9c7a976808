"""The C module's CRC-32C (store/_crc32c.c): every implementation this CPU has, and the per-span fallback, give
google-crc32c's values."""

import ctypes

import google_crc32c
import numpy as np
import pytest

from replay.store import _crc32c, integrity

DATA = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes()
LENGTHS = [*range(0, 300), 511, 512, 513, 1023, 1024, 1025, 4095, 4096, 4097, 65000]


def test_software_is_always_there_and_the_best_comes_last():
    assert _crc32c.paths[0] == "software" and _crc32c.best == _crc32c.paths[-1]


@pytest.mark.parametrize("path", _crc32c.paths)
def test_each_implementation_gives_google_crc32c_values(path):
    for n in LENGTHS:
        for offset in (0, 1, 7, 13):   # unaligned starts too
            data = DATA[offset:offset + n]
            assert _crc32c.value(data, path=path) == google_crc32c.value(data), (path, n, offset)


def test_an_unknown_or_missing_implementation_is_refused():
    with pytest.raises(ValueError, match="no CRC-32C implementation"):
        _crc32c.value(b"x", path="crc64")
    if "avx512" not in _crc32c.paths:
        with pytest.raises(ValueError, match="not available"):
            _crc32c.value(b"x", path="avx512")


def _spans(buffers: list[np.ndarray]) -> np.ndarray:
    return np.array([(b.ctypes.data, b.nbytes) for b in buffers], dtype=np.int64).reshape(-1, 2)


@pytest.mark.parametrize("fallback", [False, True])
def test_spans_give_each_spans_crc32c(monkeypatch, fallback):
    if fallback:   # a source tree whose C module is not built
        monkeypatch.setattr(integrity, "_crc32c", None)
    rng = np.random.default_rng(1)
    buffers = [rng.integers(0, 256, n, dtype=np.uint8) for n in (0, 1, 15, 256, 1000, 70001)]
    out = np.zeros(len(buffers), dtype=np.uint32)
    integrity.crc32c_spans(_spans(buffers), out)
    assert out.tolist() == [google_crc32c.value(b.tobytes()) for b in buffers]


def test_spans_read_memory_in_place():
    memory = (ctypes.c_char * 100)(*b"abc" * 33)
    out = np.zeros(2, dtype=np.uint32)
    _crc32c.spans(np.array([[ctypes.addressof(memory), 100], [ctypes.addressof(memory) + 3, 10]], np.int64), out)
    assert out.tolist() == [google_crc32c.value(bytes(memory)), google_crc32c.value(bytes(memory)[3:13])]
    with pytest.raises(ValueError, match="one 32-bit integer per span"):
        _crc32c.spans(np.zeros((2, 2), np.int64), np.zeros(3, np.uint32))
