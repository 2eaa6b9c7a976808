"""`replay bisect`: narrow a recorded loss spike down with replays ("probes"). Read it top to bottom.

1. baseline  a plain replay from the nearest checkpoint before the spike must reproduce it (bit for
             bit where the environment matches); otherwise nothing below could be trusted. It runs
             alongside the first probes, which are only used once it has passed.
2. steps     the counterfactual (`--fix`) applied from a checkpoint, then from a step: the latest
             checkpoint from which it still prevents the spike, the earliest step from which it no
             longer can (the window in which the spike is decided), and the first step at which its
             trajectory separates from the record.
3. layers    the counterfactual on subsets of layers (delta debugging): a minimal set that prevents it.
4. heads     the same over the heads of those layers.
5. data      batches of the window skipped, then single samples left out: a minimal set whose removal
             prevents the spike.

"Prevents the spike" is the recording's detector rule (bisect/rule.py). Every probe is a replay stored
in the run store; the session (parameters, probes, phases, verdict) is `STORE/bisect/<id>`, rewritten
after every probe, so running the same command again resumes it without re-running finished probes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from replay import faults
from replay.bisect.probes import LocalProbes, ProbeRunner, request
from replay.bisect.rule import Rule, judge
from replay.bisect.search import ddmin, ddmin_bound, last_true, last_true_bound
from replay.bisect.session import (
    BaselineResult,
    DataResult,
    HeadsResult,
    LayersResult,
    Probe,
    Separation,
    Session,
    StepsResult,
    Verdict,
)
from replay.errors import ReplayError, UsageError
from replay.launch.forkserver import ForkServer
from replay.launch.job import fresh_ranks
from replay.launch.ray_cluster import cluster_address, cluster_cpus, ray_session
from replay.launch.ray_ranks import Placing, RayRanks
from replay.recorder.command import check_unchanged
from replay.replayer.overrides import apply, parse_fix
from replay.replayer.replays import ReplayRequest, replay_id
from replay.store import RunStore
from replay.store.capabilities import Capabilities
from replay.store.lease import Lease, writing
from replay.store.location import Location, Where
from replay.store.manifest import CommandInfo, Manifest
from replay.store.object_lease import ObjectLease
from replay.store.overrides import Overrides

PHASES = {"steps": ["steps"], "layers": ["layers"], "heads": ["layers", "heads"], "data": ["data"],
          "all": ["steps", "layers", "heads", "data"]}
SEPARATION = 1e-3   # relative loss difference at which a trajectory "measurably" separates from the record


class NoSpikeError(ReplayError):
    """Nothing to bisect: not a failure of the tool or of the input."""

    exit_code = 3


class UntrustedReplayError(ReplayError):
    """The plain replay does not reproduce the record: no probe can be trusted."""

    exit_code = 4


@dataclass
class BisectConfig:
    spike: int | None = None       # default: the largest recorded spike
    by: str = "all"
    fix: str = "safe-softmax"
    horizon: int = 10              # steps after the spike that must stay quiet (rule.py)
    threshold: float | None = None # the detector's robust-z threshold (default: the recording's)
    min_delta: float | None = None # the detector's smallest rise in nats (default: the recording's)
    lookback: int = 4              # checkpoints before the spike the steps search considers
    max_probes: int = 200          # a session's budget; delta debugging stops early (not minimal) past it
    workers: int | None = None
    address: str | None = None
    pack: bool = False             # a run recorded on several nodes: let a probe's ranks share nodes on the cluster
    allow_changed: bool = False    # a script of the user's own: replay it even if its files changed


def parse_counterfactual(text: str) -> Overrides:
    """`safe-softmax[:BETA]`, `hp-delta`, `attention=BACKEND`, `precision=bf16|fp32`, `lr-scale=X`,
    joined with `+` (e.g. `attention=fa2-emu+safe-softmax`)."""
    o = Overrides()
    for part in (p.strip() for p in text.split("+")):
        key, _, value = part.partition("=")
        if key.startswith("safe-softmax") and not value:
            o.fix = parse_fix(key)
        elif key == "hp-delta" and not value:
            o.hp_delta = True
        elif key == "attention" and value:
            o.attention = value
        elif key == "precision" and value:
            o.precision = value
        elif key == "lr-scale" and value:
            try:
                o.lr_scale = float(value)
            except ValueError:
                raise UsageError(f"--fix lr-scale={value!r}: not a number") from None
        else:
            raise UsageError(f"--fix {text!r}: {part!r} is not a counterfactual; use safe-softmax[:BETA], hp-delta, "
                             "attention=BACKEND, precision=bf16|fp32 or lr-scale=X, joined with +")
    return o


def _check_options(cfg: BisectConfig) -> None:
    """The options that need no record, checked before it is read."""
    if cfg.by not in PHASES:
        raise UsageError(f"--by must be one of {', '.join(PHASES)}, got {cfg.by!r}")
    if cfg.horizon < 1:
        raise UsageError(f"--horizon must be >= 1, got {cfg.horizon}")
    if cfg.workers is not None and cfg.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {cfg.workers}")
    if cfg.max_probes < 1:
        raise UsageError(f"--max-probes must be >= 1, got {cfg.max_probes}")
    for option, value in (("--threshold", cfg.threshold), ("--min-delta", cfg.min_delta)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise UsageError(f"{option} must be a finite number >= 0, got {value}")


class Bisect:
    def __init__(self, store_path: Location, cfg: BisectConfig, progress: Callable[[str], None] = lambda m: None,
                 forks: ForkServer | None = None):
        self.store_path, self.cfg, self.say, self.forks = store_path, cfg, progress, forks
        self.record = RunStore.open(store_path)
        if self.record.kind != "run":
            raise UsageError(f"{store_path} is a replay; bisect the run it belongs to")
        self.record.check_relaunchable("replay bisect")
        self.caps = Capabilities.of(self.record.manifest)
        if self.caps.relaunches_script and not cfg.allow_changed:
            assert self.record.manifest.command is not None
            check_unchanged(self.record.manifest.command, "bisecting it")
        _check_options(cfg)
        self.fresh = fresh_ranks()   # a bad REPLAY_RANKS is refused before the session is written
        self.fix = parse_counterfactual(cfg.fix)
        self.run_cfg = self.record.manifest.config
        self.spike = self._pick_spike()
        self.checkpoints = [c.step for c in self.record.checkpoints() if c.step <= self.spike]
        warmup = max(self.run_cfg.spike.warmup, 3)
        if self.spike < warmup:
            raise UsageError(f"the spike at step {self.spike} is too close to the start: the detector judges steps "
                             f"only after its warmup of {warmup} steps, so no probe could be judged")
        if not self.checkpoints:
            raise UsageError(f"the spike at step {self.spike} is too close to the start: no committed checkpoint at "
                             f"or before it in {store_path}; record with a smaller --checkpoint-every")
        self.stop = min(self.spike + cfg.horizon, self.record.end_step - 1)
        self._check_counterfactual()
        spike_cfg = self.run_cfg.spike
        overrides = {k: v for k, v in (("threshold", cfg.threshold), ("min_delta", cfg.min_delta)) if v is not None}
        spike_cfg = type(spike_cfg)(**{**asdict(spike_cfg), **overrides})
        self.rule = Rule(spike_cfg, cfg.horizon)
        self.params = {"spike": self.spike, "by": cfg.by, "fix": cfg.fix, "horizon": cfg.horizon,
                       "threshold": spike_cfg.threshold, "lookback": cfg.lookback}
        if spike_cfg.min_delta:   # only where set: the sessions of earlier versions keep their ids
            self.params["min_delta"] = spike_cfg.min_delta
        digest = hashlib.sha1(json.dumps(self.params, sort_keys=True).encode()).hexdigest()[:8]
        self.id = f"spike-{self.spike}-{cfg.by}-{digest}"
        previous = {s["id"]: s for s in self.record.bisect_sessions()}.get(self.id)
        self.session = (Session.from_dict(previous) if previous else
                        Session(self.id, self.params, self.rule.describe(), created=time.time()))
        self.resumed = previous is not None
        self.new_probes = 0
        self.started = False
        self.lease: Lease | ObjectLease | None = None
        self.runner: ProbeRunner | LocalProbes | None = None

    def _pick_spike(self) -> int:
        spikes = self.record.spikes
        if self.cfg.spike is not None:
            if not 0 <= self.cfg.spike < self.record.end_step:
                raise UsageError(f"--spike {self.cfg.spike} is outside the record: steps 0..{self.record.end_step - 1}")
            return self.cfg.spike
        if not spikes:
            raise NoSpikeError(f"no spike recorded in {self.store_path}: nothing to bisect (`replay info "
                               f"{self.store_path}` shows the detector's settings; pass --spike STEP to bisect a step "
                               "it did not flag)")
        scores = [e["score"] if isinstance(e["score"], (int, float)) else math.inf for e in spikes]
        return int(spikes[int(np.argmax(scores))]["step"])

    def _check_counterfactual(self) -> None:
        phases = PHASES[self.cfg.by]
        if phases == ["data"]:   # skips batches and samples; no counterfactual involved
            return
        try:
            apply(self.run_cfg, self.fix, (self.spike, self.spike), self.caps)
        except UsageError as e:
            raise UsageError(f"--fix {self.cfg.fix!r} does not apply to this run ({e}); e.g. "
                             "--fix attention=fa2-emu+safe-softmax, --fix lr-scale=0.5") from None
        if ("layers" in phases or "heads" in phases) and not (self.fix.touches_attention or self.fix.lr_scale):
            raise UsageError(f"--by {self.cfg.by} applies the counterfactual to layers and heads, but --fix "
                             f"{self.cfg.fix!r} acts on the whole model; use an attention counterfactual or lr-scale=X")
        if ("layers" in phases or "heads" in phases) and self.fix.precision:
            raise UsageError(f"--by {self.cfg.by} cannot narrow precision=...: it is a whole-model setting; "
                             "use --by steps, or an attention counterfactual (e.g. attention=fa2-emu:dtype=fp32)")

    # -- probes ------------------------------------------------------------------------------------

    def prevents(self, requests: list[ReplayRequest], phase: str) -> list[bool]:
        return [probe.prevented for probe in self.probe(requests, phase)]

    def probe(self, requests: list[ReplayRequest], phase: str) -> list[Probe]:
        """Run (or reuse) the probes, judge them by the rule, and save the session after each batch. The
        first batch carries the baseline along (it does not depend on it) and is checked against it
        before any of its answers is used."""
        checked = self.session.phases.baseline is not None
        baseline = [] if checked else [self.baseline_request()]
        keys = [replay_id(r) for r in requests]
        todo = {replay_id(r): r for r in baseline + requests if replay_id(r) not in self.session.probes}
        if todo:
            assert self.runner is not None
            runs = [dataclasses.replace(r, allow_changed=self.cfg.allow_changed) for r in todo.values()]
            for (key, req), outcome in zip(todo.items(), self.runner.run(runs), strict=True):
                phase_of = "baseline" if baseline and key == replay_id(baseline[0]) else phase
                found = judge(self.record, RunStore.open(self.record.location / "replays" / key), self.rule,
                              req.start, req.stop).to_dict()
                self.session.probes[key] = Probe(phase=phase_of, window=[req.start, req.stop], overrides=req.overrides,
                                                 prevented=found["prevented"], spike_at=found["spike_at"],
                                                 peak=found["peak"], baseline=found["baseline"], outcome=outcome)
                self.new_probes += outcome.ran
                self.say(f"  probe {key}: " + ("prevents the spike" if found["prevented"] else
                                               f"spike at step {found['spike_at']}")
                         + (f" ({outcome.seconds:.1f} s)" if outcome.ran else " (already in the store)")
                         + (f"; run again on a new placement group after: {outcome.retried_after}"
                            if outcome.retried_after else "")
                         + (f"; the script was started afresh for it and every later probe: {outcome.started_afresh}"
                            if outcome.started_afresh else ""))
            self.save()
            faults.hit("bisect-kill", self.new_probes)
        if not checked:
            self.check_baseline(self.session.probes[replay_id(baseline[0])])
        return [self.session.probes[k] for k in keys]

    def save(self, **fields: Any) -> None:
        self.session = dataclasses.replace(self.session, **fields)
        self.held().check()
        self.record_rw().write_bisect_session(self.id, self.session.to_dict())

    def held(self) -> Lease | ObjectLease:
        assert self.lease is not None, "probes run and the session is saved under the store's lease"
        return self.lease

    def record_rw(self) -> RunStore:
        return RunStore.open(self.store_path, mode="a")

    # -- the session -------------------------------------------------------------------------------

    def run(self) -> Session:
        """The session, to its end; an error that ends it is stored with it (status "failed"). A session
        that is complete already is answered from the store, without starting anything."""
        if self.session.status == "complete":
            self.say(f"bisect session {self.id} is complete ({len(self.session.probes)} probes): its answer")
            assert self.session.verdict is not None, "a complete session has its verdict"
            return dataclasses.replace(self.session, verdict=dataclasses.replace(self.session.verdict, new_probes=0))
        with writing(self.record.location, "replay bisect") as self.lease:   # one bisect at a time, like any writer
            try:
                return self._run()
            except BaseException as e:   # an interrupt too: the session is not left "running"
                if self.started:   # unless the store refuses this write too (a full disk): `e` is what to say
                    with contextlib.suppress(ReplayError, OSError):
                        self.save(status="failed", error=str(e) or type(e).__name__)
                raise

    def _run(self) -> Session:
        t0 = time.perf_counter()
        before = len(self.session.probes)
        self.say(f"bisect session {self.id}" + (f" (resumed: {before} probes already done)" if self.resumed else "")
                 + f": spike at step {self.spike}; window up to step {self.stop}")
        self.say(f"rule: {self.rule.describe()}")
        world = self.record.manifest.world_size
        # a script's ranks kept up between probes, unless REPLAY_RANKS=fresh; DeepSpeed's start for each probe
        script = self.record.manifest.command if self.caps.serves_replays and not self.fresh else None
        local = not self._on_cluster() and (script is not None or self._local_slots(world) == 1)   # no Ray
        with contextlib.nullcontext() if local else ray_session(self.cfg.address):
            self.started = True
            self.save(status="running", error=None)
            with self._runner(world, script, local) as self.runner:
                phases = self.session.phases
                start = self.checkpoints[-1]
                for phase in PHASES[self.cfg.by]:
                    if phase == "steps":
                        phases.steps = self.steps()
                        start = start if phases.steps.checkpoint is None else phases.steps.checkpoint
                    elif phase == "layers":
                        phases.layers = self.layers(start)
                    elif phase == "heads":
                        assert phases.layers is not None   # PHASES runs layers before heads
                        phases.heads = self.heads(start, phases.layers.layers)
                    elif phase == "data":
                        phases.data = self.data(start)
                    self.save()
                self.probe([], "baseline")   # checked already, unless no phase ran a probe
        seconds = time.perf_counter() - t0
        verdict = self.verdict(seconds)
        self.session.runs.append({"time": time.time(), "seconds": seconds, "new_probes": self.new_probes,
                                  "reused_probes": before})
        self.save(status="complete", verdict=verdict)
        return self.session

    def _runner(self, world: int, script: CommandInfo | None, local: bool) -> ProbeRunner | LocalProbes:
        """Where the probes run, said in one line; sets the search's width (probes at once)."""
        warm = self.caps.warm_ranks and script is None
        if local:
            self.width = 1
            ranks = "of the script's rank(s), kept up between probes" if script else "warm rank(s)" if warm else \
                "fresh rank(s)"
            self.say(f"probes run one at a time in this process, each with {world} {ranks}")
            return LocalProbes(self.store_path, world, self.held().spec, warm, script, self.forks)
        placed = self._placed()
        if placed is not None:
            group = RayRanks(*placed)
            fit = max(1, group.fits())   # none: the first probe's group says why
            cpus, slots = 0, min(self.cfg.workers or fit, fit)
            where = f"each on a placement group of its own: {group.describe()}"
        else:   # a local cluster spans the machine: probes are sized to fit it
            cpus, slots = self._slots(self._per_probe(world), *cluster_cpus())
            kept = "warm " if warm else "the script's, kept up between probes, " if script else ""
            where = f"each with {world} {kept}rank(s) on {cpus} CPU(s)"
        self.width = slots
        self.say(f"probes run on {slots} Ray worker(s), {where}")
        return ProbeRunner(self.store_path, world, cpus, slots, self.held().spec, warm, placed, script)

    def _on_cluster(self) -> bool:
        return cluster_address(self.cfg.address) is not None

    def _placed(self) -> tuple[Manifest, Placing] | None:
        """A run recorded on several nodes, bisected on a cluster (--ray-address or RAY_ADDRESS): its probes keep
        the recorded layout, or pack with --pack. Elsewhere a probe's ranks share one node (or this machine)."""
        if not (self._on_cluster() and self.caps.multi_node):
            return None
        return self.record.manifest, Placing(pack=self.cfg.pack)

    def _per_probe(self, world: int) -> int:
        """The CPUs a probe needs: its ranks x recorded threads."""
        return world * max(1, self.run_cfg.threads)

    def _local_slots(self, world: int) -> int:
        """Probes at once on this machine alone (a local cluster spans it)."""
        here = os.cpu_count() or 1
        return self._slots(self._per_probe(world), here, here, warn=False)[1]

    def _slots(self, per_probe: int, total: int, largest: int, warn: bool = True) -> tuple[int, int]:
        """(CPUs one probe takes, probes at once) on a cluster of `total` CPUs whose largest node has `largest`:
        running more probes than the cores hold oversubscribes them, and threaded kernels then crawl."""
        cpus = min(per_probe, largest)
        fit = max(1, total // cpus)
        slots = min(self.cfg.workers or fit, fit)
        if warn and self.cfg.workers and self.cfg.workers > fit:
            self.say(f"warning: --workers {self.cfg.workers}, but {fit} probe(s) fit at once: each takes {cpus} of "
                     f"the cluster's {total} CPUs (ranks x recorded threads); running {fit}")
        return cpus, slots

    # -- 1. baseline -------------------------------------------------------------------------------

    def baseline_request(self) -> ReplayRequest:
        return request(self.checkpoints[-1], self.stop, Overrides())

    def check_baseline(self, base: Probe) -> None:
        """Stop unless the plain replay reproduced the spike (bit for bit, at the level of the state, where the
        environment matches)."""
        c = self.checkpoints[-1]
        where = f"the plain replay of steps {c}..{self.stop} from checkpoint {c}"
        v, environment = base.outcome.verification, base.outcome.environment
        if not v.bitwise and not environment:
            raise UntrustedReplayError(
                f"{where} is not bit for bit although the environment matches the recording ({v.describe()}): "
                "replays of this run are not deterministic, so no probe could be trusted; "
                f"`replay run {self.store_path} --from {c} --to {self.stop} --verify` shows the same")
        if base.prevented:
            raise UntrustedReplayError(
                f"{where} does not reproduce the spike by the rule"
                + ("" if v.bitwise else f" (the environment differs: {'; '.join(environment)})")
                + ": nothing below could be trusted" + ("; lower --threshold?" if v.bitwise else ""))
        if not v.bitwise:
            self.say(f"warning: {where} reproduces the spike but not bit for bit (environment differs: "
                     f"{'; '.join(environment)})")
        assert base.spike_at is not None, "a baseline that did not spike was refused above"
        self.session.phases.baseline = BaselineResult(checkpoint=c, bitwise=v.bitwise, spike_at=base.spike_at,
                                                      probe=replay_id(self.baseline_request()))
        self.say(f"baseline: {where} reproduces the spike at step {base.spike_at}"
                 + (", bit for bit" if v.bitwise else ""))

    # -- 2. steps ----------------------------------------------------------------------------------

    def steps(self) -> StepsResult:
        fix, stop = self.fix, self.stop
        candidates = self.checkpoints[-self.cfg.lookback:]

        def tested(starts: list[int]) -> list[bool]:
            return self.prevents([request(s, stop, fix) for s in starts], "steps")

        i, monotone = last_true(candidates, tested, self.width)
        bound = last_true_bound(len(candidates), self.width)
        if i < 0:
            self.say(f"steps: {self.cfg.fix} from checkpoints {candidates[0]}..{candidates[-1]} does not prevent "
                     "the spike")
            return StepsResult(checkpoint=None, candidates=candidates, bound=bound, monotone=monotone)
        good = candidates[i]
        upper = candidates[i + 1] if i + 1 < len(candidates) else self.spike + 1
        between = list(range(good + 1, min(upper, self.spike + 1)))
        j, monotone_steps = last_true(between, tested, self.width)
        last_good = between[j] if j >= 0 else good
        bound += last_true_bound(len(between), self.width)
        separation = self._separation(replay_id(request(good, stop, fix)))
        self.say(f"steps: {self.cfg.fix} prevents the spike from checkpoint {good} and from every step up to "
                 f"{last_good}; from step {last_good + 1} on it no longer can"
                 + (f"; {separation.describe()}" if separation.describe() else ""))
        return StepsResult(checkpoint=good, last_preventing_step=last_good, first_failing_step=last_good + 1,
                           window=[good, last_good + 1], separation=separation, candidates=candidates, bound=bound,
                           monotone=monotone and monotone_steps)

    def _separation(self, probe_id: str) -> Separation:
        """Where the probe's trajectory parts from the record: the first step that differs in any bit (its
        verification: the state after the update, or a loss), and the first whose loss differs by more than
        SEPARATION, relatively."""
        probe = RunStore.open(self.record.location / "replays" / probe_id)
        verification = probe.manifest.replay_spec.verification
        assert verification is not None, "a probe is verified when it has run"
        rec = self.record.read_steps(["loss"])["loss"]
        rows = probe.read_steps(["loss"])
        measurable = next((step for step, loss in zip(rows["step"].tolist(), rows["loss"].tolist(), strict=True)
                           if abs(loss - rec[step]) > SEPARATION * abs(rec[step])), None)
        divergence = verification.divergence
        return Separation(first_bit=None if divergence is None else divergence.step, measurable=measurable,
                          relative=SEPARATION, first_bit_in=None if divergence is None else divergence.first,
                          level=verification.level)

    # -- 3. layers, 4. heads -----------------------------------------------------------------------

    def layers(self, start: int) -> LayersResult:
        n = self.run_cfg.model.n_layer

        def scoped(subsets: list[list[int]]) -> list[bool]:
            return self.prevents([request(start, self.stop, self.fix.with_scope(layers=sorted(s))) for s in subsets],
                                 "layers")

        if not scoped([list(range(n))])[0]:
            self.say(f"layers: {self.cfg.fix} on all {n} layers from step {start} does not prevent the spike; "
                     "nothing to narrow")
            return LayersResult(start=start, layers=None, bound=1 + ddmin_bound(n))
        found, minimal = ddmin(list(range(n)), scoped, self.exhausted)
        found = sorted(found)
        also = self._alternatives("layers", "layers", found)
        self.say(f"layers: {self.cfg.fix} on layer(s) {', '.join(map(str, found))} alone prevents the spike "
                 "(removing any one of them does not)" + (f"; so does layer set {also}" if also else ""))
        return LayersResult(start=start, layers=found, also=also, minimal=minimal, bound=1 + ddmin_bound(n),
                            rerun=self.command(request(start, self.stop, self.fix.with_scope(layers=found))))

    def _alternatives(self, phase: str, key: str, found: list[Any]) -> list[Any]:
        """Other sets no larger than the answer that the probes found preventing too (ddmin keeps the first)."""
        sets = [(p, getattr(p.overrides, key)) for p in self.session.probes.values() if p.phase == phase]
        return [chosen for p, chosen in sets
                if p.prevented and chosen is not None and len(chosen) <= len(found) and sorted(chosen) != found]

    def heads(self, start: int, layers: list[int] | None) -> HeadsResult:
        if not layers:
            return HeadsResult(start=start, heads=None, bound=0)
        units = [[layer, head] for layer in layers for head in range(self.run_cfg.model.n_head)]

        def scoped(subsets: list[list[list[int]]]) -> list[bool]:
            return self.prevents([request(start, self.stop, self.fix.with_scope(units=sorted(s))) for s in subsets],
                                 "heads")

        if not scoped([units])[0]:
            self.say(f"heads: {self.cfg.fix} on every head of layer(s) {layers} (their attention only) does not "
                     "prevent the spike: the rest of the layer matters")
            return HeadsResult(start=start, heads=None, bound=1 + ddmin_bound(len(units)))
        found, minimal = ddmin(units, scoped, self.exhausted)
        found = sorted(found)
        also = self._alternatives("heads", "units", found)
        named = ", ".join(f"{layer}.{head}" for layer, head in found)
        self.say(f"heads: {self.cfg.fix} on head(s) {named} (layer.head) alone prevents the spike"
                 + (f"; so do the head sets {also}" if also else ""))
        return HeadsResult(start=start, heads=found, also=also, minimal=minimal, bound=1 + ddmin_bound(len(units)),
                           rerun=self.command(request(start, self.stop, self.fix.with_scope(units=found))))

    # -- 5. data -----------------------------------------------------------------------------------

    def data(self, start: int) -> DataResult:
        batches = list(range(start, self.spike + 1))

        def skipped(subsets: list[list[int]]) -> list[bool]:
            return self.prevents([self._without(start, Overrides(skip=sorted(s))) for s in subsets], "data")

        everything = self.probe([self._without(start, Overrides(skip=batches))], "data")[0]
        bound = 1 + ddmin_bound(len(batches))
        if not everything.prevented:
            self.say(f"data: skipping every batch of steps {start}..{self.spike} does not prevent the spike "
                     f"(the detector fires at step {everything.spike_at} instead): the data in the window is not "
                     "what makes it")
            return DataResult(window=[start, self.spike], batches=None, samples=None, bound=bound,
                              spike_at_without=everything.spike_at)
        steps, minimal = ddmin(batches, skipped, self.exhausted)
        steps = sorted(steps)
        if not self.caps.can_drop_samples:   # e.g. a script of the user's own: narrowed down to batches
            self.say(f"data: skipping the batches of step(s) {', '.join(map(str, steps))} prevents the spike "
                     "(single samples cannot be left out of this run's steps: it is narrowed down to batches)"
                     + self._stream_places(steps))
            return DataResult(window=[start, self.spike], batches=steps, samples=None, minimal=minimal, bound=bound,
                              rerun=self.command(self._without(start, Overrides(skip=steps))))
        ids = self.record.read_steps(["sample_ids"])["sample_ids"]
        units = sorted({(s, int(i)) for s in steps for i in np.asarray(ids[s]).ravel()})
        per_step = {s: {u for u in units if u[0] == s} for s in steps}

        def without(subset: list[tuple[int, int]]) -> Overrides:
            chosen = set(subset)
            whole = [s for s in steps if per_step[s] <= chosen]
            return Overrides(skip=whole, drop=sorted([list(u) for u in chosen if u[0] not in whole]))

        def dropped(subsets: list[list[tuple[int, int]]]) -> list[bool]:
            return self.prevents([self._without(start, without(s)) for s in subsets], "data")

        samples, minimal_samples = ddmin(units, dropped, self.exhausted)
        samples = sorted(samples)
        bound += ddmin_bound(len(units))
        self.say(f"data: leaving out {len(samples)} sample(s) prevents the spike: "
                 + ", ".join(f"step {s} sample {i}" for s, i in samples))
        return DataResult(window=[start, self.spike], batches=steps, samples=[list(u) for u in samples],
                          minimal=minimal and minimal_samples, bound=bound,
                          rerun=self.command(self._without(start, without(samples))))

    def command(self, req: ReplayRequest) -> str:
        """The `replay run` that makes this probe (it is in the store already; run it with --verify, or
        with another --name and --checkpoint-every to look closer)."""
        return f"replay run {self.store_path} --from {req.start} --to {req.stop} {req.overrides.as_args()}".strip()

    def _diff_command(self, steps: Any, layers: Any, heads: Any) -> str | None:
        """For an attention or precision counterfactual: the `replay diff` of the first step where it parts from
        the record (from the checkpoint it still prevents the spike from), with the counterfactual where the
        search put it; for a built-in run, after the plain replay that checkpoints that step where the record has
        no checkpoint there (a script's diff replays the steps before it itself)."""
        fix = self.fix
        first = steps.separation.first_bit if steps and steps.separation else None
        caps = self.record.capabilities
        if first is None or not (fix.touches_attention or fix.precision) or not caps.builtin and (
                caps.sharded or caps.multi_node or self.record.manifest.sharding is not None):
            return None   # a script's run whose step replay diff does not trace (docs/diff.md)
        scoped = (fix.with_scope(units=heads.heads) if heads and heads.heads else
                  fix.with_scope(layers=layers.layers) if layers and layers.layers else fix)
        if not self.record.capabilities.builtin or any(c.step == first for c in self.record.checkpoints()):
            return f"replay diff {self.store_path} --step {first} {scoped.as_args()}".strip()
        name = f"at-{first}"
        return (f"replay run {self.store_path} --from {first} --to {first} --checkpoint-every 1 --name {name} && "
                f"replay diff {self.store_path / 'replays' / name} --step {first} {scoped.as_args()}").strip()

    def _stream_places(self, steps: list[int]) -> str:
        """A stream's run (recorder/stream.py): where the samples of `steps` lie in each rank's stream."""
        fields = self.record.read_steps(["sample_ids", "sample_digest"])
        if not len(fields["sample_digest"]):
            return ""
        first = self.record.first_step
        places = []
        for step in steps:
            ids = np.asarray(fields["sample_ids"][step - first])
            places += [f"step {step} rank {rank}: samples {', '.join(_spans(ids[rank]))}" for rank in range(len(ids))]
        return (f"; in the stream: {'; '.join(places)} (`replay batch {self.record.location} --step {steps[0]}` "
                "lists each with its digest)")

    def _without(self, start: int, o: Overrides) -> ReplayRequest:
        """A data probe: skipped batches extend its window, so it trains as many steps past the spike as
        the plain replay does (a spike merely delayed by the skipped steps is not prevented)."""
        return request(start, min(self.stop + len(o.skip), self.record.end_step - 1), o)

    def exhausted(self) -> bool:
        if len(self.session.probes) < self.cfg.max_probes:
            return False
        self.say(f"  the probe budget (--max-probes {self.cfg.max_probes}) is spent: the answer below is not minimal")
        return True

    # -- the answer --------------------------------------------------------------------------------

    def verdict(self, seconds: float) -> Verdict:
        steps, layers, heads, data = (self.session.phases.steps, self.session.phases.layers,
                                      self.session.phases.heads, self.session.phases.data)
        searches = [p for p in (layers, heads, data) if p is not None]
        used = {p: sum(1 for e in self.session.probes.values() if e.phase == p)
                for p in ("baseline", "steps", "layers", "heads", "data")}
        return Verdict(
            spike=self.spike, phases=PHASES[self.cfg.by], fix=self.cfg.fix, rule=self.rule.describe(),
            window=steps.window if steps else None, separation=steps.separation if steps else None,
            layers=layers.layers if layers else None, heads=heads.heads if heads else None,
            minimal=all(p.minimal is not False for p in searches),
            commands=[p.rerun for p in searches if p.rerun], diff=self._diff_command(steps, layers, heads),
            also={"layers": (layers.also if layers else None) or [], "heads": (heads.also if heads else None) or []},
            batches=data.batches if data else None, samples=data.samples if data else None,
            data_window=data.window if data else None, spike_without_data=data.spike_at_without if data else None,
            probes=len(self.session.probes), new_probes=self.new_probes, probes_by_phase=used,
            bound=1 + sum(p.bound for p in (steps, *searches) if p is not None),
            seconds=seconds, workers=self.width)


def bisect(store_path: Where, cfg: BisectConfig, progress: Callable[[str], None] = lambda m: None,
           forks: ForkServer | None = None) -> Session:
    """`forks`: a fork server of the caller's that probes run in this process fork their warm ranks from."""
    store_path = Location.parse(store_path)
    return Bisect(store_path, cfg, progress, forks).run()


def _spans(ids: np.ndarray) -> list[str]:
    """A rank's sample ids of a step (padded with -1) as runs: "600..607"."""
    kept = sorted(int(i) for i in np.asarray(ids).ravel() if i >= 0)
    runs: list[list[int]] = []
    for i in kept:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return [f"{a}..{b}" if a != b else str(a) for a, b in runs]
