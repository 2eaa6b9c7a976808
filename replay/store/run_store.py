"""The run store: one Zarr v3 group on disk that every component reads and writes.

Layout (all arrays plus JSON attributes; no pickle anywhere):

    zarr.json                       root attributes: the manifest (schema, config, environment, data, ...)
    data/tokens                     the built-in corpus, embedded so the store is self-contained
    steps/<field>                   per-step records over (step[, rank[, micro, sample]])
    steps                .attrs     {"n_steps": N}: rows [0, N) are valid; explicit done-ness
    spikes               .attrs     {"events": [...]}: what the online detector fired on
    checkpoints/<step>/rank<r>/tensors   each rank's own tensors, packed in one byte array; its
                                    .attrs {"done", "index", "skeleton", "checksums"} written last
    checkpoints/<step>   .attrs     {"commit": {...checksums of every array...}} written last, by one
                                    coordinator, once every rank is done: readers ignore the rest
    replays/<id>/                   replays of this run, each a run store of its own (kind "replay")
    bisect/<id>          .attrs     a bisect session: its parameters, probes, phases and verdict
    analysis/                       per-checkpoint metrics and weight distances (replay/analysis)

Checkpoint <step> holds the state *before* step <step> runs (checkpoint 0 is the initial state).
Concurrency: every rank writes only its own `rank<r>` subtree; the step log, spikes, commits and the
manifest have a single writer (the coordinator, rank 0). Arrays are written through Zarr's local store,
which writes each file to a temporary name and renames it into place.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import zarr
from zarr.storage import LocalStore

from replay.errors import ChecksumError, StoreError
from replay.store.tensors import Packed, as_tensor, checksum, entry_view, pack, unflatten

SCHEMA_VERSION = 1
_CHUNK_BYTES = 16 << 20     # checkpoint bytes per Zarr chunk: the unit of a partial read
_CHUNKS_PER_WRITE = 8


def is_empty_dir(path: Path) -> bool:
    """Nothing there yet, or an empty directory (the lease of the command about to create a store there
    does not count: store/lease.py)."""
    return not path.exists() or (path.is_dir() and all(p.name == "leases" for p in path.iterdir()))


def _ckpt_name(step: int) -> str:
    return f"{step:08d}"


# Per-step record fields: name -> (dtype, dimension names). "rank" fields have one column per rank;
# sample_ids keeps every micro-batch of every rank: (step, rank, micro, sample).
STEP_FIELDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "loss": ("float64", ("step",)),
    "rank_loss": ("float64", ("step", "rank")),
    "grad_norm": ("float64", ("step",)),
    "lr": ("float64", ("step",)),
    "tokens": ("int64", ("step",)),
    "step_time": ("float64", ("step",)),
    "sample_ids": ("int64", ("step", "rank", "micro", "sample")),
    # only in runs recorded with --numerics (replay/kernels/numerics.py), measured on rank 0's batches:
    "tied_rate": ("float64", ("step", "layer")),
    "delta_err": ("float64", ("step", "layer")),
    "delta_err_tied": ("float64", ("step", "layer")),
    "wq_err_norm": ("float64", ("step", "layer")),
    "wq_err_cos": ("float64", ("step", "layer")),
    "wq_tied_err_cos": ("float64", ("step", "layer")),
}
NUMERICS_FIELDS = ("tied_rate", "delta_err", "delta_err_tied", "wq_err_norm", "wq_err_cos", "wq_tied_err_cos")


@dataclass
class CheckpointInfo:
    step: int
    kind: str           # "regular", "snapshot" (pre-spike ring) or "final"
    world_size: int
    committed_at: float


class RunStore:
    """A run store opened from a directory. Cheap to open; every read goes to disk."""

    def __init__(self, path: str | Path, mode: str):
        self.path = Path(path)
        self._zstore = LocalStore(self.path, read_only=(mode == "r"))
        self.root = zarr.open_group(self._zstore, mode="r" if mode == "r" else "r+")

    # -- opening -----------------------------------------------------------------------------------

    @classmethod
    def create(cls, path: str | Path, manifest: dict[str, Any], kind: str = "run", first_step: int = 0) -> "RunStore":
        """A new store: a recorded run, or a replay (whose step log starts at `first_step`)."""
        path = Path(path)
        if not is_empty_dir(path):
            raise StoreError(
                f"store {path} is not empty: pass --resume to continue the run recorded there, "
                "or choose a new --store directory"
            )
        path.mkdir(parents=True, exist_ok=True)
        attrs = {"replay": {"schema": SCHEMA_VERSION, "kind": kind}, **manifest}
        zarr.create_group(LocalStore(path), attributes=attrs)   # refuses to overwrite a group
        store = cls(path, mode="a")
        store.root.create_group("steps").update_attributes({"n_steps": 0, "first_step": first_step})
        store.root.create_group("spikes").attrs["events"] = []
        store.root.create_group("checkpoints")
        return store

    @classmethod
    def open(cls, path: str | Path, mode: str = "r") -> "RunStore":
        path = Path(path)
        if not (path / "zarr.json").is_file():
            what = "does not exist" if not path.exists() else "is not a replay run store (no zarr.json)"
            raise StoreError(f"{path} {what}; record a run first with `replay record --store {path}`")
        try:
            store = cls(path, mode=mode)
        except Exception as e:  # a damaged zarr.json: name it rather than show a zarr traceback
            raise StoreError(f"{path} cannot be opened as a Zarr store: {e}") from None
        meta = store.root.attrs.get("replay")
        if not isinstance(meta, dict) or meta.get("kind") not in ("run", "replay"):
            raise StoreError(f"{path} is a Zarr group but not a replay run store")
        if meta.get("schema") != SCHEMA_VERSION:
            raise StoreError(f"{path} has store schema {meta.get('schema')}; this replay reads {SCHEMA_VERSION}")
        return store

    # -- manifest ----------------------------------------------------------------------------------

    @property
    def manifest(self) -> dict[str, Any]:
        return dict(self.root.attrs)

    def update_manifest(self, **fields: Any) -> None:
        self.root.update_attributes(fields)

    # -- bisect sessions (replay/bisect) ------------------------------------------------------------

    def bisect_sessions(self) -> list[dict[str, Any]]:
        if "bisect" not in self.root:
            return []
        docs = [dict(group.attrs) for _, group in sorted(self.root["bisect"].groups())]
        return [d for d in docs if "id" in d]   # a group whose first write was cut short holds nothing yet

    def write_bisect_session(self, session_id: str, doc: dict[str, Any]) -> None:
        """One write of the whole document (a crash leaves the previous one)."""
        group = self.root.require_group(f"bisect/{session_id}")
        group.update_attributes(doc)

    # -- embedded data -----------------------------------------------------------------------------

    def write_tokens(self, tokens: np.ndarray) -> None:
        arr = self.root.create_array(
            "data/tokens", shape=tokens.shape, dtype=tokens.dtype, chunks=(min(len(tokens), 1 << 22),),
            dimension_names=("token",), fill_value=0,
        )
        arr[...] = tokens
        arr.attrs["checksum"] = checksum(tokens)

    def read_tokens(self) -> np.ndarray:
        arr = self.root["data/tokens"]
        tokens = arr[...]
        if checksum(tokens) != arr.attrs["checksum"]:
            raise ChecksumError(f"{self.path}: data/tokens does not match its checksum; the store is corrupted")
        return tokens

    # -- step log ----------------------------------------------------------------------------------

    @property
    def kind(self) -> str:
        return self.root.attrs["replay"]["kind"]

    @property
    def n_steps(self) -> int:
        """Rows in the step log: steps [first_step, first_step + n_steps)."""
        return int(self.root["steps"].attrs["n_steps"])

    @property
    def first_step(self) -> int:
        return int(self.root["steps"].attrs.get("first_step", 0))

    @property
    def end_step(self) -> int:
        """One past the last step logged."""
        return self.first_step + self.n_steps

    def append_steps(self, start: int, records: dict[str, np.ndarray]) -> None:
        """Write steps [start, start + k) of every step field, then move the done-ness counter."""
        if start != self.end_step:
            raise StoreError(f"step log ends at step {self.end_step}; cannot append at step {start}")
        row = start - self.first_step
        k = len(records["loss"])
        steps = self.root["steps"]
        for name, (dtype, dims) in STEP_FIELDS.items():
            if name not in records and name in NUMERICS_FIELDS:
                continue
            rows = np.asarray(records[name], dtype=dtype)
            assert rows.shape[0] == k, name
            if name not in steps:
                chunks = (256, *rows.shape[1:])
                steps.create_array(name, shape=(0, *rows.shape[1:]), dtype=dtype, chunks=chunks,
                                   dimension_names=dims, fill_value=0)
            arr = steps[name]
            arr.resize((row + k, *arr.shape[1:]))
            arr[row:row + k] = rows
        steps.attrs["n_steps"] = row + k

    def read_steps(self, fields: list[str] | None = None) -> dict[str, np.ndarray]:
        n = self.n_steps
        steps = self.root["steps"]
        out = {"step": np.arange(self.first_step, self.first_step + n)}
        for name in fields or list(STEP_FIELDS):
            out[name] = steps[name][:n] if name in steps else np.zeros((0,))
        return out

    def truncate_steps(self, end_step: int) -> None:
        """Keep steps before `end_step`."""
        n = max(0, end_step - self.first_step)
        steps = self.root["steps"]
        steps.attrs["n_steps"] = min(n, self.n_steps)
        for name in STEP_FIELDS:
            if name in steps and steps[name].shape[0] > n:
                steps[name].resize((n, *steps[name].shape[1:]))

    # -- spikes ------------------------------------------------------------------------------------

    @property
    def spikes(self) -> list[dict[str, Any]]:
        return list(self.root["spikes"].attrs["events"])

    def add_spike(self, event: dict[str, Any]) -> None:
        self.root["spikes"].attrs["events"] = [*self.spikes, event]

    def truncate_spikes(self, before_step: int) -> None:
        self.root["spikes"].attrs["events"] = [e for e in self.spikes if e["step"] < before_step]

    # -- checkpoints -------------------------------------------------------------------------------

    def _ckpt_groups(self) -> Iterator[tuple[int, Any]]:
        for name, group in sorted(self.root["checkpoints"].groups()):
            yield int(name), group

    def checkpoints(self) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest first. Uncommitted ones (a crash mid-write) do not exist."""
        out = []
        for step, group in self._ckpt_groups():
            commit = group.attrs.get("commit")
            if commit:
                out.append(CheckpointInfo(step, commit["kind"], commit["world_size"], commit["time"]))
        return out

    def uncommitted_checkpoints(self) -> list[int]:
        """Steps of checkpoints started but never committed (a crash mid-write); `rewind` removes them."""
        return [step for step, group in self._ckpt_groups() if not group.attrs.get("commit")]

    def write_shard(self, step: int, rank: int, state: Packed | Any, after_chunk=None) -> None:
        """Write one rank's part of checkpoint `step`: its bytes first, its done marker last.

        `state` is a packed tree (what the recorder captures) or a plain one. `after_chunk(i, n)` is
        called after each of the n chunks is on disk (progress, fault-injection tests)."""
        packed = state if isinstance(state, Packed) else pack(state)
        prefix = f"checkpoints/{_ckpt_name(step)}/rank{rank}"
        group = zarr.open_group(self._zstore, path=prefix, mode="w")
        with ThreadPoolExecutor(1) as pool:   # checksums overlap the writes (both release the GIL)
            sums_future = pool.submit(packed.checksums)
            self._write_bytes(group, packed.buffer, after_chunk)
            sums = sums_future.result()
        # one write of the whole document (attrs.update() would write key by key, "done" maybe first)
        group.update_attributes({"done": True, "skeleton": packed.skeleton, "index": packed.index,
                                 "checksums": sums})

    @staticmethod
    def _write_bytes(group, buffer: np.ndarray, after_chunk) -> None:
        n = max(1, len(buffer))
        # write_empty_chunks: Zarr otherwise compares every chunk with the fill value before writing it
        # (8-10x slower here), to skip chunks we never want skipped: done-ness is the marker below.
        arr = group.create_array("tensors", shape=(n,), dtype="uint8", chunks=(min(n, _CHUNK_BYTES),),
                                 compressors=None, fill_value=0, dimension_names=("byte",),
                                 config={"write_empty_chunks": True})
        bounds = list(range(0, len(buffer), _CHUNK_BYTES * _CHUNKS_PER_WRITE))
        for i, start in enumerate(bounds):   # a few chunks per call: Zarr writes those concurrently
            stop = min(len(buffer), start + _CHUNK_BYTES * _CHUNKS_PER_WRITE)
            arr[start:stop] = buffer[start:stop]
            if after_chunk:
                after_chunk(i + 1, len(bounds))

    def commit_checkpoint(self, step: int, kind: str, world_size: int, timeout: float = 600.0,
                          should_stop=lambda: False) -> None:
        """Wait until every rank's shard is done, then write the commit marker (checksums inside)."""
        name = _ckpt_name(step)
        deadline = time.monotonic() + timeout
        sums: dict[str, dict[str, str]] = {}
        for rank in range(world_size):
            while True:
                attrs = self._shard_attrs(name, rank)
                if attrs.get("done"):
                    sums[str(rank)] = attrs["checksums"]
                    break
                if should_stop() or time.monotonic() > deadline:
                    raise StoreError(f"checkpoint {step}: rank {rank} never finished its shard")
                time.sleep(0.01)
        group = zarr.open_group(self._zstore, path=f"checkpoints/{name}", mode="r+")
        group.attrs["commit"] = {"step": step, "kind": kind, "world_size": world_size,
                                 "time": time.time(), "checksums": sums}

    def _shard_attrs(self, name: str, rank: int) -> dict[str, Any]:
        try:
            return dict(zarr.open_group(self._zstore, path=f"checkpoints/{name}/rank{rank}", mode="r").attrs)
        except (FileNotFoundError, zarr.errors.GroupNotFoundError, KeyError):
            return {}

    def read_shard(self, step: int, rank: int, keys: list[str] | None = None) -> Any:
        """One rank's state tree of a committed checkpoint, every tensor's checksum verified.

        With `keys`, only those tensors are read (by byte range) and returned as {key: tensor}."""
        commit = self._commit(step)
        if str(rank) not in commit["checksums"]:
            raise StoreError(f"{self.path}: checkpoint {step} has no shard for rank {rank}")
        group = self.root[f"checkpoints/{_ckpt_name(step)}/rank{rank}"]
        index, expected = group.attrs["index"], commit["checksums"][str(rank)]
        arr = group["tensors"]
        if keys is None:
            buffer, base, wanted = arr[...], 0, list(index)
        else:
            unknown = sorted(set(keys) - set(index))
            if unknown:
                raise StoreError(f"checkpoint {step} rank {rank} has no tensor {unknown[0]}")
            lo = min(index[k]["offset"] for k in keys)
            hi = max(index[k]["offset"] + index[k]["nbytes"] for k in keys)
            buffer, base, wanted = arr[lo:hi], lo, keys
        tensors = {}
        for key in wanted:
            a = entry_view(buffer, index[key], base)
            if checksum(a) != expected[key]:
                raise ChecksumError(
                    f"checkpoint {step} rank {rank} tensor {key.strip('/')} does not match its checksum: "
                    f"the store at {self.path} is corrupted; restore an earlier checkpoint or re-record")
            tensors[key] = as_tensor(a, index[key]["dtype"])
        return tensors if keys is not None else unflatten(group.attrs["skeleton"], tensors)

    def shard_index(self, step: int, rank: int) -> dict[str, dict[str, Any]]:
        """What one rank's shard holds: {key: dtype, shape, offset, nbytes} (no tensor is read)."""
        self._commit(step)
        return dict(self.root[f"checkpoints/{_ckpt_name(step)}/rank{rank}"].attrs["index"])

    def _commit(self, step: int) -> dict[str, Any]:
        try:
            commit = self.root[f"checkpoints/{_ckpt_name(step)}"].attrs.get("commit")
        except KeyError:
            commit = None
        if not commit:
            raise StoreError(f"{self.path}: no committed checkpoint at step {step}")
        return commit

    def rewind(self, verify_world_size: int) -> int:
        """Cut the run back to its last committed checkpoint, for a resume; returns that step.

        Its shards are read and checksummed first, so a corrupted checkpoint is named before anything
        changes. Then uncommitted checkpoints go, and the step log and spikes are truncated to it."""
        ckpts = self.checkpoints()
        if not ckpts:
            raise StoreError(f"{self.path} has no committed checkpoint to resume from; delete it and record anew")
        last = ckpts[-1].step
        for rank in range(verify_world_size):
            self.read_shard(last, rank)
        for step, group in self._ckpt_groups():
            if step > last or not group.attrs.get("commit"):
                shutil.rmtree(self.path / "checkpoints" / _ckpt_name(step))
        self.truncate_steps(last)
        self.truncate_spikes(last)
        return last
