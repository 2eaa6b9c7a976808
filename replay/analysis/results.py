"""The analysis group of a run store: where analysis results live, and how done-ness is kept.

    analysis/                 attrs: {"schema", "n_layer", "n_head", "layer_block", "probe", "rows": [...]}
    analysis/checkpoint       (checkpoint,) step of each row: the coordinate (rows in planning order)
    analysis/layer, head, matrix, head_matrix      the other coordinates
    analysis/<metric>         (checkpoint, layer[, matrix | head_matrix][, head]) float64, NaN = not computed
    analysis/done             (checkpoint, block) uint8: 1 once a work item's chunks are all written
    analysis/distances/<name> attrs {"reference", "other", "rows"}; checkpoint, tensor coordinates;
                              max_abs, frobenius, relative, wasserstein (checkpoint, tensor); done (checkpoint,)

Every metric array is chunked (1 checkpoint, `layer_block` layers, ...), so a work item (one checkpoint,
one block of layers) owns its chunks and no two tasks ever write the same one. Only the driver (one
coordinator) creates and resizes arrays and writes attributes; tasks write chunks, then their done
chunk last. `xarray.open_zarr(store, group="analysis")` gives the labelled dataset.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import zarr

from replay.analysis.names import DISTANCES, HEAD_MATRICES, MATRICES
from replay.store.location import Location, Where
from replay.store.nodes import attributes, member

SCHEMA = 1
GROUP = "analysis"

# metric -> dimension names after (checkpoint, layer)
METRICS: dict[str, tuple[str, ...]] = {
    "spectral": ("matrix",),
    "spectral_head": ("head_matrix", "head"),
    "spectral_qk": ("head",),
    "update_rel": ("matrix",),
    "update_cos": ("matrix",),
    "update_srank": ("matrix",),
    "update_rel_head": ("head_matrix", "head"),
    "update_cos_head": ("head_matrix", "head"),
    "update_srank_head": ("head_matrix", "head"),
    "max_logit": ("head",),
    "tie_rate": ("head",),
    "attn_entropy": ("head",),
    "log_z": (),
}


def _open_group(store: Location, path: str, mode: Literal["r", "r+"] = "r") -> zarr.Group:
    return zarr.open_group(store.zarr_store(read_only=(mode == "r")), path=path, mode=mode)


# The readers below are also the Python API of the results: they take a path or URL as well (`Where`).


def _array(group: zarr.Group, name: str) -> zarr.Array[Any]:
    return member(group, name, zarr.Array)


def _read(group: zarr.Group, name: str) -> np.ndarray:
    return np.asarray(_array(group, name)[...])


def _sizes(n_layer: int, n_head: int) -> dict[str, int]:
    return {"layer": n_layer, "head": n_head, "matrix": len(MATRICES), "head_matrix": len(HEAD_MATRICES)}


def has_analysis(store: Location) -> bool:
    return (store / GROUP / "zarr.json").exists()


class MetricsTable:
    """The driver's view of `analysis/`: rows (checkpoints) and which work items are done."""

    def __init__(self, store_path: Location):
        self.store_path = store_path
        self.group = _open_group(store_path, GROUP, mode="r+")

    @classmethod
    def open_or_create(cls, store_path: Location, n_layer: int, n_head: int, layer_block: int,
                       probe: dict[str, Any]) -> MetricsTable:
        if not has_analysis(store_path):
            root = zarr.open_group(store_path.zarr_store(read_only=False), mode="r+")
            group = root.create_group(GROUP)
            group.create_array("checkpoint", shape=(0,), dtype="int64", chunks=(1024,), dimension_names=("checkpoint",),
                               fill_value=-1)
            for name, size in (("layer", n_layer), ("head", n_head)):
                arr = group.create_array(name, shape=(size,), dtype="int64", dimension_names=(name,))
                arr[...] = np.arange(size)
            for name, labels in (("matrix", MATRICES), ("head_matrix", HEAD_MATRICES)):
                arr = group.create_array(name, shape=(len(labels),), dtype=str, dimension_names=(name,))
                arr[...] = np.array(labels)
            _create_metrics(group, list(METRICS), n_layer, n_head, layer_block, 0)
            n_blocks = -(-n_layer // layer_block)
            group.create_array("done", shape=(0, n_blocks), dtype="uint8", chunks=(1, 1), fill_value=0,
                               dimension_names=("checkpoint", "block"), config={"write_empty_chunks": True})
            # the attributes last: a group without them is an unfinished creation, redone next time
            group.update_attributes({"schema": SCHEMA, "n_layer": n_layer, "n_head": n_head,
                                     "layer_block": layer_block, "probe": probe, "rows": []})
        table = cls(store_path)
        missing = [name for name in METRICS if name not in table.group]
        if missing:   # analysed before these metrics existed: every row is computed again, once
            attrs = table.attrs
            _create_metrics(table.group, missing, attrs["n_layer"], attrs["n_head"], attrs["layer_block"],
                            _array(table.group, "checkpoint").shape[0])
            _array(table.group, "done")[...] = 0
        return table

    @property
    def attrs(self) -> dict[str, Any]:
        return attributes(self.group)

    def blocks(self) -> list[tuple[int, int]]:
        n, b = self.attrs["n_layer"], self.attrs["layer_block"]
        return [(lo, min(n, lo + b)) for lo in range(0, n, b)]

    def plan(self, rows: list[dict[str, Any]]) -> list[int]:
        return _plan(self.group, rows, (*METRICS, "done"))

    def done(self) -> np.ndarray:
        return _read(self.group, "done").astype(bool)


def _create_metrics(group: zarr.Group, names: list[str], n_layer: int, n_head: int, layer_block: int,
                    rows: int) -> None:
    sizes = _sizes(n_layer, n_head)
    for name in names:
        shape = (rows, n_layer, *(sizes[d] for d in METRICS[name]))
        group.create_array(name, shape=shape, dtype="float64", chunks=(1, layer_block, *shape[2:]),
                           dimension_names=("checkpoint", "layer", *METRICS[name]), fill_value=np.nan)


def _plan(group: zarr.Group, rows: list[dict[str, Any]], arrays: tuple[str, ...]) -> list[int]:
    """Make a table hold these rows ({"step", ...inputs}, one per checkpoint), appending new ones; a row
    whose inputs changed (a rewound run, a checkpoint added in between) or whose checkpoint is gone is
    marked not done. Returns the row index of each. Driver only: it resizes arrays and writes attributes."""
    existing: list[dict[str, Any]] = list(attributes(group)["rows"])
    by_step = {r["step"]: i for i, r in enumerate(existing)}
    index, stale = [], []
    for row in rows:
        i = by_step.get(row["step"])
        if i is None:
            i = by_step[row["step"]] = len(existing)
            existing.append(row)
        elif existing[i] != row:
            existing[i] = row
            stale.append(i)
        index.append(i)
    old = _array(group, "checkpoint").shape[0]
    if len(existing) != old:
        for name in (*arrays, "checkpoint"):
            arr = _array(group, name)
            arr.resize((len(existing), *arr.shape[1:]))
        _array(group, "checkpoint")[old:] = np.array([r["step"] for r in existing[old:]], dtype=np.int64)
    planned = set(index)
    stale += [i for i in range(old) if i not in planned]   # its checkpoint is gone (a rewound run)
    done = _array(group, "done")
    for i in stale:
        done[i] = 0
    group.attrs["rows"] = existing
    return index


def write_metrics(store_path: Location, row: int, block: tuple[int, int], block_index: int,
                  values: dict[str, np.ndarray]) -> None:
    """A work item's results: its own chunks of every metric array, then its done chunk."""
    group = _open_group(store_path, GROUP, mode="r+")
    lo, hi = block
    for name in METRICS:
        _array(group, name)[row, lo:hi] = values[name]
    _array(group, "done")[row, block_index] = 1


def read_metrics(where: Where) -> dict[str, Any] | None:
    """Every computed row of `analysis/`, sorted by step: {"step": [n], metric: [n, layer, ...], "attrs"}."""
    store_path = Location.parse(where)
    if not has_analysis(store_path):
        return None
    group = _open_group(store_path, GROUP)
    if "rows" not in group.attrs:
        return None
    steps = _read(group, "checkpoint")
    complete = np.all(_read(group, "done").astype(bool), axis=1) if steps.size else np.zeros(0, bool)
    order = [i for i in np.argsort(steps, kind="stable") if complete[i]]
    out: dict[str, Any] = {"step": steps[order], "attrs": attributes(group)}
    n_layer, n_head = out["attrs"]["n_layer"], out["attrs"]["n_head"]
    for name, dims in METRICS.items():
        if name in group:
            out[name] = _read(group, name)[order] if order else np.zeros((0, *_array(group, name).shape[1:]))
        else:   # analysed before this metric existed (the next `replay analyze` computes it)
            out[name] = np.full((len(order), n_layer, *(_sizes(n_layer, n_head)[d] for d in dims)), np.nan)
    return out


class DistanceTable:
    """`analysis/distances/<name>`: weight distances of `other` against `reference` at matching steps."""

    def __init__(self, store_path: Location, name: str):
        self.store_path, self.name = store_path, name
        self.path = f"{GROUP}/distances/{name}"
        self.group = _open_group(store_path, self.path, mode="r+")

    @classmethod
    def open_or_create(cls, store_path: Location, name: str, reference: str, other: str,
                       tensors: list[str]) -> DistanceTable:
        path = f"{GROUP}/distances/{name}"
        root = zarr.open_group(store_path.zarr_store(read_only=False), mode="r+")
        if path in root and dict(root[path].attrs).get("tensors") not in (None, tensors):
            del root[path]                        # the models changed shape: these distances are void
        if path not in root or "rows" not in root[path].attrs:
            if path in root:
                del root[path]
            group = root.require_group(GROUP).require_group("distances").create_group(name)
            group.create_array("checkpoint", shape=(0,), dtype="int64", chunks=(1024,),
                               dimension_names=("checkpoint",), fill_value=-1)
            arr = group.create_array("tensor", shape=(len(tensors),), dtype=str, dimension_names=("tensor",))
            arr[...] = np.array(tensors)
            for metric in DISTANCES:
                group.create_array(metric, shape=(0, len(tensors)), dtype="float64", chunks=(1, len(tensors)),
                                   dimension_names=("checkpoint", "tensor"), fill_value=np.nan)
            group.create_array("done", shape=(0,), dtype="uint8", chunks=(1,), fill_value=0,
                               dimension_names=("checkpoint",), config={"write_empty_chunks": True})
            group.update_attributes({"reference": reference, "other": other, "tensors": tensors, "rows": []})
        return cls(store_path, name)

    def plan(self, rows: list[dict[str, Any]]) -> list[int]:
        return _plan(self.group, rows, (*DISTANCES, "done"))

    def done(self) -> np.ndarray:
        return _read(self.group, "done").astype(bool)


def write_distances(store_path: Location, name: str, row: int, values: dict[str, np.ndarray]) -> None:
    group = _open_group(store_path, f"{GROUP}/distances/{name}", mode="r+")
    for metric in DISTANCES:
        _array(group, metric)[row] = values[metric]
    _array(group, "done")[row] = 1


def read_distances(where: Where) -> dict[str, dict[str, Any]]:
    """Every distance table of a store: {name: {"step", "tensor", metric: [n, tensor], "attrs"}}."""
    store_path = Location.parse(where)
    root = store_path / GROUP / "distances"
    out = {}
    for name in root.children():
        if not (root / name / "zarr.json").exists():
            continue
        group = _open_group(store_path, f"{GROUP}/distances/{name}")
        if "rows" not in group.attrs:
            continue
        steps = _read(group, "checkpoint")
        done = _read(group, "done").astype(bool)
        order = [i for i in np.argsort(steps, kind="stable") if done[i]]
        entry: dict[str, Any] = {"step": steps[order], "tensor": [str(t) for t in _read(group, "tensor")],
                                 "attrs": attributes(group)}
        for metric in DISTANCES:
            entry[metric] = _read(group, metric)[order] if order else np.zeros((0, len(entry["tensor"])))
        out[name] = entry
    return out


def analysis_status(where: Where) -> dict[str, Any]:
    """What `replay analyze` has stored: the steps analysed in full, and each distance table's steps."""
    table = read_metrics(where)
    return {"checkpoints": [] if table is None else [int(x) for x in table["step"]],
            "distances": {name: [int(x) for x in t["step"]] for name, t in read_distances(where).items()}}
