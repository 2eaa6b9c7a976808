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

What a crash (a kill, a full disk) leaves is complete or recognisably unfinished, and redone by the next
`replay analyze`: a table is complete once its attributes hold "rows", written after its arrays (a table
without them is made again, over what is there); rows are listed in "rows" after the arrays are sized for
them, and only listed rows are read (arrays may be longer); a row is computed once its done chunk says so.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import numpy as np
import zarr

from replay import faults
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


def _rows(group: zarr.Group, name: str, n: int) -> np.ndarray:
    """An array's first n rows (the listed ones)."""
    return np.asarray(_array(group, name)[:n])


def _sizes(n_layer: int, n_head: int) -> dict[str, int]:
    return {"layer": n_layer, "head": n_head, "matrix": len(MATRICES), "head_matrix": len(HEAD_MATRICES)}


def has_analysis(store: Location) -> bool:
    """Whether the store holds a complete metrics table (one whose making was cut short is not)."""
    return _complete(store / GROUP)


def _complete(table: Location) -> bool:
    """A table's group lists its rows: its making finished (its attributes are written last)."""
    raw = (table / "zarr.json").read()
    try:
        return raw is not None and "rows" in json.loads(raw).get("attributes", {})
    except ValueError:   # not JSON: not a table this module finished
        return False


class MetricsTable:
    """The driver's view of `analysis/`: rows (checkpoints) and which work items are done."""

    def __init__(self, store_path: Location):
        self.store_path = store_path
        self.group = _open_group(store_path, GROUP, mode="r+")

    @classmethod
    def open_or_create(cls, store_path: Location, n_layer: int, n_head: int, layer_block: int,
                       probe: dict[str, Any]) -> MetricsTable:
        if not has_analysis(store_path):
            _create_table(store_path, n_layer, n_head, layer_block, probe)
        table = cls(store_path)
        missing = [name for name in METRICS if name not in table.group]
        if missing:   # analysed before these metrics existed: every row is computed again, once
            attrs = table.attrs
            _array(table.group, "done")[...] = 0   # first: a crash before the arrays below are made redoes this
            _create_metrics(table.group, missing, attrs["n_layer"], attrs["n_head"], attrs["layer_block"],
                            _array(table.group, "checkpoint").shape[0])
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


def _create_table(store_path: Location, n_layer: int, n_head: int, layer_block: int, probe: dict[str, Any]) -> None:
    """`analysis/`'s metrics table, empty, made over whatever an unfinished making left (the group itself is
    kept: it may hold `replay compare`'s distances)."""
    root = zarr.open_group(store_path.zarr_store(read_only=False), mode="r+")
    group = root.require_group(GROUP)
    group.create_array("checkpoint", shape=(0,), dtype="int64", chunks=(1024,), dimension_names=("checkpoint",),
                       fill_value=-1, overwrite=True)
    for name, size in (("layer", n_layer), ("head", n_head)):
        arr = group.create_array(name, shape=(size,), dtype="int64", dimension_names=(name,), overwrite=True)
        arr[...] = np.arange(size)
    for name, labels in (("matrix", MATRICES), ("head_matrix", HEAD_MATRICES)):
        arr = group.create_array(name, shape=(len(labels),), dtype=str, dimension_names=(name,), overwrite=True)
        arr[...] = np.array(labels)
    _create_metrics(group, list(METRICS), n_layer, n_head, layer_block, 0)
    n_blocks = -(-n_layer // layer_block)
    group.create_array("done", shape=(0, n_blocks), dtype="uint8", chunks=(1, 1), fill_value=0,
                       dimension_names=("checkpoint", "block"), config={"write_empty_chunks": True}, overwrite=True)
    faults.hit("analysis-unfinished")
    # the attributes last: a group without them is an unfinished making, redone next time
    group.update_attributes({"schema": SCHEMA, "n_layer": n_layer, "n_head": n_head,
                             "layer_block": layer_block, "probe": probe, "rows": []})


def _create_metrics(group: zarr.Group, names: list[str], n_layer: int, n_head: int, layer_block: int,
                    rows: int) -> None:
    sizes = _sizes(n_layer, n_head)
    for name in names:
        shape = (rows, n_layer, *(sizes[d] for d in METRICS[name]))
        group.create_array(name, shape=shape, dtype="float64", chunks=(1, layer_block, *shape[2:]),
                           dimension_names=("checkpoint", "layer", *METRICS[name]), fill_value=np.nan, overwrite=True)


def _plan(group: zarr.Group, rows: list[dict[str, Any]], arrays: tuple[str, ...]) -> list[int]:
    """Make a table hold these rows ({"step", ...inputs}, one per checkpoint), appending new ones; a row
    whose inputs changed (a rewound run, a checkpoint added in between) or whose checkpoint is gone is
    marked not done. Returns the row index of each. Driver only: it resizes arrays and writes attributes."""
    existing: list[dict[str, Any]] = list(attributes(group)["rows"])
    old = len(existing)
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
    for name in (*arrays, "checkpoint"):   # sized for every row (a plan cut short may have sized some already)
        arr = _array(group, name)
        if arr.shape[0] != len(existing):
            arr.resize((len(existing), *arr.shape[1:]))
    if len(existing) > old:
        _array(group, "checkpoint")[old:] = np.array([r["step"] for r in existing[old:]], dtype=np.int64)
    planned = set(index)
    stale += [i for i in range(old) if i not in planned]   # its checkpoint is gone (a rewound run)
    done = _array(group, "done")
    for i in stale:
        done[i] = 0
    faults.hit("analysis-rows")
    group.attrs["rows"] = existing   # last: the rows above are read once listed here
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
    n = len(attributes(group)["rows"])   # the listed rows (a plan cut short may have sized arrays for more)
    steps = _rows(group, "checkpoint", n)
    complete = np.all(_rows(group, "done", n).astype(bool), axis=1) if n else np.zeros(0, bool)
    order = [i for i in np.argsort(steps, kind="stable") if complete[i]]
    out: dict[str, Any] = {"step": steps[order], "attrs": attributes(group)}
    n_layer, n_head = out["attrs"]["n_layer"], out["attrs"]["n_head"]
    for name, dims in METRICS.items():
        if name in group:
            out[name] = _rows(group, name, n)[order] if order else np.zeros((0, *_array(group, name).shape[1:]))
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
        complete = _complete(store_path / path)
        if not complete or dict(root[path].attrs).get("tensors") not in (None, tensors):   # unfinished; other models
            # made anew, over whatever is there (a removal cut short leaves some of it)
            group = root.require_group(GROUP).require_group("distances").create_group(name, overwrite=True)
            group.create_array("checkpoint", shape=(0,), dtype="int64", chunks=(1024,),
                               dimension_names=("checkpoint",), fill_value=-1, overwrite=True)
            arr = group.create_array("tensor", shape=(len(tensors),), dtype=str, dimension_names=("tensor",),
                                     overwrite=True)
            arr[...] = np.array(tensors)
            for metric in DISTANCES:
                group.create_array(metric, shape=(0, len(tensors)), dtype="float64", chunks=(1, len(tensors)),
                                   dimension_names=("checkpoint", "tensor"), fill_value=np.nan, overwrite=True)
            group.create_array("done", shape=(0,), dtype="uint8", chunks=(1,), fill_value=0,
                               dimension_names=("checkpoint",), config={"write_empty_chunks": True}, overwrite=True)
            faults.hit("analysis-unfinished")
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
        if not _complete(root / name):
            continue
        group = _open_group(store_path, f"{GROUP}/distances/{name}")
        n = len(attributes(group)["rows"])   # the listed rows, as read_metrics
        steps = _rows(group, "checkpoint", n)
        done = _rows(group, "done", n).astype(bool)
        order = [i for i in np.argsort(steps, kind="stable") if done[i]]
        entry: dict[str, Any] = {"step": steps[order], "tensor": [str(t) for t in _read(group, "tensor")],
                                 "attrs": attributes(group)}
        for metric in DISTANCES:
            entry[metric] = _rows(group, metric, n)[order] if order else np.zeros((0, len(entry["tensor"])))
        out[name] = entry
    return out


def analysis_status(where: Where) -> dict[str, Any]:
    """What `replay analyze` has stored: the steps analysed in full, and each distance table's steps."""
    table = read_metrics(where)
    return {"checkpoints": [] if table is None else [int(x) for x in table["step"]],
            "distances": {name: [int(x) for x in t["step"]] for name, t in read_distances(where).items()}}
