"""A bisect session and its verdict, typed, and in words: what the CLI, `replay info` and the report print.

A session is stored in the run store as one JSON document (`STORE/bisect/<id>`): its parameters, every
probe (a replay, judged by the rule), the result of each phase (below: one JSON object each, whose fields
that do not apply to an outcome are left out), and, once complete, the verdict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Self

from replay.store.overrides import Overrides
from replay.store.verification import Divergence, Verification


@dataclass(frozen=True)
class Separation:
    """Where a counterfactual's trajectory parts from the record: the first step that differs in any bit (by
    its verification: the state after the update at the level of the state, else a loss) and the first whose
    loss differs by more than `relative`."""

    first_bit: int | None
    measurable: int | None
    relative: float
    first_bit_in: str | None = None      # what differed first there: "state", "loss", ... (None: not said)
    level: str | None = None             # the verification's level (replay/store/verification.py)

    def describe(self) -> str:
        parts = []
        if self.first_bit is not None:
            what = "its state after the update" if self.first_bit_in == "state" else f"its {self.first_bit_in}"
            parts.append(f"it first differs from the record at step {self.first_bit} ({what})")
        if self.measurable is not None:
            parts.append(f"its loss by more than {self.relative:g} relative at step {self.measurable}")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """As stored: the fields sessions of earlier versions did not have are left out where unknown."""
        return {k: v for k, v in asdict(self).items() if v is not None or k in ("first_bit", "measurable")}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Separation:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class Verdict:
    spike: int
    phases: list[str]                    # the phases the session ran (steps, layers, heads, data)
    fix: str                             # the counterfactual
    rule: str
    window: list[int] | None = None      # [checkpoint it still prevents the spike from, step it no longer can]
    separation: Separation | None = None       # where the counterfactual's trajectory parts from the record
    layers: list[int] | None = None
    heads: list[list[int]] | None = None       # [layer, head] pairs
    minimal: bool = True                 # False: the probe budget ran out before the search finished
    commands: list[str] = field(default_factory=list)   # the `replay run` commands of the answer's probes
    diff: str | None = None              # the `replay diff` of the decisive step under the counterfactual
    also: dict[str, list[Any]] = field(default_factory=dict)  # other sets the probes found equally sufficient
    batches: list[int] | None = None
    samples: list[list[int]] | None = None      # [step, sample id] pairs
    data_window: list[int] | None = None
    spike_without_data: int | None = None
    probes: int = 0
    new_probes: int = 0
    probes_by_phase: dict[str, int] = field(default_factory=dict)
    bound: int = 0                       # the probes the searches could need at worst
    seconds: float = 0.0
    workers: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "separation": self.separation.to_dict() if self.separation else None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Verdict:
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in d.items() if k in known}
        if fields.get("separation"):
            fields["separation"] = Separation.from_dict(fields["separation"])
        return cls(**fields)

    def line(self) -> str:
        """The answer in one line."""
        parts = [f"decided in steps {self.window[0]}..{self.window[1]}" if self.window else None,
                 f"layers {', '.join(map(str, self.layers))}" if self.layers else None,
                 f"heads {', '.join(f'{a}.{b}' for a, b in self.heads)}" if self.heads else None,
                 f"samples {', '.join(f'{s}:{i}' for s, i in self.samples)}" if self.samples else
                 f"batches of steps {', '.join(map(str, self.batches))}" if self.batches else None]
        return "; ".join(p for p in parts if p) or "nothing narrowed down"

    def lines(self, sample: Callable[[int, int], list[str]]) -> list[str]:
        """The answer in words; `sample(step, id)` gives the lines that show one sample."""
        uses_fix = set(self.phases) != {"data"}
        out = [f"spike at step {self.spike}" + (f", counterfactual {self.fix}:" if uses_fix else ":")]
        if "steps" in self.phases and not self.window:
            out.append("  steps: the counterfactual prevents the spike from none of the checkpoints tried")
        if self.window:
            sep = self.separation.describe() if self.separation else ""
            out.append(f"  decided in steps {self.window[0]}..{self.window[1]}: the counterfactual prevents it from "
                       f"checkpoint {self.window[0]}, not from step {self.window[1]} on" + (f"; {sep}" if sep else ""))
        if self.layers:
            out.append(f"  layers: {', '.join(map(str, self.layers))} (the counterfactual on these alone prevents the "
                       "spike" + "".join(f"; so it does on {', '.join(map(str, a))}"
                                         for a in self.also.get("layers", [])) + ")")
        elif "layers" in self.phases:
            out.append("  layers: the counterfactual on all layers does not prevent the spike; nothing to narrow")
        if self.heads:
            out.append(f"  heads: {', '.join(f'{a}.{b}' for a, b in self.heads)} (layer.head; on these alone it "
                       "prevents the spike" + "".join(f"; so it does on {', '.join(f'{a}.{b}' for a, b in h)}"
                                                      for h in self.also.get("heads", [])) + ")")
        elif "heads" in self.phases and self.layers:
            out.append("  heads: on the attention heads of those layers alone it does not prevent the spike: the "
                       "rest of the layer (its MLP, layer norms) matters")
        if self.samples:
            out.append(f"  data: batches of step(s) {', '.join(map(str, self.batches or []))}; leaving out these "
                       f"{len(self.samples)} sample(s) prevents the spike:")
            for step, sample_id in self.samples:
                out += sample(step, sample_id)
        elif self.batches:
            out.append(f"  data: skipping the batches of step(s) {', '.join(map(str, self.batches))} prevents the "
                       "spike")
        elif self.data_window:
            out.append(f"  data: no batch is responsible: skipping every batch of steps {self.data_window[0]}.."
                       f"{self.data_window[1]} does not prevent the spike (it comes at step {self.spike_without_data} "
                       "instead)")
        out += [f"  replay it: {command}" for command in self.commands]
        if self.diff:
            out.append(f"  where it parts, operation by operation: {self.diff}")
        if not self.minimal:
            out.append("  (the probe budget was spent before the search finished: the sets above prevent the spike "
                       "but may not be minimal; raise --max-probes)")
        out.append(f"  {self.probes} probes ({self.new_probes} run now; worst case {self.bound}), {self.seconds:.1f} s "
                   f"on {self.workers} worker(s)")
        return out

    def rows(self) -> list[tuple[str, str]]:
        """The answer as a table (the report's)."""
        def listed(values: list[Any] | None, fmt: Callable[[Any], str] = str) -> str:
            return ", ".join(fmt(v) for v in values) if values else "-"

        return [("counterfactual", self.fix if set(self.phases) != {"data"} else "-"),
                ("decisive window", f"{self.window[0]}..{self.window[1]} (prevents from checkpoint {self.window[0]}, "
                                    f"not from step {self.window[1]} on)" if self.window else "-"),
                ("parts from the record", self.separation.describe() if self.separation else "-"),
                ("layers", listed(self.layers)),
                ("heads (layer.head)", listed(self.heads, lambda h: f"{h[0]}.{h[1]}")),
                ("batches", listed(self.batches)),
                ("samples (step:id)", listed(self.samples, lambda s: f"{s[0]}:{s[1]}")),
                ("probes", f"{self.probes} (worst case {self.bound}); {self.seconds:.1f} s on {self.workers} "
                           "worker(s)")]


@dataclass(frozen=True, kw_only=True)
class PhaseResult:
    ALWAYS: ClassVar[tuple[str, ...]] = ()   # the answer's fields, stored even when None (nothing found)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None or k in self.ALWAYS}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass(frozen=True, kw_only=True)
class BaselineResult(PhaseResult):
    """The plain replay from the checkpoint before the spike, which reproduced it."""

    checkpoint: int
    bitwise: bool
    spike_at: int                        # where the plain replay spiked
    probe: str                           # its replay id


@dataclass(frozen=True, kw_only=True)
class StepsResult(PhaseResult):
    ALWAYS = ("checkpoint",)

    checkpoint: int | None               # the latest checkpoint the counterfactual prevents the spike from
    last_preventing_step: int | None = None
    first_failing_step: int | None = None
    window: list[int] | None = None      # [checkpoint, first failing step]
    separation: Separation | None = None  # where the counterfactual's trajectory parts from the record
    candidates: list[int]                # the checkpoints tried
    bound: int                           # the probes the searches could need at worst
    monotone: bool                       # False: the answers were not monotone in the start step

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        if self.separation is not None:
            out["separation"] = self.separation.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        sep = d.get("separation")
        return super().from_dict({**d, "separation": Separation.from_dict(sep) if sep else None})


@dataclass(frozen=True, kw_only=True)
class LayersResult(PhaseResult):
    ALWAYS = ("layers",)

    start: int                           # the step the probes start from
    layers: list[int] | None             # None: the counterfactual on every layer does not prevent the spike
    also: list[list[int]] | None = None  # other sets no larger that prevent it too
    minimal: bool | None = None          # False: the probe budget ran out first; None: nothing was searched
    bound: int
    rerun: str | None = None             # the `replay run` of the answer's probe


@dataclass(frozen=True, kw_only=True)
class HeadsResult(PhaseResult):
    ALWAYS = ("heads",)

    start: int
    heads: list[list[int]] | None        # [layer, head] pairs; None: the layers' heads alone do not prevent it
    also: list[list[list[int]]] | None = None
    minimal: bool | None = None
    bound: int
    rerun: str | None = None


@dataclass(frozen=True, kw_only=True)
class DataResult(PhaseResult):
    ALWAYS = ("batches", "samples")

    window: list[int]                    # the steps whose batches were tried
    batches: list[int] | None            # None: skipping every batch does not prevent the spike
    samples: list[list[int]] | None      # [step, sample id] pairs; None: narrowed down to batches only
    minimal: bool | None = None
    bound: int
    rerun: str | None = None
    spike_at_without: int | None = None  # where the spike comes with every batch skipped


@dataclass
class Phases:
    """Each phase's result, once it has run."""

    baseline: BaselineResult | None = None
    steps: StepsResult | None = None
    layers: LayersResult | None = None
    heads: HeadsResult | None = None
    data: DataResult | None = None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: r.to_dict() for f in dataclasses.fields(self) if (r := getattr(self, f.name)) is not None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Phases:
        return cls(baseline=BaselineResult.from_dict(d["baseline"]) if "baseline" in d else None,
                   steps=StepsResult.from_dict(d["steps"]) if "steps" in d else None,
                   layers=LayersResult.from_dict(d["layers"]) if "layers" in d else None,
                   heads=HeadsResult.from_dict(d["heads"]) if "heads" in d else None,
                   data=DataResult.from_dict(d["data"]) if "data" in d else None)


@dataclass(frozen=True)
class ProbeOutcome:
    """How a probe replay ran (bisect/probes.py): its verification against the record, at the level of the
    state, and what differed in its environment."""

    id: str
    ran: bool                            # False: an identical replay was in the store already
    seconds: float
    verification: Verification
    environment: list[str]               # what differed from the record's environment
    node: str
    retried_after: str | None = None     # a lost node, after which it ran again
    started_afresh: str | None = None    # why the script kept up between probes was started afresh for it


@dataclass(frozen=True)
class Probe:
    """A probe as the session keeps it: its phase, window and overrides, the rule's judgement (bisect/rule.py)
    and how it ran."""

    phase: str
    window: list[int]
    overrides: Overrides
    prevented: bool
    spike_at: int | None
    peak: float | str                    # non-finite values as strings, as JSON keeps them
    baseline: float | str
    outcome: ProbeOutcome

    def to_dict(self) -> dict[str, Any]:
        """The session document's entry: the keys it has always had (bitwise, divergence, environment_notes,
        ...), and the whole verification."""
        o = self.outcome
        d = o.verification.divergence
        return {"phase": self.phase, "window": list(self.window), "overrides": self.overrides.to_dict(),
                "prevented": self.prevented, "spike_at": self.spike_at, "peak": self.peak, "baseline": self.baseline,
                "id": o.id, "ran": o.ran, "seconds": o.seconds, "bitwise": o.verification.bitwise,
                "divergence": None if d is None else d.to_dict(), "verification": o.verification.to_dict(),
                "environment_notes": list(o.environment), "node": o.node,
                **({"retried_after": o.retried_after} if o.retried_after else {}),
                **({"started_afresh": o.started_afresh} if o.started_afresh else {})}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Probe:
        if "verification" in d:
            verification = Verification.from_dict(d["verification"])
        else:   # a session of an earlier version: the scalars' verdict only
            div = d.get("divergence")
            verification = Verification(steps=list(d["window"]), bitwise=bool(d["bitwise"]),
                                        divergence=Divergence.from_dict(div) if div else None,
                                        note="verified by an earlier version of replay, on its scalars")
        outcome = ProbeOutcome(id=d["id"], ran=bool(d["ran"]), seconds=float(d["seconds"]), verification=verification,
                               environment=list(d.get("environment_notes", [])), node=d.get("node", ""),
                               retried_after=d.get("retried_after"), started_afresh=d.get("started_afresh"))
        return cls(phase=d["phase"], window=list(d["window"]), overrides=Overrides.from_dict(d["overrides"]),
                   prevented=bool(d["prevented"]), spike_at=d.get("spike_at"), peak=d.get("peak", "nan"),
                   baseline=d.get("baseline", "nan"), outcome=outcome)


@dataclass
class Session:
    id: str
    params: dict[str, Any]               # spike, by, fix, horizon, threshold, lookback
    rule: str
    created: float
    probes: dict[str, Probe] = field(default_factory=dict)            # by replay id
    phases: Phases = field(default_factory=Phases)                    # each phase's result
    runs: list[dict[str, Any]] = field(default_factory=list)          # every invocation: time, seconds, probes
    status: str = "running"              # running, complete or failed
    error: str | None = None
    verdict: Verdict | None = None

    def to_dict(self) -> dict[str, Any]:
        plain = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                 if f.name not in ("probes", "phases", "verdict")}
        return {**plain, "probes": {k: p.to_dict() for k, p in self.probes.items()}, "phases": self.phases.to_dict(),
                "verdict": self.verdict.to_dict() if self.verdict else None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Session:
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in d.items() if k in known}
        fields["probes"] = {k: Probe.from_dict(p) for k, p in (d.get("probes") or {}).items()}
        fields["phases"] = Phases.from_dict(d.get("phases") or {})
        fields["verdict"] = Verdict.from_dict(d["verdict"]) if d.get("verdict") else None
        return cls(**fields)
