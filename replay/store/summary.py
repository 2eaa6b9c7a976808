"""Read-only views of a run store for people: `replay info` and `replay batch`."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np

from replay.config import RunConfig
from replay.errors import UsageError
from replay.store.run_store import RunStore


def summarize(path: str) -> dict[str, Any]:
    from replay.replayer.replays import list_replays

    store = RunStore.open(path)
    m = store.manifest
    cfg = RunConfig.from_dict(m["config"])
    steps = store.read_steps(["loss"])
    committed = store.checkpoints()
    data = m["data"]
    return {
        "path": str(Path(path).resolve()),
        "status": m.get("status", "unknown"),
        "config": m["config"],
        "world_size": m["world_size"],
        "launcher": m["launcher"],
        "grad_accum": cfg.batch_size // (cfg.micro_batch_size * m["world_size"]),
        "data": (f"{data.get('source', 'built-in')}, {data['bytes']} bytes embedded" if data["embedded"]
                 else f"{data['path'] or data.get('source')} ({data['bytes']} bytes)")
        + (f", {data['method']} {data['digest'][:12]}" if data["digest"] else ""),
        "data_fingerprint": data,
        "environment": m.get("environment", {}),
        "steps_recorded": store.n_steps,
        "first_loss": float(steps["loss"][0]) if store.n_steps else None,
        "last_loss": float(steps["loss"][-1]) if store.n_steps else None,
        "checkpoints": [{"step": c.step, "kind": c.kind, "world_size": c.world_size} for c in committed],
        "uncommitted_checkpoints": store.uncommitted_checkpoints(),
        "spikes": store.spikes,
        "replays": list_replays(path),
        "resumes": m.get("resumes", []),
        "bisect": [{"id": b["id"], "status": b.get("status"), "params": b["params"], "probes": sorted(b["probes"]),
                    "verdict": b.get("verdict")} for b in store.bisect_sessions()],
        "numerics": _numerics(store) if cfg.numerics else None,
    }


def _numerics(store: RunStore) -> dict[str, list[float]] | None:
    """Per layer, over the recorded steps (replay/kernels/numerics.py says what each is)."""
    if not store.n_steps:
        return None
    s = store.read_steps(["tied_rate", "delta_err", "delta_err_tied", "wq_err_cos", "wq_tied_err_cos"])
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # all-NaN columns (a layer without ties) give NaN
        out = {"tied_rate_mean": np.nanmean(s["tied_rate"], axis=0),
               "delta_err_sum": np.nansum(s["delta_err"], axis=0),
               "delta_err_tied_mean": np.nanmean(s["delta_err_tied"], axis=0),
               "wq_err_cos_median": np.nanmedian(s["wq_err_cos"], axis=0),
               "wq_tied_err_cos_median": np.nanmedian(s["wq_tied_err_cos"], axis=0)}
    return {k: [float(x) for x in v] for k, v in out.items()}


def step_batch(path: str, step: int, rank: int | None = None) -> list[dict[str, Any]]:
    from replay.train.data import load_data

    store = RunStore.open(path)
    if not 0 <= step < store.n_steps:
        raise UsageError(f"step {step} is not recorded in {path}: it holds steps 0..{store.n_steps - 1}")
    ids = np.asarray(store.root["steps/sample_ids"][step])   # (rank, micro, sample)
    if rank is not None and not 0 <= rank < ids.shape[0]:
        raise UsageError(f"rank {rank} out of range: the run had {ids.shape[0]} ranks")
    cfg = RunConfig.from_dict(store.manifest["config"])
    data = load_data(cfg, store)
    rows = []
    for r in range(ids.shape[0]) if rank is None else [rank]:
        for m in range(ids.shape[1]):
            for sid in ids[r, m]:
                rows.append({"step": step, "rank": r, "micro": m, "sample_id": int(sid),
                             "text": data.describe(int(sid))})
    return rows
