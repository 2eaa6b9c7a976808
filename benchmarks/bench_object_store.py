"""Benchmark a checkpoint in a run store on S3: its write and read against obstore's raw put and get of the
same bytes (the ceiling) and against torch.save / torch.load of the same state to a local file.

A GPT-2-shaped model (6 layers x 512, vocab 50304, context 1024: 45M fp32 parameters, 181 MB) with its
AdamW state after one step (random gradients), as the recorder captures it (543 MB in all). The S3 server
is SeaweedFS on 127.0.0.1 (tests/s3server.py), started by the benchmark and stopped at its end; its data
lives in the same temporary directory as the local files. In rounds alternating the order, each operation
timed alone (the page cache's dirty data flushed first, untimed):

- store -> S3: `RunStore.write_shard(step, 0, state)` + `commit_checkpoint` at s3://bucket/prefix, and
  `RunStore.open(...).read_shard(step, 0)` (every chunk's checksum verified);
- obstore put/get: the store's bytes for that state (the same bytes it writes) as one object, a multipart
  upload with the store's part size and concurrency (store/s3.py), then one GET of it, nothing verified;
- store -> local: the same write and read to a directory (durable: the store flushes the filesystem before
  it commits);
- torch.save: torch.save to a local file then fsync (as durable), torch.load(weights_only=True).

Medians, throughput and the ratios; then that the state read back from S3 equals the written one bit for
bit. The full run takes 1-3 minutes on 2 cores; --quick a 4-layer, 128-wide model (about 9 s):

    .venv/bin/python benchmarks/bench_object_store.py [--quick] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/s3server.py

import numpy as np  # noqa: E402
import obstore  # noqa: E402
import torch  # noqa: E402
from bench_dcp import parts  # noqa: E402
from bench_record import SMALL, hardware  # noqa: E402

from replay.config import build_config  # noqa: E402
from replay.lifeline import follow_parent  # noqa: E402
from replay.recorder import create_run_store  # noqa: E402
from replay.recorder.state import TorchTrainState  # noqa: E402
from replay.store import RunStore, s3  # noqa: E402
from replay.store.location import Location  # noqa: E402
from replay.store.tensors import layout  # noqa: E402
from tests.s3server import S3Server  # noqa: E402

MEDIUM = ["model.n_layer=6", "model.n_head=8", "model.n_embd=512", "model.block_size=1024", "model.vocab_size=50304"]
MB = 1e6
WRITES = ["store -> S3", "obstore put", "store -> local", "torch.save"]
READS = ["store <- S3", "obstore get", "store <- local", "torch.load"]


def timed(fn: Callable[[], object]) -> float:
    os.sync()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in tensors(v)]
    return []


def bit_equal(a: Any, b: Any) -> bool:
    ta, tb = tensors(a), tensors(b)
    return len(ta) == len(tb) and all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(
        x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)) for x, y in zip(ta, tb, strict=True))


def store_bytes(state: Any) -> np.ndarray:
    """The bytes the store writes for `state`, in one buffer."""
    lay = layout(state)
    buf = np.zeros(lay.size, dtype=np.uint8)
    for offset, a in lay.segments():
        buf[offset:offset + len(a)] = a
    return buf


def bench(workdir: Path, server: S3Server, sets: list[str], label: str, repeats: int) -> None:
    model, optimizer = parts(sets, step=True)
    state = {"state": TorchTrainState(model, optimizer).state_dict(0), "rng": {}}
    raw = store_bytes(state)
    config = build_config("tiny", None, sets)
    client = server.client(max_retries=3)
    read_back: dict[str, Any] = {}

    def store_write(where: Location) -> None:
        store = create_run_store(where, config)
        store.write_shard(0, 0, state)
        store.commit_checkpoint(0, "regular", 1)

    def store_read(where: Location, name: str) -> None:
        read_back[name] = RunStore.open(where).read_shard(0, 0)

    def raw_put(key: str) -> None:
        obstore.put(client, key, raw.data, chunk_size=s3.PART_BYTES, max_concurrency=s3.PART_CONCURRENCY)

    def raw_get(key: str) -> None:
        read_back["obstore"] = obstore.get(client, key).bytes()

    def torch_save(path: Path) -> None:
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    def torch_load(path: Path) -> None:
        read_back["torch"] = torch.load(path, weights_only=True)

    times: dict[str, list[float]] = {name: [] for name in WRITES + READS}
    for r in range(repeats):
        remote = Location.parse(f"s3://{server.bucket}/bench/run-{r}")
        local, file, key = Location.parse(workdir / f"run-{r}"), workdir / f"torch-{r}.pt", f"raw/{r}"
        writes = [partial(store_write, remote), partial(raw_put, key), partial(store_write, local),
                  partial(torch_save, file)]
        reads = [partial(store_read, remote, "s3"), partial(raw_get, key), partial(store_read, local, "local"),
                 partial(torch_load, file)]
        order = range(4) if r % 2 == 0 else range(3, -1, -1)
        for i in order:
            times[WRITES[i]].append(timed(writes[i]))
        for i in order:
            times[READS[i]].append(timed(reads[i]))
        if r < repeats - 1:
            read_back.clear()
            remote.remove_tree()
            obstore.delete(client, key)
            shutil.rmtree(workdir / f"run-{r}")
            file.unlink()

    med = {k: statistics.median(v) for k, v in times.items()}
    size = len(raw) / MB
    print(f"{label}: a checkpoint of {size:.0f} MB (model + AdamW state), median of {repeats}:", flush=True)
    print(f"  {'':<16}{'seconds':>9}{'MB/s':>8}   {'/ obstore':>9}{'/ torch':>9}")
    for names, ceiling, torch_name in ((WRITES, "obstore put", "torch.save"), (READS, "obstore get", "torch.load")):
        for name in names:
            print(f"  {name:<16}{med[name]:>9.3f}{size / med[name]:>8.0f}   {med[name] / med[ceiling]:>8.2f}x"
                  f"{med[name] / med[torch_name]:>8.2f}x")
    same = bit_equal(read_back["s3"], state) and bit_equal(read_back["local"], state)
    same = same and bytes(read_back["obstore"]) == raw.tobytes() and bit_equal(read_back["torch"], state)
    print(f"  read back: {'equal to the written state bit for bit' if same else 'DIFFERS from the written state'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 4-layer, 128-wide model, 2 rounds (seconds)")
    ap.add_argument("--dir", default=None, help="where the S3 server's data and the local files go (default: "
                                                "system temp)")
    args = ap.parse_args()
    print(hardware(), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-s3-", dir=args.dir) as tmp:
        server = S3Server(Path(tmp) / "s3")
        t = time.perf_counter()
        server.start()
        print(f"S3 server (SeaweedFS {server.endpoint}) started in {time.perf_counter() - t:.2f} s", flush=True)
        os.environ.update(server.env)
        try:
            if args.quick:
                bench(Path(tmp), server, SMALL, "4 layers x 128", repeats=2)
            else:
                bench(Path(tmp), server, MEDIUM, "GPT-2-shaped: 6 layers x 512, seq 1024, vocab 50304", repeats=5)
        finally:
            server.stop()


if __name__ == "__main__":
    follow_parent()   # started by the test suite: end with it
    main()
