"""The run store: one Zarr v3 group, in a directory or at s3://bucket/prefix, that every component reads
and writes.

Layout (all arrays plus JSON attributes; no pickle anywhere):

    zarr.json                       root attributes: the manifest (schema, config, environment, data, ...)
    leases/                         who is writing the store now (store/lease.py); not part of the Zarr group
    data/tokens                     the built-in corpus, embedded so the store is self-contained
    steps/<field>                   per-step records over (step[, rank[, micro, sample]])
    steps                .attrs     {"n_steps": N}: rows [0, N) are valid; explicit done-ness
    spikes               .attrs     {"events": [...]}: what the online detector fired on
    checkpoints/<step>/rank<r>/tensors   each rank's own tensors, packed in one byte array (store/chunks.py)
    checkpoints/<step>/rank<r>  .attrs   {"done", "index", "skeleton", "size", "chunks", ...}, written last
    checkpoints/<step>   .attrs     {"commit": {...}} written last, by one coordinator, once every rank is
                                    done: readers ignore the rest
    replays/<id>/                   replays of this run, each a run store of its own (kind "replay")
    bisect/<id>          .attrs     a bisect session: its parameters, probes, phases and verdict
    analysis/                       per-checkpoint metrics and weight distances (replay/analysis)

Checkpoint <step> holds the state *before* step <step> runs (checkpoint 0 is the initial state).
Integrity (store/integrity.py): every array chunk carries a CRC-32C; the manifest, the step log's and
spikes' attributes and a commit record carry the CRC-32C of their own JSON; a commit record holds the
CRC-32C of every other JSON file of its checkpoint. All are verified on read; a member missing or
unreadable is named with the store, and a resume, a replay or an analysis reads the record whole first
(`verify_records`), so that nothing is written on a damaged one. A commit record is created last and only
if there is none (an exclusive create: a hard link on disk, If-None-Match on an object store); with `durable`
(the default) on disk, only once everything before it is on disk (fsync), so even a machine crash leaves
every committed checkpoint readable. Where the store lives is a `Location`
(store/location.py); docs/store.md says what is written in which order on each.
Concurrency: every rank writes only its own `rank<r>` subtree; the step log, spikes, commits and the
manifest have a single writer (the coordinator, rank 0), and a store has one writer command at a time
(store/lease.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import zarr
from zarr.codecs import Crc32cCodec, ZstdCodec

from replay.errors import ChecksumError, StoreError, UsageError, disk_errors
from replay.store.capabilities import Capabilities
from replay.store.chunks import chunking
from replay.store.integrity import crc32c, group_attributes, group_json, seal, unseal
from replay.store.layout import MODEL_KEYS, model_key
from replay.store.location import Location, Where
from replay.store.manifest import READABLE, SCHEMA, Manifest
from replay.store.nodes import Node, attributes, member
from replay.store.sharding import assemble, local_key

# The tensor codec (store/tensors.py, and with it torch) is imported by the methods that move tensors, so that
# reading a manifest or a step log (`replay info`, the launchers) does not load torch.
if TYPE_CHECKING:
    from replay.store.tensors import Packed

_COMPRESSORS = (ZstdCodec(), Crc32cCodec())   # the step log and embedded data: compressed, then checksummed


DAMAGED = "restore the store from a copy, or record the run again"   # what to do about a store damaged there


KINDS = ("run", "replay", "series")   # what a store's manifest says it is


def check_empty(location: Location) -> None:
    """Refuse a store location that holds anything already (the lease of the command about to create a store
    there does not count: store/lease.py)."""
    local = location.local
    if local is not None and local.exists() and not local.is_dir():
        raise StoreError(f"store {location} is a file: choose a new --store location (a directory)")
    # a temporary file of Zarr's that a kill left does not count, nor does the lease
    names = {name for name in location.children() if not name.endswith(".partial")} - {"leases"}
    if any((location / name).holds_anything() for name in names):
        kind, status = _stored_kind(location)
        holds = ("it holds a run: pass --resume to continue it, or" if kind == "run" and status != "complete" else
                 f"it holds a {'complete run' if kind == 'run' else kind or 'folder of other files'}:")
        raise StoreError(f"store {location} is not empty; {holds} choose a new --store location")


def check_outside_stores(location: Location) -> None:
    """Refuse a new run's location inside a store (a folder of a run store, or of a replay in it): the store
    would hold a run it does not know, written without its lease."""
    inside = enclosing_store(location)
    if inside is not None:
        raise StoreError(f"{location} lies inside the run store {inside}: record a new run outside any store "
                         "(a store's replays are made in it by replay run)")


def enclosing_store(location: Location) -> Location | None:
    """The nearest store that `location` lies inside (a parent folder holding a store's zarr.json), if any."""
    child, here = location, location.parent
    while here != child:
        if _stored_kind(here)[0] is not None:
            return here
        child, here = here, here.parent
    return None


def _stored_kind(location: Location) -> tuple[str | None, str | None]:
    """What the store at `location` says it is, and its status, as far as its zarr.json tells (read without
    checking anything else); (None, None) where no store's zarr.json is."""
    raw = (location / "zarr.json").read()
    try:
        attrs = json.loads(raw)["attributes"] if raw is not None else {}
        meta = attrs.get("replay")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, None
    if not isinstance(meta, dict) or meta.get("kind") not in KINDS:
        return None, None
    return meta["kind"], attrs.get("status")



def _ckpt_name(step: int) -> str:
    return f"{step:08d}"


# Per-step record fields: name -> (dtype, dimension names). "rank" fields have one column per rank;
# sample_ids keeps every micro-batch of every rank: (step, rank, micro, sample), padded with -1 where a step
# trains on fewer or smaller micro-batches than the run's first (a data loader's last batch of an epoch).
STEP_FIELDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "loss": ("float64", ("step",)),
    "rank_loss": ("float64", ("step", "rank")),
    "grad_norm": ("float64", ("step",)),
    "lr": ("float64", ("step",)),
    "tokens": ("int64", ("step",)),
    "step_time": ("float64", ("step",)),
    "sample_ids": ("int64", ("step", "rank", "micro", "sample")),
    # only in runs whose data is a stream (recorder/stream.py): each sample's CRC-32C, where its id is its place
    "sample_digest": ("uint32", ("step", "rank", "micro", "sample")),
    # every rank's digest of its model and optimizer state after the step's update, one per tensor
    # (recorder/digest.py); the tensors' names are the step log's `digests` attribute (`DigestInfo`)
    "state_digest": ("uint32", ("step", "rank", "tensor")),
    # only in runs recorded with --numerics (replay/kernels/numerics.py), measured on rank 0's batches:
    "tied_rate": ("float64", ("step", "layer")),
    "delta_err": ("float64", ("step", "layer")),
    "delta_err_tied": ("float64", ("step", "layer")),
    "wq_err_norm": ("float64", ("step", "layer")),
    "wq_err_cos": ("float64", ("step", "layer")),
    "wq_tied_err_cos": ("float64", ("step", "layer")),
}
NUMERICS_FIELDS = ("tied_rate", "delta_err", "delta_err_tied", "wq_err_norm", "wq_err_cos", "wq_tied_err_cos")
OPTIONAL_FIELDS = (*NUMERICS_FIELDS, "state_digest", "sample_digest")   # not in every step log


def micro_batches(ids: np.ndarray, of: np.ndarray | None = None) -> list[np.ndarray]:
    """One rank's sample ids of one step, (micro, sample) padded with -1, as the micro-batches it trained on; with
    `of` (a field laid out as the ids: a stream's sample digests), that field's values of those samples."""
    ids = np.asarray(ids)
    values = ids if of is None else np.asarray(of)
    return [v[row >= 0] for row, v in zip(ids, values, strict=True) if (row >= 0).any()]


@dataclass(frozen=True)
class DigestInfo:
    """How the step log's state digests were taken: the tensors' names (by column), their kind (digests of
    two kinds are not compared: recorder/digest.py) and the first step that has them (a run recorded by an
    earlier version and resumed by this one has none before it)."""

    kind: str
    names: list[str]
    since: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DigestInfo:
        return cls(kind=d["kind"], names=list(d["names"]), since=int(d["since"]))


@dataclass
class CheckpointInfo:
    step: int
    kind: str           # "regular", "snapshot" (pre-spike ring) or "final"
    world_size: int
    committed_at: float


class RunStore:
    """A run store opened at a location. Cheap to open; every read goes to the store. Writing assumes the
    caller holds the store's lease (store/lease.py)."""

    def __init__(self, location: Location, mode: str, durable: bool = True):
        self.location = location
        self.durable = durable   # commits only once everything before them is on disk
        self._zstore = location.zarr_store(read_only=(mode == "r"))
        self.root = zarr.open_group(self._zstore, mode="r" if mode == "r" else "r+")

    # -- opening -----------------------------------------------------------------------------------

    @classmethod
    def create(cls, where: Where, manifest: Manifest, first_step: int = 0) -> RunStore:
        """A new store: a recorded run, or a replay (whose step log starts at `first_step`)."""
        location = Location.parse(where)
        check_empty(location)
        assert manifest.schema == SCHEMA, "stores are written in the current schema"
        if location.local is not None:
            location.local.mkdir(parents=True, exist_ok=True)
        # refuses to overwrite a group
        zarr.create_group(location.zarr_store(read_only=False), attributes=seal(manifest.to_dict()))
        store = cls(location, mode="a")
        store.root.create_group("steps", attributes=seal({"n_steps": 0, "first_step": first_step,
                                                           "every_chunk": True}))
        store.root.create_group("spikes", attributes=seal({"events": []}))
        store.root.create_group("checkpoints")
        return store

    @classmethod
    def open(cls, where: Where, mode: str = "r") -> RunStore:
        """The store at a location (a path or a URL, for the Python API: the command line parses them)."""
        location = Location.parse(where)
        if not (location / "zarr.json").exists():
            raise StoreError(_no_store(location))
        try:
            store = cls(location, mode=mode)
        except Exception as e:  # a damaged zarr.json: name it rather than show a zarr traceback
            raise StoreError(f"{location} cannot be opened as a Zarr store: {str(e).splitlines()[0]}; {DAMAGED}") \
                from None
        meta = store.root.attrs.get("replay")
        if not isinstance(meta, dict) or meta.get("kind") not in KINDS:
            inside = enclosing_store(location)
            part = f": it is part of the run store {inside}; give that store's location" if inside else ""
            raise StoreError(f"{location} is a Zarr group but not a replay run store{part}")
        if meta.get("schema") not in READABLE:
            newer = isinstance(meta.get("schema"), int) and meta["schema"] > max(READABLE)
            raise StoreError(f"{location} has store schema {meta.get('schema')}, written by "
                             f"{'a newer' if newer else 'another'} version of replay; this one reads schemas "
                             f"{', '.join(map(str, READABLE))}" + ("; upgrade replay to read it" if newer else ""))
        _ = store.manifest   # its checksum, verified
        return store

    @property
    def schema(self) -> int:
        return int(attributes(self.root)["replay"]["schema"])

    def _sealed(self, attrs: dict[str, Any], what: str) -> dict[str, Any]:
        """A JSON document the store wrote, its checksum verified (schema 1 wrote none)."""
        return unseal(attrs, f"{self.location}: {what}") if self.schema >= 2 else attrs

    def check_writable(self) -> None:
        """Refuse to write the run of a store this version cannot write as it was written (an older schema)."""
        if self.schema < SCHEMA:
            raise StoreError(f"{self.location} was written by an older replay (store schema {self.schema}): its run "
                             "can be read, replayed and analysed, not continued; record it again to continue it")


    # -- manifest ----------------------------------------------------------------------------------

    @property
    def manifest(self) -> Manifest:
        doc = self._sealed(attributes(self.root), "the manifest (zarr.json)")
        try:
            return Manifest.from_dict(doc)
        except (KeyError, TypeError, ValueError) as e:   # sealed, so written by a replay: a newer one
            raise StoreError(f"{self.location} was written by a newer replay (its manifest, zarr.json, {_what(e)}): "
                             "upgrade replay to read it") from None

    @property
    def kind(self) -> str:
        return self.manifest.kind

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities.of(self.manifest)

    def update_manifest(self, **fields: Any) -> None:
        """Replace the given fields of the manifest (one write of the whole document)."""
        self.check_writable()
        self.root.update_attributes(seal(dataclasses.replace(self.manifest, **fields).to_dict()))

    def check_rebuildable(self, command: str) -> None:
        """Refuse, in one line, what needs the built-in trainer to rebuild the run (a resumed recording)."""
        if not self.capabilities.builtin:
            raise UsageError(f"{self.location} was recorded by a training loop of your own; `{command}` continues runs "
                             "of the built-in trainer: run your script again with Loop(..., resume=True)")

    def check_relaunchable(self, command: str) -> None:
        """Refuse, in one line, a store whose run cannot be started again (replays, bisect)."""
        if not self.capabilities.relaunchable:
            raise UsageError(f"{self.location} was recorded by the Recorder API without its command, so `{command}` "
                             "cannot start it again; record with replay.recorder.Loop, which keeps the command")

    # -- documents of their own: bisect sessions, step traces, saved diffs ----------------------------

    def _write_document(self, group: str, name: str, doc: dict[str, Any], what: str) -> None:
        """One write of a whole document, `group/name`, replacing the last (a crash leaves it, whole)."""
        with disk_errors(f"{what} in {self.location}", self.location / group):
            self.root.require_group(group)
            (self.location / group / name / "zarr.json").write(group_json(doc))

    def _documents(self, group: str, key: str) -> dict[str, dict[str, Any]]:
        """Every document of `group` that holds `key`, by name: a group whose first write was cut short holds
        none yet, and one whose document cannot be read is left out (written again, it is whole)."""
        found = {}
        for name in sorted((self.location / group).children()):
            path = self.location / group / name / "zarr.json"
            raw = path.read()
            try:
                doc = group_attributes(raw, str(path)) if raw is not None else {}
            except ChecksumError:
                continue
            if key in doc:
                found[name] = doc
        return found

    def bisect_sessions(self) -> list[dict[str, Any]]:
        """Every bisect session's document (replay/bisect); one that cannot be read is left out (its bisect, run
        again, starts it over)."""
        return list(self._documents("bisect", "id").values())

    def write_bisect_session(self, session_id: str, doc: dict[str, Any]) -> None:
        self._write_document("bisect", session_id, doc, f"the bisect session {session_id}")

    def write_trace(self, name: str, doc: dict[str, Any]) -> None:
        """A step's trace (`replay diff --capture`, replay/replayer/diff.py), replacing one of the same name."""
        self._write_document("traces", name, doc, f"the trace {name}")

    def trace(self, name: str) -> dict[str, Any] | None:
        """A trace `replay diff --capture` wrote, checksummed; None if there is none of that name."""
        path = self.location / "traces" / name / "zarr.json"
        raw = path.read()
        return group_attributes(raw, str(path)) if raw is not None else None

    def write_trace_tensor(self, name: str, part: str, raw: np.ndarray) -> str:
        """A tensor a trace keeps whole (`replay diff --capture --keep`), as its bytes (one dimension, integers
        of the tensor's width), compressed and checksummed; returns its array's path for the trace's document."""
        path = f"traces/{name}/kept/{part}"
        with disk_errors(f"the trace {name} in {self.location}", self.location / "traces"):
            for group in ("traces", f"traces/{name}", f"traces/{name}/kept"):
                self.root.require_group(group)
            array = self.root.create_array(path, shape=raw.shape, dtype=raw.dtype,
                                           chunks=(max(1, min(len(raw), 1 << 22)),), fill_value=0,
                                           compressors=_COMPRESSORS, overwrite=True)
            array[...] = raw
        return path

    def read_trace_tensor(self, path: str) -> np.ndarray:
        """The bytes of a tensor a trace kept whole, every chunk's checksum verified."""
        return self._read_array(path, slice(None))

    def write_diff(self, name: str, doc: dict[str, Any]) -> None:
        """A `replay diff --save` answer, replacing one of the same name."""
        self._write_document("diffs", name, doc, f"the diff {name}")

    def diffs(self) -> dict[str, dict[str, Any]]:
        """Every saved diff's answer by name, checksummed."""
        return self._documents("diffs", "step")

    # -- embedded data -----------------------------------------------------------------------------

    def write_tokens(self, tokens: np.ndarray) -> None:
        """Embed the corpus (again, over what a crash left of it)."""
        arr = self.root.create_array(
            "data/tokens", shape=tokens.shape, dtype=tokens.dtype, chunks=(min(len(tokens), 1 << 22),),
            dimension_names=("token",), fill_value=0, compressors=_COMPRESSORS, overwrite=True,
        )
        arr[...] = tokens

    def read_tokens(self) -> np.ndarray:
        """The embedded corpus, every chunk checksummed, and as a whole the bytes the recording fingerprinted (a
        missing chunk would otherwise read as zeros)."""
        tokens = self._read_array("data/tokens", slice(None))
        data = self.manifest.data
        if data.embedded and data.method == "sha256" and hashlib.sha256(tokens.tobytes()).hexdigest() != data.digest:
            raise ChecksumError(f"{self.location}: the embedded data (data/tokens) is not the data the run was "
                                "recorded on (its SHA-256 differs from the manifest's): the store is corrupted there")
        return tokens

    def _check_chunks(self, name: str, rows: int) -> None:
        """Refuse an array missing any chunk its first `rows` rows are stored in."""
        arr = self._member(name, zarr.Array)
        grid = arr.cdata_shape
        needed = -(-rows // arr.chunks[0]) * int(np.prod(grid[1:], dtype=np.int64))
        if arr.nchunks_initialized < needed:
            raise ChecksumError(f"{self.location}: {name} is missing {needed - arr.nchunks_initialized} of its "
                                f"{needed} chunks: the store is corrupted there")

    def _read_array(self, name: str, rows: slice) -> np.ndarray:
        """Rows of an array, every chunk's checksum verified by Zarr's crc32c codec."""
        array = self._member(name, zarr.Array)
        try:
            return np.asarray(array[rows])
        except Exception as e:   # the codec's mismatch, a truncated or missing chunk, undecodable bytes
            raise ChecksumError(f"{self.location}: {name} is damaged ({str(e).splitlines()[0]}); the store is "
                                "corrupted there") from None

    # -- step log ----------------------------------------------------------------------------------

    def _steps_attrs(self) -> dict[str, Any]:
        return self._sealed(attributes(self._steps()), "the step log's attributes (steps/zarr.json)")

    def _steps(self) -> zarr.Group:
        return self._member("steps", zarr.Group)

    def _member(self, path: str, kind: type[Node]) -> Node:
        """A group or array of the layout; one missing or unreadable is named, with the store."""
        try:
            return member(self.root, path, kind)
        except StoreError as e:
            raise ChecksumError(f"{self.location}: {e}: the store is damaged there; {DAMAGED}") from None

    @property
    def n_steps(self) -> int:
        """Rows in the step log: steps [first_step, first_step + n_steps)."""
        return int(self._steps_attrs()["n_steps"])

    @property
    def first_step(self) -> int:
        return int(self._steps_attrs()["first_step"])

    @property
    def end_step(self) -> int:
        """One past the last step logged."""
        return self.first_step + self.n_steps

    def _set_n_steps(self, n: int) -> None:
        self._steps().update_attributes(seal({**self._steps_attrs(), "n_steps": n}))

    @property
    def digests(self) -> DigestInfo | None:
        """How the state digests of the step log were taken; None for a store recorded before them."""
        doc = self._steps_attrs().get("digests")
        return DigestInfo.from_dict(doc) if doc else None

    def note_digests(self, info: DigestInfo) -> None:
        """Name the state digests' columns, once, before the first step that has them is appended."""
        self.check_writable()
        assert self.digests is None, "the digests' names are written once"
        self._steps().update_attributes(seal({**self._steps_attrs(), "digests": info.to_dict()}))

    def append_steps(self, start: int, records: dict[str, np.ndarray]) -> None:
        """Write steps [start, start + k) of every step field, then move the done-ness counter."""
        self.check_writable()
        if start != self.end_step:
            raise StoreError(f"step log ends at step {self.end_step}; cannot append at step {start}")
        row = start - self.first_step
        k = len(records["loss"])
        steps = self._steps()
        with zarr.config.set({"array.write_empty_chunks": True}):   # every chunk stored, its zeros too: one
            self._append(steps, row, k, records)                       # missing is damage (verify_records)
        self._set_n_steps(row + k)

    def _append(self, steps: zarr.Group, row: int, k: int, records: dict[str, np.ndarray]) -> None:
        for name, (dtype, dims) in STEP_FIELDS.items():
            if name not in records and name in OPTIONAL_FIELDS:
                continue
            rows = np.asarray(records[name], dtype=dtype)
            assert rows.shape[0] == k, name
            if name not in steps:
                chunks = (256, *rows.shape[1:])
                steps.create_array(name, shape=(0, *rows.shape[1:]), dtype=dtype, chunks=chunks,
                                   dimension_names=dims, fill_value=0, compressors=_COMPRESSORS)
            arr = self._member(f"steps/{name}", zarr.Array)
            arr.resize((row + k, *arr.shape[1:]))
            arr[row:row + k] = rows

    def read_steps(self, fields: list[str] | None = None, start: int | None = None,
                   stop: int | None = None) -> dict[str, np.ndarray]:
        """The step log's rows of steps `start`..`stop - 1` (by default all of them)."""
        n = self.n_steps
        lo = 0 if start is None else min(n, max(0, start - self.first_step))
        hi = n if stop is None else min(n, max(lo, stop - self.first_step))
        steps = self._steps()
        out: dict[str, np.ndarray] = {"step": np.arange(self.first_step + lo, self.first_step + hi)}
        for name in fields or list(STEP_FIELDS):
            if name in steps:
                out[name] = self._read_array(f"steps/{name}", slice(lo, hi))
            elif name in OPTIONAL_FIELDS or n == 0:   # a store that never logged it, or no step yet
                out[name] = np.zeros((0,))
            else:
                raise ChecksumError(f"{self.location}: the step log's {name} (steps/{name}) is missing: the store is "
                                    f"damaged there; {DAMAGED}")
        return out

    def verify_records(self) -> None:
        """Read the step log's fields whole (every chunk present, every checksum verified: a missing chunk would
        read as zeros), the spikes and the embedded data's metadata: one missing or damaged is named before a
        command that needs them writes anything."""
        steps = self._steps()
        every_chunk = self._steps_attrs().get("every_chunk", False)   # stores made before: zeros were not stored
        for name in STEP_FIELDS:
            if name in steps and every_chunk:
                self._check_chunks(f"steps/{name}", self.n_steps)
        self.read_steps([name for name in STEP_FIELDS if name not in OPTIONAL_FIELDS or name in steps])
        _ = self.spikes
        m = self.manifest
        if m.data.embedded and m.kind == "run":   # a replay reads its parent's
            self._member("data/tokens", zarr.Array)

    def truncate_steps(self, end_step: int) -> None:
        """Keep steps before `end_step`."""
        n = max(0, end_step - self.first_step)
        steps = self._steps()
        self._set_n_steps(min(n, self.n_steps))
        for name in STEP_FIELDS:
            arr = self._member(f"steps/{name}", zarr.Array) if name in steps else None
            if arr is not None and arr.shape[0] > n:
                arr.resize((n, *arr.shape[1:]))

    # -- spikes ------------------------------------------------------------------------------------

    @property
    def spikes(self) -> list[dict[str, Any]]:
        return list(self._sealed(attributes(self._spikes()), "the spikes (spikes/zarr.json)")["events"])

    def _spikes(self) -> zarr.Group:
        return self._member("spikes", zarr.Group)

    def add_spike(self, event: dict[str, Any]) -> None:
        self.check_writable()
        self._spikes().update_attributes(seal({"events": [*self.spikes, event]}))

    def truncate_spikes(self, before_step: int) -> None:
        self._spikes().update_attributes(seal({"events": [e for e in self.spikes if e["step"] < before_step]}))

    # -- checkpoints -------------------------------------------------------------------------------

    def _ckpt_dir(self, step: int) -> Location:
        return self.location / "checkpoints" / _ckpt_name(step)

    def _scan(self) -> list[tuple[int, str, Any]]:
        """Every checkpoint directory: (step, "committed" | "uncommitted" | "damaged", its commit or why)."""
        out: list[tuple[int, str, Any]] = []
        for name in (self.location / "checkpoints").children():
            if not name.isdigit():
                continue
            step = int(name)
            try:
                commit = self._read_commit(step)
            except ChecksumError as e:
                out.append((step, "damaged", str(e)))
                continue
            if commit:
                out.append((step, "committed", commit))
            elif (self.location / "checkpoints" / name).children():   # an object store may list a folder
                out.append((step, "uncommitted", None))                  # emptied a moment ago
        return out

    def _read_commit(self, step: int) -> dict[str, Any] | None:
        """The verified commit record of checkpoint `step`, or None if it has none (yet)."""
        path = self._ckpt_dir(step) / "zarr.json"
        raw = path.read()
        if raw is None:
            return None
        if self.schema < 2:
            legacy: dict[str, Any] | None = attributes(zarr.open_group(
                self._zstore, path=f"checkpoints/{_ckpt_name(step)}", mode="r")).get("commit")
            return legacy
        what = f"checkpoint {step}: its commit record"
        attrs = group_attributes(raw, f"{what} ({path})")
        if not attrs:
            return None
        if set(attrs) != {"commit"} or not isinstance(attrs["commit"], dict):
            raise ChecksumError(f"{what} ({path}) is damaged: unexpected attributes {sorted(attrs)}")
        commit = unseal(attrs["commit"], f"{what} ({path})")
        if raw != group_json(attrs):   # e.g. 1e-05 -> 1E-05 parses the same: it must be byte for byte what we write
            raise ChecksumError(f"{what} ({path}) does not match its checksum: the store is corrupted there")
        return commit

    def checkpoints(self) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest first. Uncommitted ones (a crash mid-write) do not exist."""
        return [CheckpointInfo(step, c["kind"], c["world_size"], c["time"])
                for step, state, c in self._scan() if state == "committed"]

    def uncommitted_checkpoints(self) -> list[int]:
        """Steps of checkpoints started but never committed (a crash mid-write); `rewind` removes them."""
        return [step for step, state, _ in self._scan() if state == "uncommitted"]

    def damaged_checkpoints(self) -> list[tuple[int, str]]:
        """Checkpoints whose commit record does not match its checksum: (step, what is wrong)."""
        return [(step, why) for step, state, why in self._scan() if state == "damaged"]

    def write_shard(self, step: int, rank: int, state: Packed | Any,
                    after_chunk: Callable[[int, int], object] | None = None) -> None:
        """Write one rank's part of checkpoint `step`: its bytes first, its done marker last.

        `state` is a packed tree (what the recorder captures) or a plain one (written straight from its
        tensors' memory). `after_chunk(i, n)` is called after each of the n chunks is on disk (progress,
        fault-injection tests)."""
        from replay.store.tensors import Packed, layout  # lazy: torch (0.7 s); launchers read stores without it

        self.check_writable()
        if isinstance(state, Packed):
            skeleton, index, size, segments = state.skeleton, state.index, len(state.buffer), [(0, state.buffer)]
        else:
            lay = layout(state)
            skeleton, index, size, segments = lay.skeleton, lay.index, lay.size, lay.segments()
        n, chunk = chunking(size)
        shard = self._ckpt_dir(step) / f"rank{rank}"
        # Everything before the shard's document is plain writes: until that document (written whole) says
        # done, and the commit after it, nothing of this shard is read. Durable on disk: all of it reaches
        # the disk (one flush of the filesystem) before that document exists; the flush before the commit
        # takes the document itself there. On an object store every put is durable when it returns.
        (shard / "tensors" / "zarr.json").write(_bytes_array_json(n * chunk, chunk))
        (shard / "tensors").write_chunks(segments, n, chunk, after_chunk)
        if self.durable:
            shard.sync()
        (shard / "zarr.json").write(group_json({"done": True, "skeleton": skeleton, "index": index, "size": size,
                                                "chunks": n, "chunk_bytes": chunk}))

    def commit_checkpoint(self, step: int, kind: str, world_size: int, timeout: float = 600.0) -> None:
        """Wait until every rank's shard is done, then write the commit record (checksums inside)."""
        self.check_writable()
        deadline = time.monotonic() + timeout
        files: dict[str, str] = {}
        for rank in range(world_size):
            shard = self._ckpt_dir(step) / f"rank{rank}"
            while True:
                raw = _done_shard(shard / "zarr.json")
                if raw is not None:
                    files[f"rank{rank}/zarr.json"] = f"{crc32c(raw):08x}"
                    meta = (shard / "tensors" / "zarr.json").read()
                    assert meta is not None, "a shard's array metadata is written before its document"
                    files[f"rank{rank}/tensors/zarr.json"] = f"{crc32c(meta):08x}"
                    break
                if time.monotonic() > deadline:
                    raise StoreError(f"checkpoint {step}: rank {rank} never finished its shard")
                time.sleep(0.01)
        if self.durable:   # the step log and every shard reach the disk before the commit that vouches for them
            self.location.sync()
        commit = seal({"step": step, "kind": kind, "world_size": world_size, "time": time.time(), "files": files})
        if not (self._ckpt_dir(step) / "zarr.json").create(group_json({"commit": commit}), self.durable):
            raise StoreError(f"{self.location}: checkpoint {step} is committed already (by another writer?): this "
                             "process stops writing")

    def _shard_doc(self, step: int, rank: int) -> dict[str, Any]:
        """One rank's shard document of a committed checkpoint, checked against the commit record."""
        commit = self._commit(step)
        key = f"rank{rank}/zarr.json"
        if key not in commit["files"]:
            raise StoreError(f"{self.location}: checkpoint {step} has no shard for rank {rank}")
        shard = self._ckpt_dir(step) / f"rank{rank}"
        what = f"checkpoint {step} rank {rank}: its index and non-tensor state"
        raw = (shard / "zarr.json").read()
        if raw is None:
            raise ChecksumError(f"{what} ({shard / 'zarr.json'}) is missing: the store is corrupted there")
        attrs = group_attributes(raw, f"{what} ({shard / 'zarr.json'})")
        if f"{crc32c(raw):08x}" != commit["files"][key]:
            raise ChecksumError(f"{what} ({shard / 'zarr.json'}) does not match its checksum: the store is "
                                "corrupted there")
        meta = shard / "tensors" / "zarr.json"
        meta_raw = meta.read()
        if meta_raw is None or f"{crc32c(meta_raw):08x}" != commit["files"][f"rank{rank}/tensors/zarr.json"]:
            raise ChecksumError(f"checkpoint {step} rank {rank}: the metadata of its array tensors ({meta}) does "
                                "not match its checksum: the store is corrupted there")
        return attrs

    def read_shard(self, step: int, rank: int, keys: list[str] | None = None) -> Any:
        """One rank's state tree of a committed checkpoint, every byte's checksum verified.

        With `keys`, only those tensors are read (the chunks holding them) and returned as {key: tensor}."""
        from replay.store import legacy  # lazy, both: torch (0.7 s); launchers read stores without it
        from replay.store.tensors import as_tensor, entry_view, unflatten

        if self.schema < 2:
            return legacy.read_shard(self._shard_group(step, rank), self._commit(step), step, rank, keys)
        doc = self._shard_doc(step, rank)
        index, chunk = doc["index"], doc["chunk_bytes"]
        wanted = list(index) if keys is None else keys
        unknown = sorted(set(wanted) - set(index))
        if unknown:
            raise StoreError(f"checkpoint {step} rank {rank} has no tensor {unknown[0]}")
        if keys is None:   # every chunk, so that every byte is verified
            first, last = 0, doc["chunks"] - 1
        else:
            lo = min((index[k]["offset"] for k in wanted), default=0)
            hi = max((index[k]["offset"] + index[k]["nbytes"] for k in wanted), default=0)
            first, last = lo // chunk, max(lo, hi - 1) // chunk
        buffer = self._read_chunks(step, rank, doc, first, last)
        tensors = {key: as_tensor(entry_view(buffer, index[key], first * chunk), index[key]["dtype"]) for key in wanted}
        return tensors if keys is not None else unflatten(doc["skeleton"], tensors)

    def read_subtree(self, step: int, rank: int, path: tuple[str, ...]) -> Any:
        """One branch of a rank's state tree (("state", "replicated"): what every rank restores from rank 0's
        shard), reading only the chunks that hold its tensors."""
        from replay.store.tensors import unflatten  # lazy: torch (0.7 s), as read_shard

        if self.schema < 2:
            tree = self.read_shard(step, rank)
            for segment in path:
                tree = tree[segment]
            return tree
        doc = self._shard_doc(step, rank)
        node = doc["skeleton"]
        for segment in path:
            node = dict(node["__dict__"])[segment]
        prefix = "".join(f"/{segment}" for segment in path) + "/"
        keys = [k for k in doc["index"] if k.startswith(prefix)]
        return unflatten(node, self.read_shard(step, rank, keys=keys) if keys else {})

    def model_shapes(self, step: int) -> dict[str, list[int]]:
        """The model's tensors in checkpoint `step` by state-dict name, with their whole shapes: rank 0's (each
        stored tensor once: tied weights share an offset) and, in a sharded run, those cut into pieces."""
        seen: set[int] = set()
        out: dict[str, list[int]] = {}
        for key, entry in self.shard_index(step, 0).items():
            if key.startswith(MODEL_KEYS) and entry["offset"] not in seen:
                seen.add(entry["offset"])
                out[key[len(MODEL_KEYS):]] = list(entry["shape"])
        sharding = self.manifest.sharding
        out.update({name: list(t.shape) for name, t in (sharding.tensors if sharding else {}).items()})
        return out

    def read_model(self, step: int, names: list[str]) -> dict[str, Any]:
        """The model's whole tensors `names` (state-dict keys) at checkpoint `step`: rank 0's, or assembled from
        every rank's pieces in a sharded run (store/sharding.py), each rank's shard read for its pieces only."""
        sharding = self.manifest.sharding
        whole = [n for n in names if sharding is None or n not in sharding.tensors]
        out: dict[str, Any] = {}
        if whole:
            read = self.read_shard(step, 0, keys=[model_key(n) for n in whole])
            out.update({n: read[model_key(n)] for n in whole})
        if sharding is None:
            return out
        cut = [n for n in names if n in sharding.tensors]
        pieces: dict[str, list[Any]] = {n: [] for n in cut}
        for rank in range(self.manifest.world_size):
            held = [n for n in cut if sharding.tensors[n].pieces[rank].length]
            read = self.read_shard(step, rank, keys=[local_key(n) for n in held]) if held else {}
            for n in cut:
                pieces[n].append(read.get(local_key(n)))
        out.update({n: assemble(sharding.tensors[n], pieces[n]) for n in cut})
        return out

    def verify_shard(self, step: int, rank: int) -> None:
        """Verify the checksum of every byte of one rank's shard of a committed checkpoint, without making
        tensors of it (so without torch: the launchers check the checkpoint a run or replay starts from)."""
        if self.schema < 2:
            self.read_shard(step, rank)
            return
        doc = self._shard_doc(step, rank)
        self._read_chunks(step, rank, doc, 0, doc["chunks"] - 1)

    def _read_chunks(self, step: int, rank: int, doc: dict[str, Any], first: int, last: int) -> np.ndarray:
        index, chunk = doc["index"], doc["chunk_bytes"]
        return (self._ckpt_dir(step) / f"rank{rank}" / "tensors").read_chunks(
            first, last, chunk, f"checkpoint {step} rank {rank}: array tensors",
            contents=lambda i: _chunk_contents(index, i * chunk, (i + 1) * chunk))

    def shard_index(self, step: int, rank: int) -> dict[str, dict[str, Any]]:
        """What one rank's shard holds: {key: dtype, shape, offset, nbytes} (no tensor is read)."""
        if self.schema < 2:
            from replay.store import legacy  # lazy: torch (0.7 s)

            self._commit(step)
            return legacy.shard_index(self._shard_group(step, rank))
        return dict(self._shard_doc(step, rank)["index"])

    def _shard_group(self, step: int, rank: int) -> zarr.Group:
        return zarr.open_group(self._zstore, path=f"checkpoints/{_ckpt_name(step)}/rank{rank}", mode="r")

    def _commit(self, step: int) -> dict[str, Any]:
        commit = self._read_commit(step)
        if not commit:
            raise StoreError(f"{self.location}: no committed checkpoint at step {step}")
        return commit

    def rewind(self, verify_world_size: int) -> int | None:
        """Cut the run back to its last committed checkpoint, for a resume; returns that step. With no
        committed checkpoint (a run stopped while it started), back to nothing, and returns None.

        The shards are read and checksummed first, so a corrupted checkpoint is named before anything
        changes (a damaged commit record too: resuming would discard that checkpoint), and so are the step log
        and the spikes. Then uncommitted checkpoints go, and the step log and spikes are truncated to it."""
        self.check_writable()
        self.verify_records()
        scan = self._scan()
        for step, state, why in scan:
            if state == "damaged":
                raise ChecksumError(f"{why}; resuming would discard it: move checkpoints/{_ckpt_name(step)} "
                                    "out of the store to resume from the checkpoint before it")
        committed = [step for step, state, _ in scan if state == "committed"]
        last = committed[-1] if committed else None
        if last is not None:
            for rank in range(verify_world_size):
                self.verify_shard(last, rank)
        for step, state, _ in scan:
            if last is None or step > last or state != "committed":
                self._ckpt_dir(step).remove_tree()
        self.truncate_steps(last or 0)
        self.truncate_spikes(last or 0)
        return last


def _no_store(location: Location) -> str:
    """Why there is no store at `location` (which holds no zarr.json), and what to do."""
    inside = enclosing_store(location)
    there = location.children() or (location.local is not None and location.local.exists())
    if inside is not None:
        what = "is not a replay run store" if there else "does not exist"
        return f"{location} {what}: it lies inside the run store {inside} (`replay info {inside}` lists its replays)"
    if there:
        return f"{location} is not a replay run store (no zarr.json): give the folder of a run store"
    return f"{location} does not exist; record a run first with `replay record --store {location}`"


def _what(e: Exception) -> str:
    """What a manifest this version cannot read holds, from the error its reading raised."""
    if isinstance(e, KeyError):
        return f"has no field {e.args[0]!r}"
    return f"has {e}" if str(e).startswith("field ") else f"cannot be read here: {e}"


def _chunk_contents(index: dict[str, dict[str, Any]], lo: int, hi: int) -> str:
    """Which tensors have bytes in [lo, hi), for an error message."""
    keys = [k.strip("/") for k, e in index.items() if e["offset"] < hi and e["offset"] + e["nbytes"] > lo]
    if not keys:
        return " (padding)"
    return f" (holding {', '.join(keys[:3])}{f' and {len(keys) - 3} more tensors' if len(keys) > 3 else ''})"


def _done_shard(document: Location) -> bytes | None:
    """The raw shard document once its rank has written it whole, else None."""
    raw = document.read()
    try:
        return raw if raw is not None and json.loads(raw)["attributes"].get("done") else None
    except (ValueError, KeyError):
        return None


def _bytes_array_json(nbytes: int, chunk: int) -> bytes:
    """The Zarr v3 metadata of a 1-D uint8 array of `nbytes` in chunks of `chunk`, each followed by its
    CRC-32C (codecs bytes, crc32c): what zarr.create_array writes for it."""
    return json.dumps({
        "shape": [nbytes], "data_type": "uint8",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [chunk]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0, "codecs": [{"name": "bytes"}, {"name": "crc32c"}], "attributes": {},
        "dimension_names": ["byte"], "zarr_format": 3, "node_type": "array", "storage_transformers": [],
    }, indent=2).encode()
