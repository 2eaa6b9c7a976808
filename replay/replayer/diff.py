"""`replay diff STORE --step N` with a replay's overrides: where one step, run twice from the same restored
state, first parts. Side A is the step as recorded, side B the step with the overrides; both restore the
checkpoint at N (the model and every RNG) and train one rank's recorded micro-batches of step N (rank 0's, or
`--rank`'s, from that rank's RNG states; `--rank all`: every rank's in turn, each from its RNG states, their
gradients averaged as DDP's, up to the order of the sum) forward and backward, no optimizer step, in this process.

Every tensor the step produces is compared, in execution order: each module's output (forward), the gradient
of each module's output (backward), every attention call's output O and gradients dO, dQ, dK, dV (per head),
and each parameter's gradient at the end. Side A runs first and keeps each tensor in a temporary file (in
memory only its attention calls' tensors, for the per-head signals); side B compares each of its tensors with
A's as it is produced, by a CRC-32C of its bytes, and reads A's from the file only where they differ, for the
deviation (max and mean absolute, relative, in ULPs of A's largest magnitude in A's format). The first
differing tensor in B's order is the first difference. For the attention calls, per head:
the deviation of O, dO, dQ, dK, dV, and of `delta = rowsum(dO * O)` with the sign bias of its error (Qiu & Yao's
mechanism: a biased delta error has one sign), and how aligned the rank-1 terms of W_Q's gradient error are
across tokens (1: every token's term points one way, as a bias does).

Without overrides both sides are the record: a step that runs the same twice in one process reports no
difference (and one that does not, its first nondeterministic operation). The built-in trainer's runs (GPT-2),
one rank's micro-batches; a checkpoint at step N is needed (a replay with `--checkpoint-every 1` writes one).

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
import functools
import math
import re
import socket
import sys
import tempfile
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from replay.config import RunConfig
from replay.errors import UsageError
from replay.kernels import internals
from replay.kernels.plan import AttentionPlan
from replay.kernels.registry import apply_plan, hf_attention_modules
from replay.recorder.environment import set_rng_state
from replay.replayer.overrides import apply as apply_overrides
from replay.store import RunStore
from replay.store.integrity import crc32c
from replay.store.lease import writing
from replay.store.location import Location
from replay.store.overrides import Overrides
from replay.store.step_diff import Deviation, Difference, HeadDiff, StepDiff
from replay.train.data import load_data
from replay.train.model import build_model, lm_loss

_TRACER = "replay-diff"   # the attention implementation a traced side runs its own through
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NAME = re.compile(r"[A-Za-z0-9._-]+")


@dataclass
class _Seen:
    """A tensor side A produced: its digest, and where its bytes lie in the side's file."""

    digest: int
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class _Tracer:
    """Hooks on a model that hand every tensor of a step, in execution order, to `see(phase, where, what, t)`."""

    def __init__(self, model: torch.nn.Module, see: Callable[[str, str, str, torch.Tensor], None]):
        self.model, self.see = model, see
        self.handles: list[Any] = []
        self.calls: dict[str, int] = defaultdict(int)
        for name, module in model.named_modules():
            if not name or module is model:
                continue
            self.handles.append(module.register_forward_hook(self._forward(name)))
            self.handles.append(module.register_full_backward_hook(self._backward(name)))

    def _key(self, name: str) -> str:
        n = self.calls[name]
        self.calls[name] += 1
        return name if n == 0 else f"{name}#{n}"

    def _forward(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            key = self._key(f"forward {name}")
            for i, t in enumerate(_tensors(output)):
                self.see("forward", key.removeprefix("forward "), "output" if i == 0 else f"output {i}", t)
        return hook

    def _backward(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, grad_input: Any, grad_output: Any) -> None:
            key = self._key(f"backward {name}")
            for i, t in enumerate(_tensors(grad_output)):
                self.see("backward", key.removeprefix("backward "), "grad of output" + (f" {i}" if i else ""), t)
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@dataclass
class _Side:
    """One side of a diff: the config of the run it comes from (the model it builds), the config it runs with
    (its attention plan and precision), the run's data, one rank's micro-batches of the step and that rank's
    checkpoint it restores."""

    built: RunConfig
    runs: RunConfig
    data: Any
    ids: list[np.ndarray]      # per rank played, its micro-batches' sample ids
    shard: dict[str, Any]      # rank 0's: the replicated model
    rngs: list[Any]            # per rank played, its RNG states


def _as_run(location: Location, step: int, rank: int | None) -> _Side:
    """Step `step` of the built-in run at `location` on rank `rank`'s micro-batches and RNG (None: every rank's,
    one after the other), as the store ran it."""
    store = RunStore.open(location)
    manifest = store.manifest
    if not store.capabilities.builtin:
        raise UsageError(f"replay diff runs the built-in trainer's step; {location} is a run of a script of its own")
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
    recorded_ids = store.read_steps(["sample_ids"], start=step, stop=step + 1)["sample_ids"][0]   # [rank, micro, ...]
    shard = held.read_shard(step, 0)   # the replicated model is rank 0's to keep; each rank keeps its own RNG
    rngs = [shard["rng"] if r == 0 else held.read_shard(step, r)["rng"] for r in ranks]
    if "model" not in shard["state"].get("replicated", {}):
        raise UsageError(f"{location}'s checkpoints hold each rank's piece of the model (DeepSpeed ZeRO): replay diff "
                         "restores a whole model, from a run of plain or DDP ranks")
    return _Side(manifest.config, manifest.config, data, [recorded_ids[r] for r in ranks], shard, rngs)


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


def _prepare(location: Location, step: int, overrides: Overrides, rank: int | None = 0) -> tuple[_Side, _Side]:
    """Side A, the step as the store ran it, and side B, the same with `overrides`."""
    a = _as_run(location, step, rank)
    store = RunStore.open(location)
    side_b = apply_overrides(a.runs, overrides, (step, step), store.capabilities)
    if overrides.skip or overrides.drop or overrides.lr_scale is not None:
        raise UsageError("replay diff compares one step's forward and backward: --skip, --drop and --lr-scale "
                         "change no operation of it (replay run shows what they do)")
    return a, dataclasses.replace(a, runs=side_b)


def _two_runs(location: Location, other: Location, step: int,
              rank: int | None) -> tuple[_Side, _Side, dict[str, list[Any]]]:
    """Step `step` of two runs (or replays) as each ran it, from the state and samples they share at that step;
    with how the second's config differs from the first's."""
    a, b = _as_run(location, step, rank), _as_run(other, step, rank)
    model_a, model_b = a.shard["state"]["replicated"]["model"], b.shard["state"]["replicated"]["model"]
    if model_a.keys() != model_b.keys():
        raise UsageError(f"{location} and {other} are not the same model (their parameters differ): replay diff "
                         "compares one step of two runs of one model")
    parted = next((key for key in model_a if not _same(model_a[key], model_b[key])), None)
    if parted is None and not _same(a.rngs, b.rngs):
        parted = "the random generators' states"
    if parted is not None:
        raise UsageError(f"{location} and {other} hold different states at step {step} ({parted} differs): replay "
                         "diff runs one step from one state; diff the step where they part, the last whose state "
                         "they share")
    if not _same(a.ids, b.ids) or not all(_same(a.data.batch(x), b.data.batch(y)) for xs, ys in
                                          zip(a.ids, b.ids, strict=True) for x, y in zip(xs, ys, strict=True)):
        raise UsageError(f"{location} and {other} train different samples at step {step} ({_whose(rank)}): replay diff "
                         "compares one step on the same samples")
    flat_a, flat_b = _flat(a.runs.to_dict()), _flat(b.runs.to_dict())
    changes = {k: [flat_a.get(k), flat_b.get(k)] for k in sorted(flat_a.keys() | flat_b.keys())
               if flat_a.get(k) != flat_b.get(k)}
    return a, b, changes


def _same(a: Any, b: Any) -> bool:
    """Equal bit for bit: tensors, arrays and the dicts, lists and scalars around them."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and bool((_raw(a.contiguous()) == _raw(b.contiguous())).all()))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and a.tobytes() == b.tobytes())
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def capture(location: Location, step: int, overrides: Overrides, name: str, rank: int | None = 0,
            keep: tuple[str, ...] = ()) -> int:
    """`replay diff --capture NAME`: the step as the store ran it (with `overrides`, if any), every tensor's
    digest and statistics in execution order, written into the store as the trace NAME, for a comparison in
    another process or on another machine (`diff(..., against=NAME)`); whole tensors only of the modules and
    attention calls `keep` names (`attention 1`: every call of layer 1's attention, with its W_Q input; a
    module path: the module and those inside it), so that the comparison has their deviations. Returns how
    many tensors the trace covers."""
    check_name(name, "--capture")
    _, side = _prepare(location, step, overrides, rank)
    entries: list[dict[str, Any]] = []
    whole: dict[int, torch.Tensor] = {}   # the entries kept whole, by their place in `entries`

    def note(phase: str, where: str, what: str, t: torch.Tensor) -> None:
        t = t.detach().contiguous().cpu()
        if _kept(where, keep):
            whole[len(entries)] = t.clone()
        entries.append({"key": f"{phase}|{where}|{what}", "shape": list(t.shape), "dtype": str(t.dtype),
                        "digest": _digest(t), "stats": _stats(t)})

    wq_inputs: dict[str, torch.Tensor] = {}   # the W_Q inputs of the attention calls kept whole

    def note_input(key: str, t: torch.Tensor) -> None:
        call, _, what = key.partition("|")
        if what == "x" and _kept(call, keep):
            wq_inputs[call] = t.clone()

    _run_side(side, note, note_input)
    with writing(location, "replay diff --capture"):
        store = RunStore.open(location, mode="a")
        for i, t in whole.items():   # the tensors first, the document that names them last
            entries[i]["kept"] = store.write_trace_tensor(name, f"{i}", _raw(t).numpy())
        kept_inputs = {call: {"shape": list(t.shape), "dtype": str(t.dtype),
                              "kept": store.write_trace_tensor(name, f"x{j}", _raw(t.contiguous()).numpy())}
                       for j, (call, t) in enumerate(sorted(wq_inputs.items()))}
        store.write_trace(name, {"step": step, "rank": rank, "overrides": overrides.to_dict(), "machine": _machine(),
                                 "entries": entries, "wq_inputs": kept_inputs})
    return len(entries)


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
    if other is None:
        a, b = _prepare(location, step, overrides, rank)
    elif overrides.to_dict():
        raise UsageError("replay diff A B runs the step as each run ran it: leave out the overrides (or diff one "
                         "store against its overrides: replay diff A --step N --attention ...)")
    else:
        a, b, changes = _two_runs(location, other, step, rank)
    with tempfile.TemporaryFile(prefix="replay-diff-") as kept_a:   # side A's tensors, one after another
        seen: dict[str, _Seen] = {}

        def keep(phase: str, where: str, what: str, t: torch.Tensor) -> None:
            key = f"{phase}|{where}|{what}"
            t = t.detach().contiguous().cpu()
            seen[key] = _Seen(_digest(t), kept_a.tell(), t.dtype, tuple(t.shape))
            _raw(t).numpy().tofile(kept_a)

        def keep_input(key: str, t: torch.Tensor) -> None:   # O and the gradients are in the file already
            call, _, what = key.partition("|")
            if what == "x":
                keep("input", call, what, t)

        def theirs_of(key: str) -> torch.Tensor | None:
            entry = seen.get(f"{_phase(key)}|{key}")
            return None if entry is None else _read(kept_a, entry)

        _run_side(a, keep, keep_input)
        differences: list[Difference] = []
        only_in_b: list[str] = []
        compared = 0
        heads = _HeadStats(theirs_of)
        produced: set[str] = set()

        def compare(phase: str, where: str, what: str, t: torch.Tensor) -> None:
            nonlocal compared
            key = f"{phase}|{where}|{what}"
            produced.add(key)
            t = t.detach().contiguous().cpu()
            theirs = seen.get(key)
            if theirs is None:   # an output one side's attention gives and the other's does not (its weights)
                only_in_b.append(key.replace("|", " "))
                return
            compared += 1
            same = theirs.dtype == t.dtype and theirs.shape == tuple(t.shape) and theirs.digest == _digest(t)
            read = None if same else _read(kept_a, theirs) if theirs.shape == tuple(t.shape) else \
                torch.full_like(t, math.nan)
            if what in ("S", "P"):
                _note_scores(scores, where, what, [0.0] * t.shape[1] if read is None else _per_head_max(read, t))
            if read is not None:
                differences.append(Difference(compared - 1, phase, where, what, list(t.shape),
                                              str(t.dtype).removeprefix("torch."), _deviation(read, t)))

        scores: dict[tuple[int, int], dict[str, float]] = {}
        _run_side(b, compare, heads.put)
    only_in_a = [key.replace("|", " ") for key in seen if key not in produced and not key.startswith("input|")]
    return StepDiff(str(location), step, overrides.to_dict(), compared, _first(differences),
                    differences, _with_scores(heads.done(), scores), only_in_a, only_in_b,
                    other=None if other is None else str(other), changes=changes, rank=rank)


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
    _, side = _prepare(location, step, overrides, rank)
    store = RunStore.open(location)
    theirs = {e["key"]: e for e in trace["entries"]}
    differences: list[Difference] = []
    produced: list[str] = []
    inputs = trace.get("wq_inputs", {})

    def theirs_of(key: str) -> torch.Tensor | None:   # what the trace kept whole, for the per-head signals
        call, _, what = key.partition("|")
        entry = inputs.get(call) if what == "x" else theirs.get(f"{_phase(key)}|{key}")
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
        if entry["digest"] != _digest(t) or entry["shape"] != list(t.shape) or entry["dtype"] != str(t.dtype):
            differences.append(Difference(len(produced) - 1, phase, where, what, list(t.shape),
                                          str(t.dtype).removeprefix("torch."),
                                          None if whole is None else _deviation(whole, t),
                                          {"theirs": entry["stats"], "ours": _stats(t)}))

    scores: dict[tuple[int, int], dict[str, float]] = {}
    heads = _HeadStats(theirs_of)
    _run_side(side, compare, heads.put)
    ours = set(produced)
    compared = sum(1 for key in produced if key in theirs)
    return StepDiff(str(location), step, overrides.to_dict(), compared, _first(differences),
                    differences, _with_scores(heads.done(), scores) if inputs else [],
                    [key.replace("|", " ") for key in theirs if key not in ours],
                    [key.replace("|", " ") for key in produced if key not in theirs],
                    against={"trace": name, "machine": trace["machine"], "overrides": trace["overrides"]}, rank=rank)


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
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    return f"{socket.gethostname()}: {cpu or 'a CPU'}, {device}, torch {torch.__version__}"


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
    tracer = _Tracer(model, see)
    world = len(side.ids)   # every rank's micro-batches: their gradients averaged over the ranks, as DDP's
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
    try:
        with _attention_traced(model, see, keep), warnings.catch_warnings():
            # torch's notes on the hooks: the model's own output (a ModelOutput) has no gradient hook, and the
            # embeddings' inputs (token ids) no gradient; the gradients of their outputs are traced all the same
            warnings.filterwarnings("ignore", "For backward hooks to be called", UserWarning)
            warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)
            for ids, rng in zip(side.ids, side.rngs, strict=True):
                set_rng_state(rng)
                for micro in ids:
                    x, y = side.data.batch(micro)
                    with torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
                        loss = lm_loss(model, x, y)
                    (loss / (len(ids) * world)).backward()
    finally:
        tracer.close()
    for name, p in model.named_parameters():
        if p.grad is not None:
            see("gradient", name, "grad", p.grad)


@contextlib.contextmanager
def _attention_traced(model: torch.nn.Module, see: Callable[[str, str, str, torch.Tensor], None],
                      keep: Callable[[str, torch.Tensor], None]) -> Iterator[None]:
    """Every attention call of `model` through the implementation it has now, its q, k, v, O and their
    gradients handed to `see` (per call; (batch, heads, tokens, head dim)), and to `keep` as `CALL|O`, `CALL|dO`,
    `CALL|dQ`, `CALL|dK`, `CALL|dV` with `CALL|x`, the input of W_Q's projection, for the per-head signals."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config: Any = model.config
    name = config._attn_implementation
    modules = hf_attention_modules(model)
    inner = (ALL_ATTENTION_FUNCTIONS[name] if name != "eager"
             else sys.modules[type(modules[0]).__module__].eager_attention_forward)
    calls: dict[int, int] = defaultdict(int)
    inputs: dict[int, torch.Tensor] = {}

    def pre(module: Any, args: Any, kwargs: Any) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        inputs[module.layer_idx] = hidden.detach()

    def traced(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
               **kwargs: Any) -> Any:
        layer = module.layer_idx
        where = f"attention {layer}" + (f"#{calls[layer]}" if calls[layer] else "")
        calls[layer] += 1
        with internals.watching(_whole_heads(see, where, query.shape[1])):
            if name == "eager":   # the model's own: S is the input of its softmax (kernels/internals.py)
                mask = args[0] if args else kwargs.get("attention_mask")
                out, scores = internals.eager_scores(lambda: inner(module, query, key, value, *args, **kwargs), mask)
            else:
                out, scores = inner(module, query, key, value, *args, **kwargs), None
        o = out[0] if isinstance(out, tuple) else out
        weights = out[1] if isinstance(out, tuple) and len(out) > 1 else None
        if scores is not None and isinstance(weights, torch.Tensor):
            see("forward", where, "S", scores)
        if isinstance(weights, torch.Tensor):   # transformers' eager attention returns its P (after its dropout)
            see("forward", where, "P", weights)
        heads_o = o.transpose(1, 2) if o.dim() == 4 and o.shape[1] != query.shape[1] else o   # (B, H, T, D)
        see("forward", where, "O", heads_o)
        keep(f"{where}|O", heads_o.detach())
        keep(f"{where}|x", inputs[layer])
        for what, t in (("dQ", query), ("dK", key), ("dV", value)):
            if t.requires_grad:
                t.register_hook(_grad_hook(see, keep, where, what))
        if o.requires_grad:   # the output the model goes on with; its gradient as (B, H, T, D), as O is kept
            o.register_hook(_grad_hook(see, keep, where, "dO", transposed=heads_o is not o))
        return out

    AttentionInterface.register(_TRACER, traced)
    AttentionMaskInterface.register(_TRACER, ALL_MASK_ATTENTION_FUNCTIONS[name])   # the mask its own gets
    hooks = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in modules]
    model.set_attn_implementation(_TRACER)   # type: ignore[operator]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def _whole_heads(see: Callable[[str, str, str, torch.Tensor], None], where: str,
                 n_head: int) -> internals.Watcher:
    """Collects the S and P a call's backends hand out (kernels/internals.py), a group of heads at a time, and
    hands them to `see` as (batch, heads, queries, keys) once every head of the layer has given them (a flash
    backend in its backward: forward quantities, recomputed there). A layer with heads on a backend that hands
    out nothing (SDPA, Triton, plug-ins) gives none."""
    got: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}

    def watch(heads: list[int] | None, s: torch.Tensor | None, p: torch.Tensor) -> None:
        for i, head in enumerate(range(n_head) if heads is None else heads):
            got[head] = (None if s is None else s[:, i], p[:, i])
        if len(got) == n_head:
            for j, what in enumerate(("S", "P")):
                parts = [t for h in range(n_head) if (t := got[h][j]) is not None]
                if len(parts) < n_head:   # a backend of the layer kept it
                    continue
                held = functools.reduce(torch.promote_types, (t.dtype for t in parts))
                see("forward", where, what, torch.stack([t.to(held) for t in parts], 1))
            got.clear()
    return watch


def _grad_hook(see: Callable[[str, str, str, torch.Tensor], None], keep: Callable[[str, torch.Tensor], None],
               where: str, what: str, transposed: bool = False) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        grad = grad.transpose(1, 2) if transposed else grad
        see("backward", where, what, grad)
        keep(f"{where}|{what}", grad.detach())
    return hook


_CALL = ("O", "x", "dO", "dQ", "dK", "dV")   # what a call's per-head signals are computed from


def _phase(key: str) -> str:
    """The phase `see` hands a kept attention tensor (`CALL|WHAT`) in; the W_Q input is kept only."""
    what = key.rpartition("|")[2]
    return "forward" if what == "O" else "input" if what == "x" else "backward"


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
        if len(held) == len(_CALL):
            del self._pending[call]
            a = {what: self._theirs(f"{call}|{what}") for what in _CALL}
            if all(t is not None for t in a.values()):
                self._add(int(call.split()[1].split("#")[0]), cast(dict[str, torch.Tensor], a), held)

    def _add(self, layer: int, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
        per = self._per
        for what in ("O", "dO", "dQ", "dK", "dV"):
            err = (b[what].double() - a[what].double()).abs()
            for h in range(err.shape[1]):
                per[(layer, h)][what].append(float(err[:, h].max()))
        e = (b["dO"].double() * b["O"].double()).sum(-1) - (a["dO"].double() * a["O"].double()).sum(-1)   # (B, H, T)
        dq = b["dQ"].double() - a["dQ"].double()   # (B, H, T, D)
        x = a["x"].double()                        # (B, T, C): W_Q's input
        for h in range(e.shape[1]):
            nonzero = e[:, h][e[:, h] != 0]
            per[(layer, h)]["delta"].append(float(e[:, h].abs().max()))
            per[(layer, h)]["sign"].append(float(torch.sign(nonzero).mean()) if nonzero.numel() else 0.0)
            # token t's rank-1 term of the error is x_t e_t^T: their sum is X^T E, and |x_t e_t^T| = |x_t| |e_t|
            xs, es = x.reshape(-1, x.shape[-1]), dq[:, h].reshape(-1, dq.shape[-1])
            total = float(torch.linalg.norm(xs.T @ es))
            norms = float(torch.linalg.norm(xs, dim=-1).mul(torch.linalg.norm(es, dim=-1)).sum())
            per[(layer, h)]["align"].append(total / norms if norms else 0.0)

    def done(self) -> list[HeadDiff]:
        return [HeadDiff(layer, h, max(v["O"]), max(v["dO"]), max(v["dQ"]), max(v["dK"]), max(v["dV"]),
                         max(v["delta"]), float(np.mean(v["sign"])), float(np.mean(v["align"])))
                for (layer, h), v in sorted(self._per.items())]


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if hasattr(value, "to_tuple"):   # a transformers ModelOutput
        return _tensors(value.to_tuple())
    return []


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers of its width (bfloat16 has no numpy type)."""
    return t.reshape(-1).view(_INTS[t.element_size()]) if t.is_floating_point() else t.reshape(-1)


def _digest(t: torch.Tensor) -> int:
    return crc32c(_raw(t).numpy())   # in place


def _read(file: Any, seen: _Seen) -> torch.Tensor:
    file.seek(seen.offset)
    raw = torch.from_numpy(np.fromfile(file, dtype=_raw(torch.empty(0, dtype=seen.dtype)).numpy().dtype,
                                       count=math.prod(seen.shape)))
    file.seek(0, 2)   # back to the end, where side A's tensors were appended
    return (raw.view(seen.dtype) if seen.dtype.is_floating_point else raw).reshape(seen.shape)


def _ulps(a: torch.Tensor, peak: float, largest: float) -> float:
    """`largest` in units in the last place of A's largest finite magnitude `peak`, in A's format (floating
    point): an error's size against the tensor's own rounding (a difference near 0 in a tensor of large values is
    no more units than one at its peak)."""
    if not a.is_floating_point() or not math.isfinite(largest):
        return 0.0 if not a.is_floating_point() else math.inf
    info = torch.finfo(a.dtype)
    return largest / (2.0 ** math.floor(math.log2(max(peak, info.tiny))) * info.eps)
