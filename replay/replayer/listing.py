"""The replays of a run as people read them (`replay info`, the report, localisation): their windows,
overrides, outcomes and verification, read from the nested stores alone (no torch, no kernels)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from replay.errors import StoreError
from replay.store import RunStore
from replay.store.location import Location, Where
from replay.store.manifest import ReplaySpec


def spike_outcome(recorded: list[int], replayed: list[int], spec: ReplaySpec) -> str:
    """In words: did the replay reproduce, prevent or add spikes, against the record's in the window?"""
    in_window = [s for s in recorded if spec.start <= s <= spec.stop]
    if not in_window:
        return "no spike recorded in the window" + (f"; the replay spiked at {replayed}" if replayed else "")
    if replayed == in_window:
        return f"spike reproduced at {in_window}"
    if not replayed:
        return f"spike prevented (recorded at {in_window})"
    return f"spikes at {replayed} (recorded at {in_window})"


def replays(run: Location) -> Iterator[tuple[Location, RunStore | StoreError]]:
    """Every replay of a run: its store, or why it cannot be opened."""
    for path in [run / "replays" / name for name in (run / "replays").children()]:
        try:
            yield path, RunStore.open(path)
        except StoreError as e:
            if path.children():   # else a folder an object store lists a moment after it was emptied
                yield path, e


def list_replays(store_path: Where) -> list[dict[str, Any]]:
    """Every replay of the run; one that cannot be read is listed as {"id", "error"}, not left out."""
    store_path = Location.parse(store_path)
    recorded = [e["step"] for e in RunStore.open(store_path).spikes]
    out: list[dict[str, Any]] = []
    for path, store in replays(store_path):
        try:
            if isinstance(store, StoreError):   # it cannot be opened
                raise store
            m = store.manifest                  # or its documents cannot be read
            spikes = [e["step"] for e in store.spikes]
        except StoreError as e:
            out.append({"id": path.name, "error": str(e)})
            continue
        spec = m.replay_spec
        out.append({"id": path.name, "window": {"from": spec.start, "to": spec.stop},
                    "start_checkpoint": spec.start_checkpoint, "overrides": spec.overrides.to_dict(),
                    "status": m.status, "spikes": spikes,
                    "verification": spec.verification.to_dict() if spec.verification else None,
                    "reached": spec.reached.to_dict() if spec.reached else None,
                    "outcome": spike_outcome(recorded, spikes, spec)})
    return out
