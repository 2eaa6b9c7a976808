"""The analysis work items: what the driver (analysis/jobs.py) plans and a Ray worker (analysis/tasks.py)
computes. An item carries store locations, never tensors: the task reads what it needs from the store itself."""

from __future__ import annotations

from dataclasses import dataclass

from replay.errors import UsageError
from replay.store import RunStore
from replay.store.foreign import ForeignSeries
from replay.store.layout import Layout, layout_of
from replay.store.location import Location


@dataclass
class Source:
    location: Location                  # the store holding the checkpoint, or the folder of a foreign series
    step: int
    committed_at: float | str = 0.0     # identifies this checkpoint (a rewound run writes a new one; a foreign
                                        # checkpoint rewritten has another identity)
    series: ForeignSeries | None = None   # a checkpoint replay did not record: read through its series

    def open(self) -> tuple[RunStore | ForeignSeries, Layout]:
        """What reads the checkpoint's tensors (`read_model`, `model_shapes`), and where its weights are."""
        if self.series is not None:
            return self.series, Layout.from_dict(self.series.layout)
        store = RunStore.open(self.location)
        return store, weight_layout(store)


@dataclass
class MetricItem:
    store: Location                     # where the results go
    row: int
    block_index: int
    block: tuple[int, int]
    n_embd: int
    n_head: int
    ckpt: Source
    prev: Source | None
    before: Source | None
    probe: list[list[int]] | None       # token rows of the probe batch (block_size + 1 tokens each for the
                                        # built-in GPT-2, the model's input rows for a transformers model);
                                        # None: a model of the user's own without one (no probe)
    transformers_config: dict | None = None   # a transformers model of the user's own (hf_probe_metrics)
    lease: str = ""                     # the spec of the driver's lease: checked before writing

    @property
    def label(self) -> str:
        return f"checkpoint {self.ckpt.step} layers {self.block[0]}-{self.block[1] - 1}"


@dataclass
class DistanceItem:
    store: Location
    table: str
    row: int
    reference: Source
    other: Source
    tensors: list[str]
    lease: str = ""

    @property
    def label(self) -> str:
        return f"distances {self.table} at step {self.other.step}"


def weight_layout(store: RunStore) -> Layout:
    """Where the store's checkpoints keep each layer's weights (store/layout.py), or one line saying why not."""
    m = store.manifest
    layout = layout_of(m.launcher, m.layout)
    if layout is None:
        raise UsageError(f"{store.location} was recorded by a loop that named no weight layout, so its per-head "
                         "metrics cannot be found: record with "
                         "Loop(..., layout='nanogpt' | 'hf-gpt2' | 'hf-llama' | {...})")
    return layout
