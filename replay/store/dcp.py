"""A committed checkpoint as a `torch.distributed.checkpoint` (DCP) directory, for torchtitan, OLMo-core and
anything else that loads DCP: `replay export STORE --step N --to DIR`.

The directory holds {"model": {state-dict name: whole tensor}}, read through `RunStore.read_model`, so a
sharded run (FSDP2, ZeRO-3) exports whole tensors too (with the optimizer, rank 0's shard is read once for
both: it holds the whole model then). The optimizer is added under "optimizer" in the
layout `torch.distributed.checkpoint.state_dict.get_state_dict` gives (parameter names, not the
optimizer's numbers), which only the model and optimizer objects know: a caller that passes them (built as
the run built them) gets it, for a run whose optimizer is not partitioned across ranks. It is written by
`dcp.save` from this one process, without a process group. The other direction is recorder/dcp.py.

Reading one: DCP's `.metadata` is a pickle, which DCP's own `FileSystemReader` loads with `pickle.load`,
running whatever code a crafted file names. `SafeReader` unpickles it with DCP's metadata classes, torch's
dtypes and sizes and paths only (`metadata_of`); the tensors' bytes DCP loads with
`torch.load(weights_only=True)` itself. Every DCP directory replay reads goes through it (recorder/dcp.py,
store/foreign/dcp.py).
"""

from __future__ import annotations

import contextlib
import io
import pickle
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import get_state_dict

from replay import faults
from replay.config import Launcher
from replay.errors import StoreError, UsageError, disk_error, disk_errors
from replay.store.layout import MODEL_KEYS
from replay.store.location import Where
from replay.store.run_store import RunStore

MODEL, OPTIMIZER = "model", "optimizer"   # the top-level keys of an exported directory
METADATA = ".metadata"
PARTIAL = ".replay-export-unfinished"   # in an export's folder until DCP has written all of it
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
            ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
            ("collections", "OrderedDict")}


@dataclass
class Exported:
    path: Path
    step: int
    tensors: int              # the model's
    optimizer: bool           # whether the optimizer's state is in it too
    why_not: str = ""         # why it is not

    def line(self) -> str:
        what = "model and optimizer" if self.optimizer else f"model only ({self.why_not})"
        return f"exported checkpoint {self.step} to {self.path}: {what}, {self.tensors} model tensors (DCP)"


def model_names(store: RunStore, step: int) -> list[str]:
    """The state-dict names of the model's tensors in checkpoint `step`: rank 0's whole ones, then the
    sharded ones (store/sharding.py)."""
    sharding = store.manifest.sharding
    names = [k[len(MODEL_KEYS):] for k in store.shard_index(step, 0) if k.startswith(MODEL_KEYS)]
    return names + [n for n in (sharding.tensors if sharding else {}) if n not in names]


def export(store_path: Where, step: int, out: str | Path, model: torch.nn.Module | None = None,
           optimizer: torch.optim.Optimizer | None = None) -> Exported:
    """Write checkpoint `step` of the run in `store_path` to the DCP directory `out` (new or empty). With
    `model` and `optimizer` (the run's kinds, any weights: the checkpoint is loaded into them), the optimizer
    state goes in too."""
    out = _target(out)
    store = RunStore.open(store_path)
    committed = [c.step for c in store.checkpoints()]
    if step not in committed:
        raise StoreError(f"{store_path} has no committed checkpoint at step {step} (committed: "
                         f"{', '.join(map(str, committed)) or 'none'})")
    why_not = _why_no_optimizer(store, model, optimizer)
    if why_not:
        state: dict[str, Any] = {MODEL: store.read_model(step, model_names(store, step))}
    else:   # not sharded: rank 0's shard holds the whole model and the optimizer, read once
        assert model is not None and optimizer is not None, "_why_no_optimizer checks both are given"
        replicated = store.read_shard(step, 0)["state"]["replicated"]
        if "optimizer" not in replicated:
            raise StoreError(f"checkpoint {step} of {store.location} holds no optimizer state on rank 0")
        model.load_state_dict(replicated["model"])
        optimizer.load_state_dict(replicated["optimizer"])
        state = {MODEL: replicated["model"], OPTIMIZER: get_state_dict(model, optimizer)[1]}
    _save(state, out)
    return Exported(out, step, len(state[MODEL]), not why_not, why_not)


def _target(out: str | Path) -> Path:
    """The directory to export to: new, empty, or an export cut short (which is written over)."""
    if "://" in str(out):
        raise UsageError(f"--to {out}: an export is written to a local directory (DCP's file system writer); "
                         "export to a local folder, then copy it to the object store (e.g. `aws s3 cp --recursive`)")
    path = Path(out)
    if path.exists() and (not path.is_dir() or any(path.iterdir())) and not (path / PARTIAL).exists():
        raise UsageError(f"{path} exists and is not an empty directory: export to a new one")
    return path


def _save(state: dict[str, Any], out: Path) -> None:
    """`state` as a DCP directory at `out`, marked unfinished (PARTIAL) until DCP has written all of it; a
    failure removes what it wrote, a kill leaves the mark, and the next export over it starts again."""
    created = not out.exists()
    try:
        with disk_errors(f"the export to {out}", out, elsewhere="export to another folder"):
            out.mkdir(parents=True, exist_ok=True)
            _clear(out)
            (out / PARTIAL).write_bytes(b"")
            with quiet_single_process():
                dcp.save(state, checkpoint_id=out, no_dist=True)
            faults.hit("export-written")
            (out / PARTIAL).unlink()
    except CheckpointException as e:   # DCP's own, a BaseException: what went wrong is inside it
        _discard(out, created)
        raise _failed(e, out) from None
    except BaseException:
        _discard(out, created)
        raise


def _clear(out: Path) -> None:
    """What an export cut short left in `out` (`_target` let only such a folder through, or an empty one)."""
    for child in out.iterdir():
        shutil.rmtree(child) if child.is_dir() else child.unlink()


def _discard(out: Path, created: bool) -> None:
    """Remove a failed export's files (and its folder, if it made it); as much as the filesystem allows."""
    with contextlib.suppress(OSError):
        if created:
            shutil.rmtree(out)
        elif out.is_dir():
            _clear(out)


def _failed(e: CheckpointException, out: Path) -> StoreError:
    """DCP's failure as one line: a full or read-only disk as such, else its first error's first line."""
    errors = [exc for exc, _ in e.failures.values()] or [e]
    for exc in errors:
        found = disk_error(exc, f"the export to {out}", out, elsewhere="export to another folder")
        if found is not None:
            return found
    why = (str(errors[0]).strip().splitlines() or [type(errors[0]).__name__])[0]
    return StoreError(f"the export to {out} failed ({type(errors[0]).__name__}: {why}); nothing was left there")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _DCP_MODULES or (module, name) in _ALLOWED or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            if module in _DCP_MODULES and name not in _dcp_classes(module):
                raise pickle.UnpicklingError(f"{module}.{name} is not one of DCP's metadata classes")
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


def _dcp_classes(module: str) -> set[str]:
    import importlib  # lazy: only to list what a crafted .metadata may name

    mod = importlib.import_module(module)
    return {n for n, v in vars(mod).items() if isinstance(v, type) and v.__module__ == module}


def metadata_of(raw: bytes, where: str) -> Metadata:
    """A `.metadata` file's contents (at `where`, for the error), unpickled with DCP's own classes only."""
    try:
        md = _MetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as e:   # a crafted or damaged pickle fails in any of pickle's ways
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise StoreError(f"{where} is not DCP metadata: {why}") from None
    if not isinstance(md, Metadata):
        raise StoreError(f"{where} is not DCP metadata (it holds a {type(md).__name__})")
    return md


class SafeReader(FileSystemReader):
    """DCP's reader of a local directory, its `.metadata` read by `metadata_of` (or given, read already)."""

    def __init__(self, path: str | Path, metadata: Metadata | None = None):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        where = Path(self.path) / METADATA
        md = self._metadata or metadata_of(where.read_bytes(), str(where))
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP without a process group, as intended: without DCP's warning that it assumes so."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*assuming the intent", category=UserWarning)
        yield


def _why_no_optimizer(store: RunStore, model: torch.nn.Module | None, optimizer: Any) -> str:
    m = store.manifest
    if m.sharding is not None:
        return f"the optimizer of a {m.sharding.kind}-sharded run is partitioned across its ranks"
    if m.launcher == Launcher.DEEPSPEED:
        return "a DeepSpeed run's optimizer is partitioned across its ranks"
    if model is None or optimizer is None:
        return ("the optimizer's layout needs the model and optimizer objects: "
                "replay.store.dcp.export(..., model=, optimizer=)")
    return ""
