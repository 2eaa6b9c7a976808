"""Replays: re-execute a window of a recorded run from its checkpoints, and compare with the record.

A replay is itself a run store, nested in its parent at `replays/<id>/` (kind "replay"): its manifest
names the parent, the window [from, to], the checkpoint it starts from and the overrides; its step log
holds every step it executed (from that checkpoint on, so the steps before `from` are the fast-forward)
and it ends with a committed checkpoint at `to + 1`. Every tool that reads runs reads replays alike.
The ranks are started exactly as for the recording (same world size, same launcher); each rank
restores its own shard and RNG states from the parent and trains on the parent's recorded sample ids.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from replay.config import RunConfig
from replay.errors import ReplayError, UsageError
from replay.launch.job import RankJob, RankLauncher
from replay.launch.ranks import launcher_env, launching
from replay.launch.ray_cluster import ray_session
from replay.launch.ray_ranks import NodeLost, Placing, RayRanks
from replay.recorder.command import check_unchanged
from replay.recorder.host import differences, environment_notes
from replay.replayer.overrides import apply as apply_overrides
from replay.store import RunStore
from replay.store.capabilities import Capabilities
from replay.store.lease import writing
from replay.store.lifecycle import resume_run
from replay.store.location import Location, Where
from replay.store.manifest import Manifest, ReplaySpec, TraceRequest
from replay.store.overrides import Overrides, Reached
from replay.store.run_store import DigestInfo
from replay.store.verification import SCALARS, STATE, Divergence, ScalarChange, StateChange, Verification
from replay.train.data import fingerprint_file

SCALAR_FIELDS = ("loss", "rank_loss", "grad_norm", "lr")   # in the order a step computes them


class NotBitForBit(ReplayError):
    """A replay without overrides that does not equal its record: the run is not reproducible as recorded."""

    exit_code = 5


@dataclass
class ReplayRequest:
    start: int                      # A: the first step of the window
    stop: int                       # B: the last step of the window (inclusive)
    name: str | None = None
    checkpoint_every: int = 0       # 0: one checkpoint, at the end
    overrides: Overrides = field(default_factory=Overrides)
    resume: bool = False            # continue an interrupted replay from its last committed checkpoint
    discard: bool = False           # remove an interrupted replay and run it anew
    allow_changed: bool = False     # a script of the user's own: run it even if its files changed
    ranks: int | None = None        # processes to play the recorded ranks on (train/fewer_ranks.py); None: one each
    trace: TraceRequest | None = None   # a step to trace on one rank (replay diff of a script's run)


@dataclass
class Replay:
    location: Location
    created: bool                   # False: an identical, complete replay already existed
    verification: Verification | None = None
    environment_notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)   # e.g. the nearest checkpoint is damaged
    reached: Reached | None = None                       # what its overrides reached (recorder/overrides.py)


def replay_id(req: ReplayRequest) -> str:
    if req.name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", req.name):
        raise UsageError(f"--name {req.name!r} is not a replay name: use letters, digits, '.', '_' and '-' "
                         "(one path component, at most 100 characters, not starting with '.' or '-')")
    tag = f"-{req.overrides.tag()}" if req.overrides.to_dict() else ""
    tag += f"-ranks{req.ranks}" if req.ranks is not None else ""
    return req.name or f"steps-{req.start}-{req.stop}{tag}"


def check_replayable(parent: RunStore, command: str) -> None:
    """A run whose windows `command` can replay: a recording (not a replay) whose ranks can be started again."""
    if parent.kind != "run":
        raise UsageError(f"{parent.location} is a replay; replay windows of the run it belongs to")
    parent.check_relaunchable(command)


def prepare(parent: RunStore, req: ReplayRequest, warn: Callable[[str], None] = lambda m: None,
            on_cluster: bool = False) -> tuple[Location, RunConfig, bool, bool]:
    """Check the request against the record and create (or rewind) the replay's store; nothing is written
    on error. Returns (the replay's location, config, whether it still has to run, whether it resumes);
    `warn` hears of what the replay works around (a damaged checkpoint nearer the window). `on_cluster`:
    its ranks run on a Ray cluster's nodes, not on this machine alone."""
    store_path = parent.location
    check_replayable(parent, "replay run")
    if req.stop < req.start:
        raise UsageError(f"--to {req.stop} is before --from {req.start}")
    if req.start < 0 or req.stop >= parent.end_step:
        raise UsageError(f"window {req.start}..{req.stop} is outside the record: {store_path} holds steps "
                         f"0..{parent.end_step - 1}")
    if req.checkpoint_every < 0:
        raise UsageError(f"--checkpoint-every must be >= 0, got {req.checkpoint_every}")
    before = [c for c in parent.checkpoints() if c.step <= req.start]
    if not before:
        raise UsageError(f"no committed checkpoint at or before step {req.start} in {store_path}")
    ckpt = before[-1]
    damaged = [(step, why) for step, why in parent.damaged_checkpoints() if ckpt.step < step <= req.start]
    if damaged:
        step, why = damaged[-1]
        warn(f"checkpoint {step} is damaged ({why}): the replay starts from checkpoint {ckpt.step} instead, "
             f"{step - ckpt.step} steps earlier")
    recorded = parent.manifest
    caps = Capabilities.of(recorded)
    cfg = apply_overrides(recorded.config, req.overrides, (req.start, req.stop), caps)
    if caps.relaunches_script and caps.multi_node and not on_cluster:
        raise UsageError(f"{store_path} was recorded on {caps.nodes} nodes: a script's ranks start on this machine "
                         "only without a cluster; pass --ray-address HOST:PORT to start them on a Ray cluster's nodes")
    if caps.relaunches_script and not req.allow_changed:
        assert recorded.command is not None
        check_unchanged(recorded.command, "replaying it")
    parent.verify_records()   # a damaged step log or checkpoint is named before anything is written
    if req.overrides.drop:
        _check_drops(parent, req.overrides.drop, store_path)
    processes = _processes(req, caps, recorded)
    for rank in range(recorded.world_size):
        parent.verify_shard(ckpt.step, rank)
    if caps.builtin:   # and so is the data the replay reads
        _check_data(parent, recorded)

    spec = ReplaySpec(parent="../..", start=req.start, stop=req.stop, start_checkpoint=ckpt.step,
                      start_checkpoint_kind=ckpt.kind, checkpoint_every=req.checkpoint_every,
                      overrides=req.overrides, skip=req.overrides.skip, drop=req.overrides.drop,
                      lr_scope=req.overrides.lr_scope(cfg.model.n_layer, cfg.model.n_head), processes=processes,
                      trace=req.trace)
    path = store_path / "replays" / replay_id(req)
    if (path / "zarr.json").exists():
        kept = _existing(path, spec, req, store_path, recorded.world_size)
        if kept is not None:
            return path, cfg, *kept
    RunStore.create(path, Manifest(kind="replay", config=cfg, world_size=recorded.world_size,
                                   launcher=recorded.launcher, data=recorded.data, created=time.time(), replay=spec,
                                   command=recorded.command, layout=recorded.layout), first_step=ckpt.step)
    return path, cfg, True, False


def _processes(req: ReplayRequest, caps: Capabilities, recorded: Manifest) -> int | None:
    """`--ranks N`: the processes that play the recorded ranks, when fewer than them (None: one per rank)."""
    if req.ranks is None or req.ranks == caps.world_size:
        return None
    if caps.fewer_ranks_refusal is not None:
        raise UsageError(caps.fewer_ranks_refusal)
    if req.ranks < 1 or caps.world_size % req.ranks:
        raise UsageError(f"--ranks {req.ranks} does not divide the recorded {caps.world_size} ranks: every process "
                         "plays as many of them")
    if req.overrides.to_dict():
        raise UsageError("--ranks replays the record as it ran: leave out the overrides, or replay on the recorded "
                         "ranks")
    if recorded.config.model.dropout > 0:
        raise UsageError(f"--ranks: the run trains with dropout {recorded.config.model.dropout}, whose masks each "
                         "recorded rank drew from its own RNG state: replay it on its recorded ranks")
    if recorded.last_environment.get("device", "cpu") != "cpu":
        raise UsageError("--ranks reproduces gloo's all-reduce on CPU: the run was recorded on "
                         f"{recorded.last_environment['device']}, whose NCCL reduction it does not")
    return req.ranks


def _check_data(parent: RunStore, recorded: Manifest) -> None:
    """The built-in run's samples are the recorded ones: its embedded corpus whole and as fingerprinted, or its
    token file unchanged."""
    if recorded.data.embedded:
        parent.read_tokens()
        return
    path = recorded.config.data.path
    if path and (not Path(path).is_file() or fingerprint_file(Path(path))["digest"] != recorded.data.digest):
        raise UsageError(f"data file {path} is missing or changed since the run was recorded: restore the "
                         "original file to replay it")


def _check_drops(parent: RunStore, drop: list[list[int]], store_path: Location) -> None:
    """Every dropped sample was trained on at its step, and no step loses all of its samples."""
    ids = parent.read_steps(["sample_ids"])["sample_ids"]
    for step, sample in drop:
        if sample not in ids[step]:
            raise UsageError(f"--drop {step}:{sample}: sample {sample} was not trained on at step {step} "
                             f"(`replay batch {store_path} --step {step}` lists that step's samples)")
        if set(np.asarray(ids[step]).ravel()) <= {s for t, s in drop if t == step}:
            raise UsageError(f"--drop leaves no sample of step {step}; skip the step with --skip {step}")


def _existing(path: Location, spec: ReplaySpec, req: ReplayRequest, store_path: Location,
              world_size: int) -> tuple[bool, bool] | None:
    """A replay of this name made before: (whether it still has to run, whether it resumes) when it is kept,
    None when it is removed to run anew (discarded, or nothing committed to resume from)."""
    existing = RunStore.open(path)
    m = existing.manifest
    assert m.replay is not None, "a store under replays/ is a replay"
    if _identity(m.replay) != _identity(spec):
        raise UsageError(f"a different replay named {replay_id(req)!r} exists in {store_path}; choose another --name")
    if m.status == "complete":
        return False, False
    if req.resume and existing.checkpoints():
        resumed_from = resume_run(RunStore.open(path, mode="a"), world_size)
        assert resumed_from is not None, "it has a committed checkpoint"
        return True, True
    if not (req.resume or req.discard):
        reached = (f"it reached step {existing.end_step - 1}" if existing.n_steps else "before its first step")
        raise UsageError(f"replay {replay_id(req)!r} in {store_path} was interrupted ({reached}): pass --resume to "
                         "continue it or --discard to start it anew")
    path.remove_tree()
    return None


def _identity(spec: ReplaySpec) -> tuple[Any, ...]:
    """What names a replay: two specs with the same name must agree on it."""
    return spec.start, spec.stop, spec.start_checkpoint, spec.overrides


def run(store: Where, req: ReplayRequest, ranks: RankLauncher | None = None, under: str | None = None,
        command: str = "replay run", warn: Callable[[str], None] = lambda m: None) -> Replay:
    """Prepare, run the ranks (unless an identical complete replay exists), and verify against the record.
    The ranks start as for the recording (launch/ranks.py `choose_launcher`), or on `ranks` where it takes
    them: warm ranks (launch/pool.py) or a fork server of the caller's for a local-launcher replay of their
    world size, a Ray placement group's nodes for any (launch/ray_ranks.py). The store's lease is taken
    first, or, with `under` (a bisect's probes), the lease of the process this one works for is checked; the
    replay's own lease is taken in both cases (store/lease.py)."""
    store = Location.parse(store)
    parent = RunStore.open(store)   # a missing store is named before anything is made
    on_cluster = isinstance(ranks, RayRanks)
    with writing(store / "replays" / replay_id(req), command, under=under) as lease:
        warnings: list[str] = []

        def note(message: str) -> None:
            warnings.append(message)
            warn(message)

        path, cfg, pending, resume = prepare(parent, req, note, on_cluster=on_cluster)
        recorded = parent.manifest
        notes = environment_notes(recorded.last_environment)
        caps = Capabilities.of(recorded)
        script = pending and caps.relaunches_script
        try:
            if pending:
                world = req.ranks or recorded.world_size
                with launching(caps.launcher, world, recorded.command if script else None, ranks) as launcher:
                    launcher.run(RankJob(path, lease.spec, resume, world, env=launcher_env(cfg)))
        except NodeLost as e:
            raise NodeLost(f"{e}: {_keep_committed(path, recorded.world_size)}") from None
        except ReplayError:
            refused = _refusal(path)
            if refused is not None:   # an override reached nothing (recorder/overrides.py): no result is kept
                path.remove_tree()
                raise UsageError(refused) from None
            left = RunStore.open(path)
            if (script or on_cluster) and not resume and left.n_steps == 0 and not left.checkpoints():
                path.remove_tree()   # refused before its first step (by the script, or the cluster): nothing to keep
            raise
        done = RunStore.open(path, mode="a")
        if script and done.manifest.status != "complete":   # the script left its loop (or exited) before the end
            raise ReplayError(f"the training script ended without an error after step {done.end_step - 1}, "
                              f"before the window {req.start}..{req.stop} was done: it left `loop.steps()` early "
                              "(a `break`, or a step limit of its own)")
        if recorded.last_environment and done.manifest.last_environment:   # the machines the ranks ran on, not this one
            notes = differences(recorded.last_environment, done.manifest.last_environment)
        verification = dataclasses.replace(verify(parent, done), environment=notes)
        result = Replay(path, created=pending, verification=verification, environment_notes=notes,
                        warnings=warnings, reached=done.manifest.replay_spec.reached)
        lease.check()
        done.update_manifest(replay=dataclasses.replace(done.manifest.replay_spec, verification=verification))
    return result


def run_on_ray(store: Where, req: ReplayRequest, address: str, placing: Placing | None = None,
               warn: Callable[[str], None] = lambda m: None) -> Replay:
    """`run`, its ranks on a placement group of the Ray cluster at `address` (launch/ray_ranks.py)."""
    store = Location.parse(store)
    with ray_session(address), RayRanks(RunStore.open(store).manifest, placing or Placing()) as cluster:
        return run(store, req, ranks=cluster, warn=warn)


def _refusal(path: Location) -> str | None:
    """Why the replay's ranks stopped it, when an override of it reached nothing (rank 0 wrote it)."""
    try:
        reached = RunStore.open(path).manifest.replay_spec.reached
    except ReplayError:
        return None
    return reached.refused if reached is not None else None


def _keep_committed(path: Location, world_size: int) -> str:
    """After a lost node: cut the replay back to its last committed checkpoint (nothing half-written stays),
    or remove it where it committed none; says which, and how to go on."""
    left = RunStore.open(path, mode="a")
    if not left.checkpoints():
        path.remove_tree()
        return "nothing of the replay was committed, and nothing of it is kept: run the command again"
    step = resume_run(left, world_size)
    return f"the replay is kept up to its committed checkpoint at step {step}: add --resume to continue it"


def verify(parent: RunStore, replay: RunStore) -> Verification:
    """Compare every replayed step with the record, in the order the step computed it (losses, gradient
    norm, learning rate, then the state after its update: every rank's digests), and name the first step
    where anything differs and all that differs there. Skipped steps (not trained on) are left out."""
    fields = [*SCALAR_FIELDS, "state_digest"]
    rec, rep = parent.read_steps(fields), replay.read_steps(fields)
    steps = rep["step"].tolist()
    skipped = set(replay.manifest.replay_spec.skip)
    digests = _comparable(parent.digests, replay.digests)
    names = digests[0].names if digests else []
    note = _scalars_only(parent.digests, replay.digests, steps)
    held = [name for name in ("loss", "grad_norm", "lr")   # a loop may not log its gradient norm: NaN throughout
            if steps and not np.isnan(np.asarray(rec[name], np.float64)[steps]).all()]
    for i, step in enumerate(steps):
        if step in skipped:
            continue
        scalars = [change for name in SCALAR_FIELDS for change in _changes(name, rec[name][step], rep[name][i])
                   if not (name == "rank_loss" and np.size(rec[name][step]) == 1)]   # one rank's is the loss
        state = None
        if digests and step >= max(d.since for d in digests):
            state = _state_change(rec["state_digest"][step], rep["state_digest"][i], names)
        if scalars or state:
            return Verification(_span(steps), False, STATE if note is None else SCALARS,
                                Divergence(step, scalars, state), len(names), note, compared=held)
    return Verification(_span(steps), True, STATE if note is None else SCALARS, None, len(names), note, compared=held)


def _span(steps: list[int]) -> list[int]:
    return [steps[0], steps[-1]] if steps else []


def _comparable(recorded: DigestInfo | None, replayed: DigestInfo | None) -> tuple[DigestInfo, DigestInfo] | None:
    if recorded is None or replayed is None or recorded.kind != replayed.kind or recorded.names != replayed.names:
        return None
    return recorded, replayed


def _scalars_only(recorded: DigestInfo | None, replayed: DigestInfo | None, steps: list[int]) -> str | None:
    """Why some compared step's state could not be compared (None: every step's was)."""
    if recorded is None:
        return "the record holds no state digests: it was recorded by an earlier version of replay"
    if replayed is None:
        return "the replay holds no state digests"
    if recorded.kind != replayed.kind:
        return f"the record's state digests are {recorded.kind}, the replay's {replayed.kind} (another device)"
    if recorded.names != replayed.names:
        only = sorted(set(recorded.names) ^ set(replayed.names))
        return f"the record's and the replay's states hold other tensors ({', '.join(only[:3])})"
    if steps and steps[0] < recorded.since:
        return f"the record holds state digests from step {recorded.since} on only (resumed by a later version)"
    return None


def _changes(name: str, recorded: np.ndarray, replayed: np.ndarray) -> list[ScalarChange]:
    """The scalar `name` of one step where its bits differ: one change, or one per differing rank."""
    a, b = np.atleast_1d(np.asarray(recorded, np.float64)), np.atleast_1d(np.asarray(replayed, np.float64))
    differ = np.flatnonzero(a.view(np.uint64) != b.view(np.uint64))
    label = (lambda r: f"{name}[{r}]") if np.ndim(recorded) else (lambda r: name)
    return [ScalarChange(label(int(r)), float(a[r]), float(b[r])) for r in differ]


def _state_change(recorded: np.ndarray, replayed: np.ndarray, names: list[str]) -> StateChange | None:
    """Which tensors' digests differ on which ranks, for one step ((rank, tensor) digests each side)."""
    differ = recorded != replayed
    if not differ.any():
        return None
    tensors = [names[t] for t in np.flatnonzero(differ.any(axis=0))]
    return StateChange(tensors=tensors, ranks=np.flatnonzero(differ.any(axis=1)).tolist(), of=len(names))
