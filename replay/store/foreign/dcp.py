"""`torch.distributed.checkpoint` (DCP) folders: `.metadata` and `__<rank>_<n>.distcp` files, e.g.
torchtitan's `step-<N>`. The step is the folder name's trailing number.

DCP's `.metadata` is a pickle: it is read with store/dcp.py's `metadata_of` (DCP's own classes only) and
the tensors by its `SafeReader`. A folder on an object store is read through a temporary directory holding
only the `.distcp` files that hold the asked tensors (the metadata, read already, is handed to the reader).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from replay.errors import StoreError, UsageError
from replay.store.foreign.base import ForeignCheckpoint, digest, object_tag, trailing_step
from replay.store.location import Location

if TYPE_CHECKING:
    import torch
    from torch.distributed.checkpoint.metadata import Metadata

METADATA = ".metadata"   # as store/dcp.py's (imported there with torch)


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


def metadata(loc: Location) -> Metadata:
    from replay.store.dcp import metadata_of  # lazy: torch, only where a checkpoint is read

    raw = (loc / METADATA).read()
    if raw is None:
        raise StoreError(f"{loc} has no {METADATA}: is the DCP checkpoint complete?")
    return metadata_of(raw, str(loc / METADATA))


def shapes(md: Metadata, prefix: str) -> dict[str, list[int]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # lazy: torch, as above

    return {k[len(prefix):]: list(v.size) for k, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata) and k.startswith(prefix)}


def read(loc: Location, names: list[str], prefix: str) -> dict[str, torch.Tensor]:
    import torch  # lazy: torch (0.7 s), only where tensors are read
    import torch.distributed.checkpoint as dcp  # lazy: as above
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # lazy: as above

    from replay.store.dcp import SafeReader, quiet_single_process  # lazy: it imports torch

    md = metadata(loc)
    state = {}
    for name in names:
        meta = md.state_dict_metadata.get(prefix + name)
        if not isinstance(meta, TensorStorageMetadata):
            raise StoreError(f"{loc} holds no tensor {prefix + name}")
        state[prefix + name] = torch.empty(meta.size, dtype=meta.properties.dtype)

    def load(folder: Path) -> None:
        with quiet_single_process():
            dcp.load(state, storage_reader=SafeReader(folder, md), no_dist=True)

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
