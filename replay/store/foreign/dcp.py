"""`torch.distributed.checkpoint` (DCP) folders: `.metadata` and `__<rank>_<n>.distcp` files, e.g.
torchtitan's `step-<N>`. The step is the folder name's trailing number.

DCP's `.metadata` is a pickle, and `FileSystemReader` unpickles it with `pickle.load`, which would run
whatever code a crafted file names: here it is unpickled with only DCP's own metadata classes, torch's
dtypes and sizes and paths allowed, and handed to the reader. The tensors' bytes DCP itself loads with
`torch.load(weights_only=True)`. A folder on an object store is read through a temporary directory
holding `.metadata`'s copy and only the `.distcp` files that hold the asked tensors.
"""

from __future__ import annotations

import io
import pickle
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replay.errors import StoreError, UsageError
from replay.store.foreign.base import ForeignCheckpoint, digest, object_tag, trailing_step
from replay.store.location import Location

if TYPE_CHECKING:
    import torch
    from torch.distributed.checkpoint.metadata import Metadata

METADATA = ".metadata"
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
            ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
            ("collections", "OrderedDict")}


def is_checkpoint(loc: Location) -> bool:
    return (loc / METADATA).exists()


def checkpoint_names(children: list[str], loc: Location) -> list[str]:
    return [c for c in children if (loc / c / METADATA).exists()]


def checkpoint(loc: Location) -> ForeignCheckpoint:
    step = trailing_step(loc.name)
    if step is None:
        raise UsageError(f"{loc} is a DCP checkpoint whose name carries no step: name its folder <name>-<step> "
                         "(torchtitan's step-<N>) or <step>")
    raw = (loc / METADATA).read() or b""
    files = sorted(c for c in loc.children() if c.endswith(".distcp"))
    tags = [object_tag(loc / f) if loc.local is None else str((loc.local / f).stat().st_size) for f in files]
    return ForeignCheckpoint(step, loc, digest(raw, *files, *tags))


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch  # lazy: torch (0.7 s), only where a checkpoint is read

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


def metadata(loc: Location) -> Metadata:
    from torch.distributed.checkpoint.metadata import Metadata  # lazy: torch, only where a checkpoint is read

    raw = (loc / METADATA).read()
    if raw is None:
        raise StoreError(f"{loc} has no {METADATA}: is the DCP checkpoint complete?")
    try:
        md = _MetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as e:   # a crafted or damaged pickle fails in any of pickle's ways
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise StoreError(f"{loc / METADATA} is not DCP metadata: {why}") from None
    if not isinstance(md, Metadata):
        raise StoreError(f"{loc / METADATA} is not DCP metadata (it holds a {type(md).__name__})")
    return md


def shapes(md: Metadata, prefix: str) -> dict[str, list[int]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # lazy: torch, as above

    return {k[len(prefix):]: list(v.size) for k, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata) and k.startswith(prefix)}


def read(loc: Location, names: list[str], prefix: str) -> dict[str, torch.Tensor]:
    import torch  # lazy: torch (0.7 s), only where tensors are read
    import torch.distributed.checkpoint as dcp  # lazy: as above
    from torch.distributed.checkpoint import FileSystemReader  # lazy: as above
    from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata  # lazy: as above

    from replay.store.dcp import quiet_single_process  # lazy: it imports torch

    md = metadata(loc)
    state = {}
    for name in names:
        meta = md.state_dict_metadata.get(prefix + name)
        if not isinstance(meta, TensorStorageMetadata):
            raise StoreError(f"{loc} holds no tensor {prefix + name}")
        state[prefix + name] = torch.empty(meta.size, dtype=meta.properties.dtype)

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            if md.storage_meta is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    def load(folder: Path) -> None:
        with quiet_single_process():
            dcp.load(state, storage_reader=Reader(folder), no_dist=True)

    if loc.local is not None:
        load(loc.local)
    else:
        files = {info.relative_path for index, info in md.storage_data.items() if index.fqn in state}
        with tempfile.TemporaryDirectory(prefix="replay-dcp-") as tmp:
            for f in files:
                data = (loc / f).read()
                if data is None:
                    raise StoreError(f"{loc / f} is missing: the DCP checkpoint is incomplete")
                (Path(tmp) / f).write_bytes(data)
            load(Path(tmp))
    return {name: state[prefix + name] for name in names}
