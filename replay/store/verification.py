"""What a replay's verification found, typed: whether every replayed step equals the record bit for bit, and
where it first did not. Kept in the replay's manifest (`ReplaySpec.verification`), read by `replay run`,
bisect, `replay info` and the report.

A step is compared in the order it ran: its losses (the forward), its gradient norm (the backward), its
learning rate, then the state after its update (every rank's digest per tensor of its model and optimizer
state: recorder/digest.py). A verification is at the level of the state when both runs hold digests of the
same kind for every compared step; a record made before digests existed is compared on its scalars only,
and says so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

STATE, SCALARS = "state", "scalars"
SHOWN = 3   # tensor names a one-line description shows
_WORDS = {"loss": "losses per rank", "grad_norm": "gradient norm", "lr": "learning rate"}   # the scalars, in words


@dataclass(frozen=True)
class ScalarChange:
    quantity: str          # loss, rank_loss[r], grad_norm or lr
    recorded: float
    replayed: float

    def describe(self) -> str:
        diff = self.replayed - self.recorded
        rel = abs(diff) / abs(self.recorded) if self.recorded else float("inf")
        return (f"{self.quantity} {self.replayed!r} replayed vs {self.recorded!r} recorded (difference {diff:+.3e}, "
                f"relative {rel:.2e})")


@dataclass(frozen=True)
class StateChange:
    """The tensors whose digest differs after a step's update, on which ranks, out of how many per rank."""

    tensors: list[str]
    ranks: list[int]
    of: int

    def describe(self) -> str:
        shown = ", ".join(self.tensors[:SHOWN]) + (f" and {len(self.tensors) - SHOWN} more"
                                                   if len(self.tensors) > SHOWN else "")
        ranks = ", ".join(map(str, self.ranks))
        return (f"the state after the update: {len(self.tensors)} of {self.of} tensors differ on rank"
                f"{'s' if len(self.ranks) > 1 else ''} {ranks} ({shown})")


@dataclass(frozen=True)
class Divergence:
    step: int
    scalars: list[ScalarChange] = field(default_factory=list)   # in the order they were computed
    state: StateChange | None = None

    @property
    def first(self) -> str:
        """What differed first in the step's execution: a scalar's name, or "state"."""
        return self.scalars[0].quantity if self.scalars else "state"

    def describe(self) -> str:
        parts = [c.describe() for c in self.scalars] + ([self.state.describe()] if self.state else [])
        first, rest = parts[0], parts[1:]
        same = [] if self.scalars else ["its losses, gradient norm and learning rate (where recorded) equal the "
                                        "record's"]
        return f"first divergence at step {self.step}: " + "; then ".join([first, *rest]) + "".join(
            f"; {s}" for s in same)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Divergence:
        if "quantity" in d:   # a verification written before state digests: one scalar
            return cls(step=d["step"], scalars=[ScalarChange(d["quantity"], d["recorded"], d["replayed"])])
        state = d.get("state")
        return cls(step=d["step"], scalars=[ScalarChange(**c) for c in d.get("scalars", [])],
                   state=StateChange(**state) if state else None)


@dataclass(frozen=True)
class Verification:
    steps: list[int]                      # [first, last] step compared (empty: none)
    bitwise: bool
    level: str = SCALARS                  # STATE: digests compared at every step; SCALARS: losses, norms, rates
    divergence: Divergence | None = None
    tensors: int = 0                      # tensors digested per rank (at the level of the state)
    note: str | None = None               # why the state was not compared everywhere
    environment: list[str] = field(default_factory=list)   # what differed between the two runs' environments
    compared: list[str] = field(default_factory=lambda: list(_WORDS))   # the scalars the record holds (not NaN)

    def describe(self) -> str:
        """The verdict in one line; a divergence after what differed in the environment, its likeliest cause."""
        if self.divergence is not None:
            where = (f"the replay ran in another environment than the record ({'; '.join(self.environment)}): "
                     if self.environment else "")
            return where + self.divergence.describe() + (f" ({self.note})" if self.note else "")
        words = [_WORDS[name] for name in self.compared if name in _WORDS]
        if self.level == STATE:
            return (f"every replayed step equals the record bit for bit: {', '.join(words)} and the state after every "
                    f"update ({self.tensors} tensors per rank)").replace(": and", ":")
        listed = " and ".join([", ".join(words[:-1]), words[-1]] if len(words) > 1 else words)
        return (f"every replayed step's {listed} equal the record's bit for bit; the state was not compared "
                f"({self.note})")

    def to_dict(self) -> dict[str, Any]:
        return {"steps": list(self.steps), "bitwise": self.bitwise, "level": self.level,
                "divergence": None if self.divergence is None else self.divergence.to_dict(),
                "tensors": self.tensors, "note": self.note, "environment": list(self.environment),
                "compared": list(self.compared)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Verification:
        div = d.get("divergence")
        return cls(steps=list(d.get("steps", [])), bitwise=bool(d["bitwise"]), level=d.get("level", SCALARS),
                   divergence=Divergence.from_dict(div) if div else None, tensors=int(d.get("tensors", 0)),
                   note=d.get("note") if "level" in d else "verified by an earlier version of replay, on its scalars",
                   environment=list(d.get("environment", [])), compared=list(d.get("compared", _WORDS)))
