"""`replay diff STORE --step N` with a replay's overrides: where one step, run twice from the same restored
state, first parts. Side A is the step as recorded, side B the step with the overrides; both restore the
checkpoint at N (the model and every RNG) and train one rank's recorded micro-batches of step N (rank 0's, or
`--rank`'s, from that rank's RNG states; `--rank all`: every rank's in turn, each from its RNG states, their
gradients averaged as DDP's, up to the order of the sum) forward and backward, no optimizer step, in this process.

Every tensor the step produces is compared, in execution order: each module's output (forward), the gradient
of each module's output (backward), every attention call's output O and gradients dO, dQ, dK, dV (per head),
and each parameter's gradient at the end. Side A runs first and keeps each tensor in a temporary file;
side B compares each of its tensors with A's as it is produced, by a CRC-32C of its bytes (`_Comparison`), and
reads A's from the file only where they differ, for the deviation (max and mean absolute, relative, in
ULPs of A's largest magnitude in A's format). The first
differing tensor in B's order is the first difference. For the attention calls, per head:
the deviation of O, dO, dQ, dK, dV, and of `delta = rowsum(dO * O)` with the sign bias of its error (Qiu & Yao's
mechanism: a biased delta error has one sign), and how aligned the rank-1 terms of W_Q's gradient error are
across tokens (1: every token's term points one way, as a bias does).

Without overrides both sides are the record: a step that runs the same twice in one process reports no
difference (and one that does not, its first nondeterministic operation). The built-in trainer's runs (GPT-2)
run in this process and need a checkpoint at step N (a replay with `--checkpoint-every 1` writes one); a side as
recorded must give the loss the store logged. A script's run (`_ScriptSide`) is replayed through the script
instead, once per side, its `Loop` tracing the step on one rank into a folder (recorder/step_trace.py), and the
two traces compared alike.

`replay diff A B --step N` runs the step as each of two runs (or replays) ran it, from the state and samples they
share at N (checked bit for bit first: the model, the RNG states, the rank's samples and their tokens), side B
with its own config; the answer lists how B's config differs from A's. A replay that starts at N from its
parent's checkpoint there holds that checkpoint's state without a copy of its own.

`capture` writes one side's trace (each tensor's digest and statistics, no tensor) into the store, and
`diff(..., against=NAME)` compares this process's step with it: the same step taken on another machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import shutil
import socket
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np
import torch

from replay.config import RunConfig
from replay.errors import ReplayError, UsageError
from replay.kernels.plan import AttentionPlan
from replay.kernels.registry import apply_plan
from replay.launch.script import ScriptServer
from replay.recorder.environment import set_rng_state
from replay.recorder.host import cpu_model
from replay.recorder.step_trace import (
    CALL,
    Keep,
    See,
    TraceFile,
    Tracer,
    attention_traced,
    call_phase,
    digest,
    raw,
)
from replay.replayer import replays
from replay.replayer.overrides import apply as apply_overrides
from replay.replayer.replays import ReplayRequest
from replay.store import RunStore
from replay.store.lease import writing
from replay.store.location import Location
from replay.store.manifest import TraceRequest
from replay.store.overrides import Overrides
from replay.store.step_diff import Deviation, Difference, HeadDiff, StepDiff
from replay.store.tensors import same_bits
from replay.store.verification import Verification
from replay.train.data import load_data
from replay.train.model import build_model, lm_loss

_NAME = re.compile(r"[A-Za-z0-9._-]+")


class Side(Protocol):
    """One side of a diff: a step run from a state, its tensors handed out in execution order."""

    notes: list[str]   # what the side's run said of itself that the answer must carry

    def play(self, see: See, keep: Keep) -> None:
        """Run the step, every tensor to `see` as it is produced, an attention call's to `keep` too."""

    def trace(self) -> TraceFile:
        """Run the step into a trace (the caller closes it)."""


@dataclass
class _Side:
    """A built-in run's side, run in this process: the config of the run it comes from (the model it builds),
    the config it runs with (its attention plan and precision), the run's data, one rank's micro-batches of the
    step and that rank's checkpoint it restores."""

    built: RunConfig
    runs: RunConfig
    data: Any
    ids: list[np.ndarray]      # per rank played, its micro-batches' sample ids
    shard: dict[str, Any]      # rank 0's: the replicated model
    rngs: list[Any]            # per rank played, its RNG states
    losses: dict[int, float]   # per rank played, the loss the store logged for its micro-batches at the step
    store: str                 # the run's location, for the notes
    notes: list[str] = field(default_factory=list)

    def play(self, see: See, keep: Keep) -> None:
        _run_side(self, see, keep)

    def trace(self) -> TraceFile:
        traced = TraceFile.temporary()
        try:
            _run_side(self, traced.see, traced.keep)
        except BaseException:
            traced.close()
            raise
        return traced


@dataclass
class _ScriptSide:
    """A script's run's side: a replay of the one step, started as `replay run` starts it, that traces the step
    on rank `rank` into a temporary folder (recorder/step_trace.py) and is removed once it has run."""

    location: Location
    step: int
    overrides: Overrides
    rank: int
    label: str                                   # "a" or "b": the replay's name
    ranks: ScriptServer | None = None            # the script's ranks, kept up between the sides where they can be
    notes: list[str] = field(default_factory=list)   # what its replay's verification says against the record

    def play(self, see: See, keep: Keep) -> None:
        with self.trace() as traced:
            traced.play(see, keep)

    def trace(self) -> TraceFile:
        folder = Path(tempfile.mkdtemp(prefix="replay-diff-"))
        name = f"diff-{self.step}-{self.label}-{os.getpid()}"
        request = ReplayRequest(self.step, self.step, name=name, overrides=self.overrides,
                                trace=TraceRequest(self.step, self.rank, str(folder)))
        try:
            done = replays.run(self.location, request, ranks=self.ranks, command="replay diff")
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        finally:
            kept = self.location / "replays" / name
            if kept.holds_anything():
                kept.remove_tree()
        traced = TraceFile.open(folder, owned=True)
        if traced is None:
            shutil.rmtree(folder, ignore_errors=True)
            raise ReplayError(f"the script's replay of step {self.step} ran but left no trace in {folder}: rank "
                              f"{self.rank} never began the step through `loop.steps()`, or its process cannot "
                              "write there (a temporary folder of its own: set TMPDIR to a folder both share)")
        self.notes += _verified(done.verification, self.step, self.overrides, self.label.upper())
        return traced


def _verified(verification: Verification | None, step: int, overrides: Overrides, side: str) -> list[str]:
    """What a side's replay says against the record where it is not what the diff takes it for: the side as
    recorded not the record bit for bit, or the steps before `step` of the side with overrides not the record's."""
    if verification is None or verification.divergence is None:
        return []
    first = verification.divergence.step
    if overrides.to_dict() and first >= step:   # the overrides' own difference, from the step on
        return []
    how = "with its overrides" if overrides.to_dict() else "as recorded"
    return [f"side {side} ({how}): its replay is not the record bit for bit from step {first} on "
            f"({verification.describe()}): the sides are this machine's runs of the step, not the record's"]


def _as_run(location: Location, step: int, rank: int | None) -> _Side:
    """Step `step` of the built-in run at `location` on rank `rank`'s micro-batches and RNG (None: every rank's,
    one after the other), as the store ran it."""
    store = RunStore.open(location)
    manifest = store.manifest
    if not store.capabilities.builtin:
        raise UsageError(f"replay diff A B runs two built-in runs' steps; {location} is a run of a script of its own: "
                         "diff the run with the overrides of the replay (replay diff RUN --step N --attention ...)")
    held = _state_at(location, store, step)
    if held is None:
        have = ", ".join(str(c.step) for c in store.checkpoints()) or "none"
        raise UsageError(f"{location} has no committed checkpoint at step {step} (it has {have}): `replay run "
                         f"{location} --from {step} --to {step} --checkpoint-every 1` makes a replay that has one; "
                         "diff that replay's store")
    if not store.first_step <= step < store.end_step:
        raise UsageError(f"{location}'s step log holds steps {store.first_step}..{store.end_step - 1}, not step "
                         f"{step}: diff a step the run trained")
    parent = RunStore.open(location.resolve(manifest.replay.parent)) if manifest.replay else None
    data = load_data(manifest.config, parent or store)
    if rank is not None and not 0 <= rank < manifest.world_size:
        raise UsageError(f"--rank {rank}: {location} was recorded on ranks 0..{manifest.world_size - 1}")
    ranks = range(manifest.world_size) if rank is None else [rank]
    logged = store.read_steps(["sample_ids", "rank_loss"], start=step, stop=step + 1)
    recorded_ids = logged["sample_ids"][0]   # [rank, micro, ...]
    losses = np.atleast_1d(np.asarray(logged["rank_loss"][0], np.float64))
    shard = held.read_shard(step, 0)   # the replicated model is rank 0's to keep; each rank keeps its own RNG
    rngs = [shard["rng"] if r == 0 else held.read_shard(step, r)["rng"] for r in ranks]
    if "model" not in shard["state"].get("replicated", {}):
        raise UsageError(f"{location}'s checkpoints hold each rank's piece of the model (DeepSpeed ZeRO): replay diff "
                         "restores a whole model, from a run of plain or DDP ranks")
    return _Side(manifest.config, manifest.config, data, [recorded_ids[r] for r in ranks], shard, rngs,
                 {r: float(losses[r]) for r in ranks}, str(location))


def _state_at(location: Location, store: RunStore, step: int) -> RunStore | None:
    """The store that holds the run's state at the start of `step`: its own committed checkpoint there, or,
    for a replay whose window starts from its parent's checkpoint at that step, the parent's."""
    if any(c.step == step for c in store.checkpoints()):
        return store
    spec = store.manifest.replay
    if spec is not None and spec.start == spec.start_checkpoint == step:
        parent_location = location.resolve(spec.parent)
        return _state_at(parent_location, RunStore.open(parent_location), step)
    return None


@contextlib.contextmanager
def _prepare(location: Location, step: int, overrides: Overrides,
             rank: int | None = 0) -> Iterator[tuple[Side, Side]]:
    """Side A, the step as the store ran it, and side B, the same with `overrides` (a script's: on its ranks,
    kept up between the two where the script can serve replays)."""
    store = RunStore.open(location)
    if overrides.skip or overrides.drop or overrides.lr_scale is not None:
        raise UsageError("replay diff compares one step's forward and backward: --skip, --drop and --lr-scale "
                         "change no operation of it (replay run shows what they do)")
    if not store.capabilities.builtin:
        played = _check_script_step(location, store, step, overrides, rank)
        script_a = _ScriptSide(location, step, Overrides(), played, "a")
        script_b = _ScriptSide(location, step, overrides, played, "b")
        with _script_served(store, script_a, script_b):
            yield script_a, script_b
        return
    a = _as_run(location, step, rank)
    side_b = apply_overrides(a.runs, overrides, (step, step), store.capabilities)
    yield a, dataclasses.replace(a, runs=side_b, notes=[])


def _check_script_step(location: Location, store: RunStore, step: int, overrides: Overrides,
                       rank: int | None) -> int:
    """A script's run whose step `step` a replay can trace on `rank`, with `overrides`: checked here as `replay
    run` checks a replay, before either side starts. Returns the rank."""
    manifest = store.manifest
    if store.kind != "run":
        raise UsageError(f"{location} is a replay of a script's run: diff the run against it (replay diff RUN "
                         f"{location} --step N), or the run with its overrides (replay diff RUN --step N ...)")
    store.check_relaunchable("replay diff")
    if store.capabilities.multi_node:
        raise UsageError(f"{location} was recorded on {store.capabilities.nodes} nodes: replay diff starts a "
                         "script's ranks on this machine; diff a run of one node")
    if rank is None:
        raise UsageError("--rank all: a script's ranks each train their own micro-batches in a process of their "
                         "own; diff one rank's (--rank R)")
    if not 0 <= rank < manifest.world_size:
        raise UsageError(f"--rank {rank}: {location} was recorded on ranks 0..{manifest.world_size - 1}")
    if manifest.sharding is not None or store.capabilities.sharded:
        raise UsageError(f"{location}'s ranks each hold a piece of the model or its gradients (FSDP2, DeepSpeed "
                         "ZeRO): replay diff traces a whole model, of plain or DDP ranks")
    if not 0 <= step < store.end_step:
        raise UsageError(f"{location}'s step log holds steps 0..{store.end_step - 1}, not step {step}: diff a step "
                         "the run trained")
    apply_overrides(manifest.config, overrides, (step, step), store.capabilities)
    return rank


@contextlib.contextmanager
def _script_served(store: RunStore, *sides: _ScriptSide) -> Iterator[None]:
    """The sides' replays on the script's ranks, kept up between them where the script can serve replays."""
    assert store.manifest.command is not None, "a script's run holds its command"
    with ScriptServer(store.manifest.command, keep=store.capabilities.serves_replays) as server:
        for side in sides:
            side.ranks = server
        yield


def _two_runs(location: Location, other: Location, step: int,
              rank: int | None) -> tuple[_Side, _Side, dict[str, list[Any]]]:
    """Step `step` of two runs (or replays) as each ran it, from the state and samples they share at that step;
    with how the second's config differs from the first's."""
    a, b = _as_run(location, step, rank), _as_run(other, step, rank)
    model_a, model_b = a.shard["state"]["replicated"]["model"], b.shard["state"]["replicated"]["model"]
    if model_a.keys() != model_b.keys():
        raise UsageError(f"{location} and {other} are not the same model (their parameters differ): replay diff "
                         "compares one step of two runs of one model")
    parted = next((key for key in model_a if not same_bits(model_a[key], model_b[key])), None)
    if parted is None and not same_bits(a.rngs, b.rngs):
        parted = "the random generators' states"
    if parted is not None:
        raise UsageError(f"{location} and {other} hold different states at step {step} ({parted} differs): replay "
                         "diff runs one step from one state; diff the step where they part, the last whose state "
                         "they share")
    if not same_bits(a.ids, b.ids) or not all(same_bits(a.data.batch(x), b.data.batch(y)) for xs, ys in
                                          zip(a.ids, b.ids, strict=True) for x, y in zip(xs, ys, strict=True)):
        raise UsageError(f"{location} and {other} train different samples at step {step} ({_whose(rank)}): replay diff "
                         "compares one step on the same samples")
    return a, b, _changes(a.runs, b.runs)


def _changes(a: RunConfig, b: RunConfig) -> dict[str, list[Any]]:
    """How config `b` differs from `a`: each differing key (dotted) with [a's value, b's]."""
    flat_a, flat_b = _flat(a.to_dict()), _flat(b.to_dict())
    return {k: [flat_a.get(k), flat_b.get(k)] for k in sorted(flat_a.keys() | flat_b.keys())
            if flat_a.get(k) != flat_b.get(k)}


@contextlib.contextmanager
def _two_script_runs(location: Location, other: Location, step: int,
                     rank: int | None) -> Iterator[tuple[_ScriptSide, _ScriptSide, dict[str, list[Any]]]]:
    """Step `step` of a script's run and a replay of it (or two replays of it) as each ran it: each a replay of
    the run's step with the overrides that act on it there, from the run's state at the step, which both hold
    when no override of theirs acted before it."""
    (root, ours), (root_b, theirs) = _as_script_replay(location, step), _as_script_replay(other, step)
    if root != root_b:
        raise UsageError(f"{location} and {other} are not replays of one script's run: replay diff A B of a script's "
                         "runs compares a run with its replays")
    store = RunStore.open(root)
    played = _check_script_step(root, store, step, ours, rank)
    _check_script_step(root, store, step, theirs, rank)
    a, b = _ScriptSide(root, step, ours, played, "a"), _ScriptSide(root, step, theirs, played, "b")
    recorded, caps = store.manifest.config, store.capabilities   # the configs the two sides run the step with
    changes = _changes(apply_overrides(recorded, ours, (step, step), caps),
                       apply_overrides(recorded, theirs, (step, step), caps))
    with _script_served(store, a, b):
        yield a, b, changes


def _as_script_replay(location: Location, step: int) -> tuple[Location, Overrides]:
    """A script's run, or a replay of it, at `step`: the run's location and the overrides that act on the step's
    computation there; refused where the store's state at the step is not the run's (an override of the replay
    acted before it)."""
    store = RunStore.open(location)
    spec = store.manifest.replay
    if spec is None:
        return location, Overrides()
    if not spec.start_checkpoint <= step <= spec.stop:
        raise UsageError(f"{location} replays steps {spec.start_checkpoint}..{spec.stop}, not step {step}")
    given = spec.overrides
    computing = Overrides(attention=given.attention, layers=given.layers, heads=given.heads, units=given.units,
                          precision=given.precision, fix=given.fix, hp_delta=given.hp_delta)
    if step in spec.skip or any(s == step for s, _ in spec.drop):
        raise UsageError(f"{location} {'skips' if step in spec.skip else 'leaves samples out of'} step {step}: it did "
                         "not train the step's samples; replay diff compares one step on the same samples")
    acted = [(s, f"it skips step {s}") for s in spec.skip] + [(s, f"it leaves samples of step {s} out")
                                                             for s, _ in spec.drop]
    if computing.to_dict() or given.lr_scale is not None:
        acted.append((spec.start, f"its overrides from step {spec.start}"))
    parted = min((a for a in acted if a[0] < step), default=None)   # the first step where it parts from the run
    if parted is not None:
        raise UsageError(f"{location} does not hold the run's state at step {step} ({parted[1]}): replay diff A B runs "
                         f"one step from one state; diff step {parted[0]}, where it parts from the run")
    return location.resolve(spec.parent), computing if step >= spec.start else Overrides()


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def capture(location: Location, step: int, overrides: Overrides, name: str, rank: int | None = 0,
            keep: tuple[str, ...] = ()) -> tuple[int, list[str]]:
    """`replay diff --capture NAME`: the step as the store ran it (with `overrides`, if any), every tensor's
    digest and statistics in execution order, written into the store as the trace NAME, for a comparison in
    another process or on another machine (`diff(..., against=NAME)`); whole tensors only of the modules and
    attention calls `keep` names (`attention 1`: every call of layer 1's attention, with its W_Q input; a
    module path: the module and those inside it), so that the comparison has their deviations. Returns how
    many tensors the trace covers, and what the side's run said of itself (a side as recorded that is not its
    record here), which the trace keeps too."""
    check_name(name, "--capture")
    entries: list[dict[str, Any]] = []
    whole: dict[int, torch.Tensor] = {}   # the entries kept whole, by their place in `entries`

    def note(phase: str, where: str, what: str, t: torch.Tensor) -> None:
        t = t.detach().contiguous().cpu()
        if _kept(where, keep):
            whole[len(entries)] = t.clone()
        entries.append({"key": f"{phase}|{where}|{what}", "shape": list(t.shape), "dtype": str(t.dtype),
                        "digest": digest(t), "stats": _stats(t)})

    wq_inputs: dict[str, torch.Tensor] = {}   # the W_Q inputs of the attention calls kept whole

    def note_input(key: str, t: torch.Tensor) -> None:
        call, _, what = key.partition("|")
        if what == "x" and _kept(call, keep):
            wq_inputs[call] = t.clone()

    with _prepare(location, step, overrides, rank) as (_, side):
        side.play(note, note_input)
    with writing(location, "replay diff --capture"):
        store = RunStore.open(location, mode="a")
        for i, t in whole.items():   # the tensors first, the document that names them last
            entries[i]["kept"] = store.write_trace_tensor(name, f"{i}", raw(t).numpy())
        kept_inputs = {call: {"shape": list(t.shape), "dtype": str(t.dtype),
                              "kept": store.write_trace_tensor(name, f"x{j}", raw(t.contiguous()).numpy())}
                       for j, (call, t) in enumerate(sorted(wq_inputs.items()))}
        store.write_trace(name, {"step": step, "rank": rank, "overrides": overrides.to_dict(), "machine": _machine(),
                                 "entries": entries, "wq_inputs": kept_inputs, "notes": side.notes})
    return len(entries), side.notes


def _kept(where: str, keep: tuple[str, ...]) -> bool:
    """Whether `--keep` names this module or attention call (or a module around it)."""
    return any(where == k or where.startswith((f"{k}#", f"{k}.")) for k in keep)


def _trace_tensor(store: RunStore, entry: dict[str, Any]) -> torch.Tensor:
    """A tensor a trace kept whole, as it was captured."""
    dtype = getattr(torch, entry["dtype"].removeprefix("torch."))
    raw = torch.from_numpy(store.read_trace_tensor(entry["kept"]).copy())
    return (raw.view(dtype) if dtype.is_floating_point else raw).reshape(entry["shape"])


def check_name(name: str, option: str) -> None:
    """A trace's (`--capture`) or a saved diff's (`--save`) name: a directory of the store."""
    if not _NAME.fullmatch(name):
        what = "a trace's" if option == "--capture" else "a saved diff's"
        raise UsageError(f"{option} {name!r}: {what} name is letters, digits, '.', '_' and '-'")


def save(location: Location, result: StepDiff, name: str) -> None:
    """`replay diff --save NAME`: the answer kept in the store, where `replay report` shows it."""
    check_name(name, "--save")
    with writing(location, "replay diff --save"):
        RunStore.open(location, mode="a").write_diff(name, result.to_dict())


def diff(location: Location, step: int, overrides: Overrides, against: str | None = None,
         other: Location | None = None, rank: int | None = 0) -> StepDiff:
    """Step `step` of the run at `location`, as the store ran it (A) and with `overrides` (B); or, `against` a
    trace `capture` wrote (A, from wherever it ran), this process's step with `overrides` (B), compared by each
    tensor's digest, with the two sides' statistics where they differ; or, given an `other` run (or replay) that
    shares the step's state and samples, the step as each of the two ran it."""
    if against is not None:
        return _against(location, step, overrides, against, rank)
    changes: dict[str, list[Any]] | None = None
    with contextlib.ExitStack() as held:
        if other is None:
            a, b = held.enter_context(_prepare(location, step, overrides, rank))
        elif overrides.to_dict():
            raise UsageError("replay diff A B runs the step as each run ran it: leave out the overrides (or diff one "
                             "store against its overrides: replay diff A --step N --attention ...)")
        elif not RunStore.open(location).capabilities.builtin:
            a, b, changes = held.enter_context(_two_script_runs(location, other, step, rank))
        else:
            a, b, changes = _two_runs(location, other, step, rank)
        with contextlib.ExitStack() as traces:
            # a script's side B replays first: an override of it that reaches nothing is refused before A is paid for
            traced_b = traces.enter_context(b.trace()) if isinstance(b, _ScriptSide) else None
            comparison = _Comparison(traces.enter_context(a.trace()))   # A's tensors, one after another, in a file
            (b if traced_b is None else traced_b).play(comparison.see, comparison.heads.put)
    return StepDiff(str(location), step, overrides.to_dict(), comparison.compared, _first(comparison.differences),
                    comparison.differences, comparison.heads_with_scores(), comparison.only_in_a(),
                    comparison.only_in_b, other=None if other is None else str(other), changes=changes, rank=rank,
                    notes=list(dict.fromkeys(a.notes + b.notes)))


class _Comparison:
    """Side B's tensors, as they are produced, against side A's trace: each by its CRC-32C, read back from A's
    file only where they differ; the S and P deviations per head; the per-head signals call by call."""

    def __init__(self, a: TraceFile):
        self.a = a
        self.compared = 0
        self.differences: list[Difference] = []
        self.only_in_b: list[str] = []
        self.produced: set[str] = set()
        self.scores: dict[tuple[int, int], dict[str, float]] = {}
        self.heads = _HeadStats(a.call_tensor)

    def see(self, phase: str, where: str, what: str, t: torch.Tensor) -> None:
        key = f"{phase}|{where}|{what}"
        self.produced.add(key)
        t = t.detach().contiguous().cpu()
        theirs = self.a.entries.get(key)
        if theirs is None:   # an output one side's attention gives and the other's does not (its weights)
            self.only_in_b.append(key.replace("|", " "))
            return
        self.compared += 1
        same = theirs.dtype == t.dtype and theirs.shape == tuple(t.shape) and theirs.digest == digest(t)
        read = None if same else self.a.read(theirs) if theirs.shape == tuple(t.shape) else \
            torch.full_like(t, math.nan)
        if what in ("S", "P"):
            _note_scores(self.scores, where, what, [0.0] * t.shape[1] if read is None else _per_head_max(read, t))
        if read is not None:
            self.differences.append(Difference(self.compared - 1, phase, where, what, list(t.shape),
                                               str(t.dtype).removeprefix("torch."), _deviation(read, t)))

    def only_in_a(self) -> list[str]:
        return [key.replace("|", " ") for key in self.a.entries if key not in self.produced
                and not key.startswith("input|")]

    def heads_with_scores(self) -> list[HeadDiff]:
        return _with_scores(self.heads.done(), self.scores)


def _against(location: Location, step: int, overrides: Overrides, name: str, rank: int | None) -> StepDiff:
    trace = RunStore.open(location).trace(name)
    if trace is None:
        raise UsageError(f"{location} has no trace {name!r}: `replay diff {location} --step {step} --capture {name}` "
                         "writes one")
    if trace["step"] != step:
        raise UsageError(f"the trace {name!r} is of step {trace['step']}, not {step}")
    if trace.get("rank", 0) != rank:
        taken = trace.get("rank", 0)
        raise UsageError(f"the trace {name!r} is of {_whose(taken)} micro-batches, not {_whose(rank)}: give --rank "
                         f"{'all' if taken is None else taken}")
    store = RunStore.open(location)
    theirs = {e["key"]: e for e in trace["entries"]}
    differences: list[Difference] = []
    produced: list[str] = []
    inputs = trace.get("wq_inputs", {})

    def theirs_of(key: str) -> torch.Tensor | None:   # what the trace kept whole, for the per-head signals
        call, _, what = key.partition("|")
        entry = inputs.get(call) if what == "x" else theirs.get(f"{call_phase(key)}|{key}")
        return None if entry is None or "kept" not in entry else _trace_tensor(store, entry)

    def compare(phase: str, where: str, what: str, t: torch.Tensor) -> None:
        key = f"{phase}|{where}|{what}"
        produced.append(key)
        entry = theirs.get(key)
        if entry is None:
            return
        t = t.detach().contiguous().cpu()
        whole = _trace_tensor(store, entry) if "kept" in entry else None
        if whole is not None and what in ("S", "P") and whole.shape == t.shape:
            _note_scores(scores, where, what, _per_head_max(whole, t))
        if entry["digest"] != digest(t) or entry["shape"] != list(t.shape) or entry["dtype"] != str(t.dtype):
            differences.append(Difference(len(produced) - 1, phase, where, what, list(t.shape),
                                          str(t.dtype).removeprefix("torch."),
                                          None if whole is None else _deviation(whole, t),
                                          {"theirs": entry["stats"], "ours": _stats(t)}))

    scores: dict[tuple[int, int], dict[str, float]] = {}
    heads = _HeadStats(theirs_of)
    with _prepare(location, step, overrides, rank) as (_, side):
        side.play(compare, heads.put)
    ours = set(produced)
    compared = sum(1 for key in produced if key in theirs)
    return StepDiff(str(location), step, overrides.to_dict(), compared, _first(differences),
                    differences, _with_scores(heads.done(), scores) if inputs else [],
                    [key.replace("|", " ") for key in theirs if key not in ours],
                    [key.replace("|", " ") for key in produced if key not in theirs],
                    against={"trace": name, "machine": trace["machine"], "overrides": trace["overrides"]}, rank=rank,
                    notes=list(dict.fromkeys([f"the trace: {note}" for note in trace.get("notes", [])] + side.notes)))


def _deviation(a: torch.Tensor, b: torch.Tensor) -> Deviation:
    """How far B is from A, over their finite values (an inf or NaN on one side only makes it infinite)."""
    if not a.numel() or a.shape != b.shape:
        return Deviation(math.inf, math.inf, math.inf, math.inf) if a.shape != b.shape else \
            Deviation(0.0, 0.0, 0.0, 0.0)
    work = torch.float64 if a.dtype == torch.float64 else torch.float32   # a narrower type converts exactly
    aw, bw = a.to(work), b.to(work)
    d = (bw - aw).abs()
    if bool(torch.isfinite(d).all()):   # then so is every value of both sides: no masks to build
        largest, peak = float(d.max()), float(aw.abs().max())
        return Deviation(largest, float(d.mean()), largest / peak if peak else (math.inf if largest else 0.0),
                         _ulps(a, peak, largest))
    finite = torch.isfinite(aw) & torch.isfinite(bw)
    d = d[finite]
    unlike = ~finite & ~((aw == bw) | (torch.isnan(aw) & torch.isnan(bw)))   # an inf or NaN on one side
    largest = math.inf if bool(unlike.any()) else float(d.max()) if d.numel() else 0.0
    peak = float(aw[torch.isfinite(aw)].abs().max()) if bool(torch.isfinite(aw).any()) else 0.0
    return Deviation(largest, float(d.mean()) if d.numel() else 0.0,
                     largest / peak if peak else (math.inf if largest else 0.0), _ulps(a, peak, largest))


def _whose(rank: int | None) -> str:
    return "every rank's" if rank is None else f"rank {rank}'s"


def _first(differences: list[Difference]) -> Difference | None:
    """The first difference in execution order: S and P only where nothing else differs, since a flash backend
    hands them out in its backward, out of the forward's order (kernels/internals.py)."""
    return next((d for d in differences if d.what not in ("S", "P")), differences[0] if differences else None)


def _note_scores(scores: dict[tuple[int, int], dict[str, float]], where: str, what: str, values: list[float]) -> None:
    """A call's per-head deviation of S or P, the largest over the step's calls kept per layer and head."""
    layer = int(where.split()[1].split("#")[0])
    for head, value in enumerate(values):
        old = scores.get((layer, head), {}).get(what, 0.0)
        scores.setdefault((layer, head), {})[what] = max(old, value)


def _with_scores(heads: list[HeadDiff], scores: dict[tuple[int, int], dict[str, float]]) -> list[HeadDiff]:
    """The heads with their S and P deviations; NaN where the two sides did not both have them."""
    return [dataclasses.replace(h, s=scores.get((h.layer, h.head), {}).get("S", math.nan),
                                p=scores.get((h.layer, h.head), {}).get("P", math.nan)) for h in heads]


def _per_head_max(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """The largest |B - A| per head of two (batch, heads, queries, keys) tensors; entries equal on both sides (a
    masked -inf too) count 0, one not finite on one side only counts infinite."""
    aw, bw = a.double(), b.double()
    alike = (aw == bw) | (torch.isnan(aw) & torch.isnan(bw))
    d = torch.nan_to_num(torch.where(alike, 0.0, (bw - aw).abs()), nan=math.inf)
    return [float(x) for x in d.amax(dim=(0, 2, 3))]


def _stats(t: torch.Tensor) -> dict[str, float | None]:
    """A tensor's statistics as a trace keeps them (None where not finite)."""
    if not t.is_floating_point() or not t.numel():
        return {}
    x = t.double()
    values = {"min": x.min(), "max": x.max(), "mean": x.mean(), "norm": torch.linalg.norm(x.reshape(-1))}
    return {k: float(v) if math.isfinite(float(v)) else None for k, v in values.items()}


def _machine() -> str:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    return (f"{socket.gethostname()}: {cpu_model() or 'a CPU'} ({torch.backends.cpu.get_cpu_capability()}), {device}, "
            f"torch {torch.__version__}")


def _run_side(side: _Side, see: Callable[[str, str, str, torch.Tensor], None],
              keep: Callable[[str, torch.Tensor], None]) -> None:
    """One side's step: the model its run built, with the attention it runs, the checkpoint's weights and RNG,
    the rank's micro-batches forward and backward, every tensor handed to `see` as it is produced, and each
    attention call's tensors for the per-head signals to `keep` (`_attention_traced`)."""
    cfg = side.runs
    model = build_model(side.built.model, side.data.vocab_size, side.built.seed)
    model.load_state_dict(side.shard["state"]["replicated"]["model"])
    apply_plan(model, AttentionPlan.parse(cfg.model.attention))
    model.train()
    tracer = Tracer(model, see)
    world = len(side.ids)   # every rank's micro-batches: their gradients averaged over the ranks, as DDP's
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
    try:
        with attention_traced(model, see, keep):
            for ids, rng, (rank, logged) in zip(side.ids, side.rngs, side.losses.items(), strict=True):
                set_rng_state(rng)
                total = torch.zeros((), dtype=torch.float32)   # the rank's loss, summed as the trainer sums it
                for micro in ids:
                    x, y = side.data.batch(micro)
                    with torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
                        loss = lm_loss(model, x, y)
                    (loss / (len(ids) * world)).backward()
                    total += loss.detach()
                if cfg == side.built and float(total / len(ids)) != logged:   # as the store ran it: its loss
                    side.notes.append(f"{side.store}'s step, run here as it ran, is not its record: its loss on "
                                      f"rank {rank}'s micro-batches is {float(total / len(ids))!r}, the record's "
                                      f"{logged!r} (another CPU, or torch, computes other bits): the sides are this "
                                      "machine's runs of the step")
    finally:
        tracer.close()
    for name, p in model.named_parameters():
        if p.grad is not None:
            see("gradient", name, "grad", p.grad)


class _HeadStats:
    """Per layer and head, over the step's attention calls: the deviation of O, dO, dQ, dK, dV and delta, the sign
    bias of delta's error and the alignment of W_Q's gradient error terms across tokens. Side B's tensors of a
    call are held (`put`) until the call's backward has given them all, then compared with side A's, read back
    (`theirs`: None where A has none) and let go: neither side's attention tensors stay for the whole step."""

    def __init__(self, theirs: Callable[[str], torch.Tensor | None]):
        self._theirs = theirs
        self._pending: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
        self._per: dict[tuple[int, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))

    def put(self, key: str, t: torch.Tensor) -> None:
        call, _, what = key.partition("|")
        held = self._pending[call]
        held[what] = t if what == "x" else t.clone()   # x: the hidden state the model holds for its backward anyway
        if len(held) == len(CALL):
            del self._pending[call]
            a = {what: self._theirs(f"{call}|{what}") for what in CALL}
            if all(t is not None for t in a.values()):
                self._add(int(call.split()[1].split("#")[0]), cast(dict[str, torch.Tensor], a), held)

    def _add(self, layer: int, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
        per = self._per
        n_head = b["O"].shape[1]   # query heads; with grouped-query attention dK and dV have fewer, each shared
        for what in ("O", "dO", "dQ", "dK", "dV"):   # by a group of query heads, whose rows show its deviation
            err = (b[what].double() - a[what].double()).abs()
            for h in range(n_head):
                per[(layer, h)][what].append(float(err[:, h * err.shape[1] // n_head].max()))
        e = (b["dO"].double() * b["O"].double()).sum(-1) - (a["dO"].double() * a["O"].double()).sum(-1)   # (B, H, T)
        dq = b["dQ"].double() - a["dQ"].double()   # (B, H, T, D)
        x = a["x"].double()                        # (B, T, C): W_Q's input
        for h in range(e.shape[1]):
            nonzero = e[:, h][e[:, h] != 0]
            per[(layer, h)]["delta"].append(float(e[:, h].abs().max()))
            per[(layer, h)]["sign"].append(float(torch.sign(nonzero).mean()) if nonzero.numel() else 0.0)
            if x.dim() != 3 or x.shape[0] * x.shape[1] != dq.shape[0] * dq.shape[2]:   # no (B, T, C) input seen
                per[(layer, h)]["align"].append(math.nan)
                continue
            # token t's rank-1 term of the error is x_t e_t^T: their sum is X^T E, and |x_t e_t^T| = |x_t| |e_t|
            xs, es = x.reshape(-1, x.shape[-1]), dq[:, h].reshape(-1, dq.shape[-1])
            total = float(torch.linalg.norm(xs.T @ es))
            norms = float(torch.linalg.norm(xs, dim=-1).mul(torch.linalg.norm(es, dim=-1)).sum())
            per[(layer, h)]["align"].append(total / norms if norms else 0.0)

    def done(self) -> list[HeadDiff]:
        return [HeadDiff(layer, h, max(v["O"]), max(v["dO"]), max(v["dQ"]), max(v["dK"]), max(v["dV"]),
                         max(v["delta"]), float(np.mean(v["sign"])), float(np.mean(v["align"])))
                for (layer, h), v in sorted(self._per.items())]


def _ulps(a: torch.Tensor, peak: float, largest: float) -> float:
    """`largest` in units in the last place of A's largest finite magnitude `peak`, in A's format (floating
    point): an error's size against the tensor's own rounding (a difference near 0 in a tensor of large values is
    no more units than one at its peak)."""
    if not a.is_floating_point() or not math.isfinite(largest):
        return 0.0 if not a.is_floating_point() else math.inf
    info = torch.finfo(a.dtype)
    return largest / (2.0 ** math.floor(math.log2(max(peak, info.tiny))) * info.eps)
