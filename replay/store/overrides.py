"""What a replay changes, as a value: the counterfactual overrides a replay's manifest holds
(`ReplaySpec.overrides`), written by the replayer (replayer/overrides.py parses and checks them against the
record) and applied in the training process by recorder/overrides.py.

The scope is the whole model, or `layers`, or `heads` of those layers, or explicit (layer, head) `units`.
`attention` swaps the backend in scope; `fix` (the safe-softmax fix, with beta) and `hp_delta` switch options
on the flash backends there. `lr_scale` multiplies the learning rate: of every parameter group for the whole
model, or, in a scope, of that scope's updates. `precision` replaces the run's precision; `skip` lists steps
whose batches are not trained on; `drop` lists (step, sample id) pairs left out of their step's loss.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Overrides:
    attention: str | None = None
    layers: list[int] | None = None
    heads: list[int] | None = None
    precision: str | None = None
    fix: float | None = None          # safe-softmax beta
    hp_delta: bool = False
    skip: list[int] = field(default_factory=list)
    lr_scale: float | None = None
    units: list[list[int]] | None = None      # explicit [layer, head] pairs (instead of layers x heads)
    drop: list[list[int]] = field(default_factory=list)   # [step, sample id] pairs

    @property
    def scoped(self) -> bool:
        return self.layers is not None or self.heads is not None or self.units is not None

    @property
    def touches_attention(self) -> bool:
        return bool(self.attention or self.fix is not None or self.hp_delta)

    def scope(self, n_layer: int, n_head: int) -> list[tuple[int, int]]:
        if self.units is not None:
            return [(layer, head) for layer, head in self.units]
        return [(layer, head) for layer in (self.layers if self.layers is not None else range(n_layer))
                for head in (self.heads if self.heads is not None else range(n_head))]

    def lr_scope(self, n_layer: int, n_head: int) -> dict[str, Any] | None:
        """A scoped lr_scale, for the built-in trainer (recorder/overrides.py ScopedUpdate): the scale, and whole
        layers or (layer, head) units."""
        if self.lr_scale is None or not self.scoped:
            return None
        if self.units is None and self.heads is None and self.layers is not None:
            return {"scale": self.lr_scale, "layers": list(self.layers)}
        return {"scale": self.lr_scale, "units": [list(u) for u in self.scope(n_layer, n_head)]}

    def with_scope(self, layers: list[int] | None = None, units: list[list[int]] | None = None) -> Overrides:
        return dataclasses.replace(self, layers=layers, heads=None, units=units)

    def as_args(self) -> str:
        """The `replay run` options that give these overrides."""
        args = []
        if self.attention:
            args.append(f"--attention {self.attention}")
        if self.units is not None:
            args.append("--heads " + ",".join(f"{layer}.{head}" for layer, head in self.units))
        if self.layers is not None:
            args.append(f"--layers {format_steps(self.layers)}")
        if self.heads is not None:
            args.append(f"--heads {format_steps(self.heads)}")
        if self.precision:
            args.append(f"--precision {self.precision}")
        if self.fix is not None:
            args.append(f"--fix safe-softmax:{_number(self.fix)}")
        if self.hp_delta:
            args.append("--hp-delta")
        if self.lr_scale is not None:
            args.append(f"--lr-scale {_number(self.lr_scale)}")
        if self.skip:
            args.append(f"--skip {format_steps(self.skip)}")
        if self.drop:
            args.append("--drop " + ",".join(f"{step}:{sample}" for step, sample in self.drop))
        return " ".join(args)

    def to_dict(self) -> dict[str, Any]:
        """As the manifest stores it: only what is set."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v not in (None, False, [])}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Overrides:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:   # a newer replay's (store/run_store.py names the store)
            raise ValueError(f"field 'overrides.{unknown[0]}', unknown to this version")
        return cls(**d)

    def tag(self) -> str:
        """A short stable id of these overrides, for replay names."""
        return hashlib.sha1(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:8]


def _number(x: float) -> str:
    """A float as an option gives it back exactly: short where that is exact."""
    return f"{x:g}" if float(f"{x:g}") == x else repr(x)


def format_steps(steps: list[int]) -> str:
    """[5, 8, 9, 10] -> `5,8-10` (what parse_steps reads)."""
    runs: list[list[int]] = []
    for s in sorted(steps):
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


@dataclass(frozen=True)
class AttentionPath:
    """Which backend computed which heads of a layer in a replay's window, and how many calls each head made
    (rank 0's): the attention path the replay really took."""

    layer: int
    backend: str
    heads: list[int]
    calls: int

    def describe(self) -> str:
        return f"layer {self.layer} heads {format_steps(self.heads)}: {self.backend} ({self.calls} calls each)"


@dataclass(frozen=True)
class Reached:
    """What a replay's overrides reached, counted where each was applied and summed over the ranks: per step
    of the window (`steps`), one count per counter (`counters`: "attention L.H BACKEND", "optimizer steps at
    the scaled learning rate", "parameter slices with a scaled update", "samples left out", "forwards under
    autocast P"). `refused`: why the replay was stopped (an override that reached nothing)."""

    counters: list[str]
    steps: list[int] = field(default_factory=list)
    counts: list[list[int]] = field(default_factory=list)
    path: list[AttentionPath] = field(default_factory=list)
    refused: str | None = None

    def totals(self) -> dict[str, int]:
        return {name: sum(row[i] for row in self.counts) for i, name in enumerate(self.counters)}

    def describe(self) -> str:
        """What was reached, in a line: attention calls summed per backend, the other counters as they are."""
        attention: dict[str, list[tuple[str, int]]] = {}
        rest = []
        for name, n in self.totals().items():
            if name.startswith("attention "):
                _, unit, backend = name.split(" ", 2)
                attention.setdefault(backend, []).append((unit, n))
            else:
                rest.append(f"{n} {name}")
        parts = [f"{sum(n for _, n in units)} attention calls on {backend} over {len(units)} head(s) "
                 f"({', '.join(u for u, _ in units[:4])}{', ...' if len(units) > 4 else ''})"
                 for backend, units in attention.items()]
        steps = f" in steps {self.steps[0]}..{self.steps[-1]}" if self.steps else ""
        return "; ".join(parts + rest) + f"{steps}, summed over the ranks"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Reached:
        return cls(counters=list(d["counters"]), steps=list(d.get("steps", [])), counts=list(d.get("counts", [])),
                   path=[AttentionPath(**p) for p in d.get("path", [])], refused=d.get("refused"))
