"""Read-only views of a run store for people: `replay info` and `replay batch`."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np

from replay.config import RunConfig
from replay.errors import UsageError
from replay.store.lease import holder_of
from replay.store.run_store import RunStore


def summarize(path: str) -> dict[str, Any]:
    from replay.replayer.replays import list_replays

    store = RunStore.open(path)
    m = store.manifest
    cfg = RunConfig.from_dict(m["config"])
    writer = holder_of(path)
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
        "writer": writer.describe() if writer else None,
        "bisect": [{"id": b["id"], "status": _session_status(b, writer), "params": b["params"],
                    "probes": sorted(b["probes"]), "verdict": b.get("verdict")} for b in store.bisect_sessions()],
        "numerics": _numerics(store) if cfg.numerics else None,
    }


def _session_status(session: dict[str, Any], writer) -> str | None:
    """A session marked running while no bisect holds the store was killed (SIGKILL leaves no trace)."""
    status = session.get("status")
    running = writer is not None and writer.command == "replay bisect"
    return "interrupted (run the same bisect again to resume it)" if status == "running" and not running else status


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
    """The samples of `step` as recorded in `path` (a run, or a replay: its own steps, which start at its
    start checkpoint), with their text where the store can name it."""
    from replay.train.data import load_data

    store = RunStore.open(path)
    if not store.first_step <= step < store.end_step:
        held = f"steps {store.first_step}..{store.end_step - 1}" if store.n_steps else "no steps yet"
        raise UsageError(f"step {step} is not recorded in {path}: it holds {held}")
    ids = np.asarray(store.read_steps(["sample_ids"])["sample_ids"][step - store.first_step])   # (rank, micro, sample)
    if rank is not None and not 0 <= rank < ids.shape[0]:
        raise UsageError(f"rank {rank} out of range: the run had {ids.shape[0]} ranks")
    m = store.manifest
    run = RunStore.open(store.path / m["parent"]) if store.kind == "replay" else store
    data = None if m["launcher"] == "custom" else load_data(RunConfig.from_dict(m["config"]), run)
    rows = []
    for r in range(ids.shape[0]) if rank is None else [rank]:
        for micro in range(ids.shape[1]):
            for sid in ids[r, micro]:
                text = ("(skipped: this step was not trained on)" if sid < 0 else
                        "(the data of a training loop of your own is not in the store)" if data is None else
                        data.describe(int(sid)))
                rows.append({"step": step, "rank": r, "micro": micro, "sample_id": int(sid), "text": text})
    return rows
