"""The analysis of checkpoints replay did not record (a folder or prefix of them: store/foreign/).

Their results need a store: a run store of kind "series", by default `replay-analysis` inside the
checkpoints' folder (`--into` puts it elsewhere). It holds no checkpoint, only what the analysis writes and
a manifest naming the checkpoints (where, which format, the head count and layout found, the training
losses they record); the spikes of those losses, or the steps given with `--spike`, are its spikes. Every
command that reads an analysis (`report`, `compare`) finds it from the checkpoints' folder too.
"""

from __future__ import annotations

import time
from typing import Any

from replay.config import Launcher, ModelConfig, RunConfig
from replay.errors import UsageError
from replay.recorder.spikes import SpikeDetector
from replay.store import RunStore
from replay.store.foreign import ForeignSeries, open_series
from replay.store.lease import writing
from replay.store.lifecycle import no_data
from replay.store.location import Location
from replay.store.manifest import Manifest, SeriesInfo

INTO = "replay-analysis"   # the series store's default place, inside the checkpoints' folder


def is_store(where: Location) -> bool:
    return (where / "zarr.json").exists()


def analysis_store(where: Location) -> Location:
    """Where the analysis of `where` is: a run store itself, or the series store of a folder of checkpoints."""
    if is_store(where) or not is_store(where / INTO):
        return where
    return where / INTO


def series_of(store: RunStore) -> ForeignSeries:
    """The checkpoints a series store analyses, opened again as it found them."""
    info = store.manifest.series
    assert info is not None, "a store of kind series names its checkpoints"
    return open_series(store.location.resolve(info.location), heads=info.heads, layout=info.layout)


def prepare(checkpoints: Location, into: Location | None, heads: int | None, layout: str | dict[str, Any] | None,
            spikes: list[int]) -> RunStore:
    """The series store of the checkpoints at `checkpoints`, created or brought up to date (their losses, their
    spikes) under its lease; the checkpoints are found (or refused, in one line) before anything is written."""
    series = open_series(checkpoints, heads=heads, layout=layout)
    where = into or checkpoints / INTO
    info = SeriesInfo(location=checkpoints.relative(where), format=series.format, heads=series.n_head,
                      layout=series.layout, losses=[[s, v] for s, v in sorted(series.losses.items())])
    with writing(where, "replay analyze"):
        if is_store(where):
            store = RunStore.open(where, mode="a")
            had = store.manifest.series
            if had is None or store.location.resolve(had.location) != checkpoints:
                raise UsageError(f"{where} holds the analysis of something else: give another --into")
            store.update_manifest(series=info, config=_config(series))
        else:
            store = RunStore.create(where, Manifest(
                kind="series", config=_config(series), world_size=1, launcher=Launcher.CUSTOM,
                data=no_data(f"checkpoints replay did not record ({series.format}) at {checkpoints}"),
                created=time.time(), layout=series.layout, series=info, status="complete"))
        store.truncate_spikes(0)
        for event in _spikes(series, store.manifest.config, spikes):
            store.add_spike(event)
    return store


def _config(series: ForeignSeries) -> RunConfig:
    cfg = RunConfig()
    cfg.model = ModelConfig(n_layer=series.n_layer, n_head=series.n_head, n_embd=series.n_embd)
    return cfg


def _spikes(series: ForeignSeries, cfg: RunConfig, given: list[int]) -> list[dict[str, Any]]:
    """The spikes of the checkpoints' training losses (the recorder's online rule), and the steps given."""
    detector = SpikeDetector(cfg.spike)
    events = {}
    for step, loss in sorted(series.losses.items()):
        event = detector.update(step, loss)
        if event is not None:
            events[step] = {**event.to_dict(), "source": "loss"}
    for step in given:
        events[step] = {"step": step, "source": "given"}
    return [events[s] for s in sorted(events)]
