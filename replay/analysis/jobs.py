"""`replay analyze` and `replay compare`: plan work items, run them as Ray tasks (or, asked for one worker with
no cluster to join, one at a time in the command's own process), keep what is done.

A work item (analysis/items.py) is one checkpoint and one block of layers (metrics), or one checkpoint of
a replay or of a compared run (weight distances). Each task reads the checkpoint from the store itself
(byte ranges of the tensors it needs), computes, writes its own chunks and then its done marker. Planning
skips items already done, so re-running computes only what is new, and an interrupted analysis resumes
where it stopped.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zarr

from replay import faults
from replay.analysis import results as R
from replay.analysis.items import DistanceItem, MetricItem, Source, weight_layout
from replay.analysis.names import DISTANCES
from replay.analysis.series import is_store, series_of
from replay.analysis.series import prepare as prepare_series
from replay.errors import ReplayError, StoreError, UsageError, disk_errors
from replay.launch.ray_cluster import RETRIES, cluster_address, ray_session, run_tasks, session_open, worker_options
from replay.replayer.listing import replays
from replay.store import RunStore
from replay.store.foreign import ForeignSeries, open_series
from replay.store.layout import model_key
from replay.store.lease import writing
from replay.store.location import Location, Where
from replay.store.manifest import PROBE_SAMPLES, PROBE_TOKENS
from replay.train.data import load_data

LAYER_BLOCK = 4                         # layers per work item


@dataclass
class Summary:
    computed: int = 0
    skipped: int = 0                    # already done
    nodes: set[str] = field(default_factory=set)
    seconds: float = 0.0


def run_item(item: MetricItem | DistanceItem) -> str:
    """One work item, start to finish, on a Ray worker (analysis/tasks.py: torch loads there, never in a
    driver that runs its items on Ray). Returns the node it ran on."""
    # lazy: ray (0.3 s) and torch (1 s) only where the item runs
    import ray

    from replay.analysis.tasks import run

    run(item)
    return ray.get_runtime_context().get_node_id()


# -- planning (driver) ----------------------------------------------------------------------------

def own_sources(store: RunStore) -> list[Source]:
    """A store's own committed checkpoints, or the checkpoints a series store analyses, by step."""
    if store.kind == "series":
        return _series_sources(series_of(store))
    return [Source(store.location, c.step, c.committed_at) for c in store.checkpoints()]


def _series_sources(found: ForeignSeries) -> list[Source]:
    return [Source(found.location, c.step, c.identity, found) for c in found.checkpoints]


def sources_at(where: Location, heads: int | None = None, layout: str | dict[str, Any] | None = None
               ) -> list[Source]:
    """The checkpoints at `where`: a run store's, or those of a folder of checkpoints replay did not record."""
    if is_store(where):
        return own_sources(RunStore.open(where))
    return _series_sources(open_series(where, heads=heads, layout=layout))


def checkpoint_sources(store: RunStore) -> list[Source]:
    """Every checkpoint a store's trajectory passes through, by step: a replay's own checkpoints
    preceded by the parent's checkpoint it started from."""
    own = own_sources(store)
    spec = store.manifest.replay   # a replay's (None for a run)
    if spec is not None:
        parent = store.location.resolve(spec.parent)
        step = spec.start_checkpoint
        start = Source(parent, step, _committed_at(Source(parent, step)))
        own = [start] + [s for s in own if s.step != start.step]
    return sorted(own, key=lambda s: s.step)


def _root_run(store: RunStore) -> RunStore:
    spec = store.manifest.replay
    return RunStore.open(store.location.resolve(spec.parent)) if spec is not None else store


def probe_batch(store: RunStore, n: int = PROBE_SAMPLES) -> dict[str, Any]:
    """The fixed probe batch: the first tokens of the first n samples the run trained on (step 0)."""
    run = _root_run(store)
    if run.n_steps == 0:
        raise StoreError(f"{run.location} has no recorded steps to take a probe batch from")
    cfg = run.manifest.config
    sample_ids = run.root["steps/sample_ids"]
    assert isinstance(sample_ids, zarr.Array), "the store's layout (store/run_store.py)"
    ids = np.asarray(sample_ids[0]).reshape(-1)[:n]
    data = load_data(cfg, run)
    T, n_tokens = data.block_size, min(data.block_size, PROBE_TOKENS)
    tokens = [data.tokens[int(i) * T: int(i) * T + n_tokens + 1].astype(np.int64).tolist() for i in ids]
    return {"sample_ids": [int(i) for i in ids], "tokens": tokens}


def plan_metrics(store: RunStore) -> tuple[list[MetricItem], int]:
    """The metric items of one store still to compute, and how many are already done."""
    cfg = store.manifest.config.model
    sources = checkpoint_sources(store)
    if not sources:
        return [], 0
    builtin = store.capabilities.builtin
    info = _root_run(store).manifest.model   # a transformers model of the user's own, with its probe rows
    if builtin:
        probe = probe_batch(store)
        rows = len(probe["tokens"]) * (len(probe["tokens"][0]) - 2)   # the inputs drop the last token
    elif info is not None and info.probe:
        probe = {"sample_ids": [], "tokens": info.probe}
        rows = len(info.probe) * (len(info.probe[0]) - 1)
    else:
        probe, rows = {"sample_ids": [], "tokens": None}, 0
    hf_config = None if builtin or info is None else info.transformers_config
    table = R.MetricsTable.open_or_create(store.location, cfg.n_layer, cfg.n_head, min(LAYER_BLOCK, cfg.n_layer),
                                          {"sample_ids": probe["sample_ids"], "rows": rows})
    # each checkpoint with the one and two before it (the update statistics' inputs)
    chain = [(src, sources[i - 1] if i >= 1 else None, sources[i - 2] if i >= 2 else None)
             for i, src in enumerate(sources)]
    index = table.plan([{"step": src.step, "source": src.location.relative(store.location),
                         "prev": prev and prev.step, "before": before and before.step,
                         "committed_at": src.committed_at} for src, prev, before in chain])
    done = table.done()
    items, skipped = [], 0
    for row, (src, prev, before) in zip(index, chain, strict=True):
        for b, block in enumerate(table.blocks()):
            if done[row, b]:
                skipped += 1
                continue
            items.append(MetricItem(store.location, row, b, block, cfg.n_embd, cfg.n_head, src, prev,
                                    before, probe["tokens"], hf_config))
    return items, skipped


def _committed_at(src: Source) -> float:
    return next(c.committed_at for c in RunStore.open(src.location).checkpoints() if c.step == src.step)


def plan_distances(store: RunStore, table: str, reference: list[Source], other: list[Source]
                   ) -> tuple[list[DistanceItem], int, list[int]]:
    """Distance items of the checkpoints `other` against `reference` at the steps both have, stored in
    `store`'s table; returns (items to compute, how many already done, the matching steps)."""
    ref = {s.step: s for s in reference}
    own = {s.step: s for s in other}
    steps = [s for s in own if s in ref]
    if not steps:
        return [], 0, []
    a, b = ref[steps[0]], own[steps[0]]
    shapes = a.open()[0].model_shapes(a.step)
    tensors = [model_key(name) for name in shapes]   # labelled by their keys in an unsharded run's shard
    if shapes != b.open()[0].model_shapes(b.step):
        raise UsageError(f"{a.location} and {b.location} hold different models (tensor names or shapes differ); "
                         "weight distances need the same architecture")
    dist = R.DistanceTable.open_or_create(store.location, table, a.location.relative(store.location),
                                          b.location.relative(store.location), tensors)
    index = dist.plan([{"step": s, "committed_at": [ref[s].committed_at, own[s].committed_at]} for s in steps])
    done = dist.done()
    items = [DistanceItem(store.location, table, index[i], ref[s], own[s], tensors)
             for i, s in enumerate(steps) if not done[index[i]]]
    return items, len(steps) - len(items), steps


def replay_stores(store: RunStore, progress: Callable[[str], None] = lambda s: None) -> list[RunStore]:
    """The run's replays that can be read; each one that cannot is named through `progress`."""
    out = []
    for path, opened in replays(store.location):
        if isinstance(opened, StoreError):
            progress(f"warning: replay {path.name} cannot be read, so it is not analysed: {opened}")
        else:
            out.append(opened)
    return out


# -- running (driver) -----------------------------------------------------------------------------

def execute(items: list[Any], slots: int | None, progress: Callable[[str], None] = lambda s: None,
            summary: Summary | None = None, every: int = 1) -> Summary:
    """Run work items on the connected Ray cluster, `slots` at a time (see `ray_session`), or with `slots`
    None one at a time in this process (see `task_slots`), reporting every `every`-th finished item (and
    the last)."""
    summary = summary or Summary()
    start = time.monotonic()
    where = "one at a time in this process" if slots is None else f"on {slots} Ray worker slot(s)"
    progress(f"{len(items)} work items {where}")

    def on_result(item, node):
        summary.computed += 1
        summary.nodes.add(node)
        if summary.computed % every == 0 or summary.computed == len(items):
            progress(f"[{summary.computed}/{len(items)}] {item.label}")
        faults.hit("analysis-driver-kill", summary.computed)

    if slots is None:
        for item in items:
            on_result(item, _run_here(item))
    elif items:
        _check_store_visible(items[0].store)
        run_tasks(run_item, items, max_in_flight=slots * 2, on_result=on_result)
    summary.seconds += time.monotonic() - start
    return summary


def _run_here(item: MetricItem | DistanceItem) -> str:
    """One item in this process, run again after a transient I/O error as a Ray task would be. Returns
    this machine's name, as the node it ran on."""
    # lazy (see run_item)
    from replay.analysis.tasks import run

    for _ in range(RETRIES):
        try:
            run(item)
            return socket.gethostname()
        except OSError:
            pass
    run(item)   # the last try: its error is the command's
    return socket.gethostname()


@contextlib.contextmanager
def task_slots(address: str | None, workers: int | None) -> Iterator[int | None]:
    """How many items run at once (`ray_session`), or None: one at a time in this process, without Ray,
    when one worker is asked for (`--workers 1`) with no cluster to join and no Ray session open here.
    A cluster's workers would start, import torch and read the store only to run the items in turn."""
    if workers == 1 and cluster_address(address) is None and not session_open():
        yield None
    else:
        with ray_session(address, workers) as slots:
            yield slots


def _check_store_visible(store: Location) -> None:
    """Fail with one line when the workers cannot see the store (no shared filesystem, or no credentials
    for the bucket)."""
    # lazy: ray (0.3 s) only once Ray work starts (launch/ray_cluster.py)
    import ray

    @ray.remote(num_cpus=0, **worker_options())
    def visible(where: Location) -> str:
        try:
            return "" if (where / "zarr.json").exists() else "it is not there"
        except ReplayError as e:
            return str(e)

    why = ray.get(visible.remote(store))
    if why:
        where = ("give every node the AWS_* variables of the bucket" if store.local is None
                 else "put the store on a filesystem every node mounts at the same path")
        raise UsageError(f"the Ray workers cannot read {store} ({why}): {where}")


def analyze(where: Where, address: str | None = None, workers: int | None = None,
            progress: Callable[[str], None] = lambda s: None, every: int = 1, *, heads: int | None = None,
            layout: str | dict[str, Any] | None = None, spikes: Sequence[int] = (),
            into: Location | None = None) -> Summary:
    """Metrics for every checkpoint of a run and of its replays, and each replay's weight distances
    against its parent; only what is not done yet. `where` may also be a folder of checkpoints replay did
    not record (analysis/series.py: `heads`, `layout` where they do not say, `spikes` to look before,
    `into` for the store of their results)."""
    store_path = Location.parse(where)
    with disk_errors(f"the analysis of {store_path}", store_path):
        return _analyze(store_path, address, workers, progress, every, heads, layout, spikes, into)


def _analyze(store_path: Location, address: str | None, workers: int | None, progress: Callable[[str], None],
             every: int, heads: int | None, layout: str | dict[str, Any] | None, spikes: Sequence[int],
             into: Location | None) -> Summary:
    run = RunStore.open(store_path) if is_store(store_path) else \
        prepare_series(store_path, into, heads, layout, list(spikes))
    if run.kind == "replay":
        raise UsageError(f"{store_path} is a replay; analyze the run it belongs to")
    if run.kind == "run":
        weight_layout(run)
        if not run.checkpoints():
            raise UsageError(f"{store_path} has no committed checkpoint to analyse")
        run.verify_records()   # its probe batch is read from the step log and the data
    with writing(run.location, "replay analyze") as lease, task_slots(address, workers) as slots:
        items: list[Any] = []
        skipped = 0
        for store in [run, *replay_stores(run, progress)]:
            new, done = plan_metrics(RunStore.open(store.location, mode="a"))
            items += new
            skipped += done
            if store.kind == "replay":
                distances, done, _ = plan_distances(store, "parent", own_sources(run), own_sources(store))
                items += distances
                skipped += done
        progress(f"{skipped} work items already done")
        # longest first (a block's probe runs every layer below it), so no long item is left for the end
        items.sort(key=lambda i: -i.block[1] if isinstance(i, MetricItem) else 0)
        for item in items:
            item.lease = lease.spec
        return execute(items, slots, progress, Summary(skipped=skipped), every)


def compare(a_where: Where, b_where: Where, address: str | None = None, workers: int | None = None,
            progress: Callable[[str], None] = lambda s: None, *, heads: int | None = None,
            layout: str | dict[str, Any] | None = None) -> dict[str, Any]:
    """Weight distances of B against A at their matching checkpoints, stored in A's analysis group (for a
    folder of checkpoints replay did not record, its series store: analysis/series.py)."""
    a_path, b_path = Location.parse(a_where), Location.parse(b_where)
    if a_path == b_path:
        raise UsageError("compare needs two different stores")
    reference, other = sources_at(a_path, heads, layout), sources_at(b_path, heads, layout)
    if not {s.step for s in reference} & {s.step for s in other}:
        raise UsageError(f"{a_path} and {b_path} have no checkpoint at a common step; record both with the "
                         "same --checkpoint-every")
    a = RunStore.open(a_path) if is_store(a_path) else prepare_series(a_path, None, heads, layout, [])
    table = compare_table_name(a.location, b_path)
    with disk_errors(f"the distances of {b_path} in {a.location}", a.location), \
            writing(a.location, "replay compare") as lease, task_slots(address, workers) as slots:
        items, skipped, steps = plan_distances(a, table, reference, other)
        for item in items:
            item.lease = lease.spec
        execute(items, slots, progress)
    entry = R.read_distances(a.location)[table]
    return {"reference": str(a_path), "other": str(b_path), "table": f"analysis/distances/{table}",
            "steps": entry["step"].tolist(), "tensors": entry["tensor"],
            **{m: entry[m].tolist() for m in DISTANCES}, "computed": len(items), "reused": skipped}


def compare_table_name(a: Location, b: Location) -> str:
    rel = b.relative(a)
    return "vs-" + "".join(c if c.isalnum() or c in "-_" else "_" for c in rel).strip("_")
