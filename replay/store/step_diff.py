"""What `replay diff` answers (replay/replayer/diff.py computes it): where two sides of one step first part,
how far each differing tensor is from the other, and per attention head the deviations and Qiu & Yao's signals.
Plain values, without torch: the CLI and the views read them."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Deviation:
    """How far B's tensor is from A's."""

    max_abs: float
    mean_abs: float
    relative: float      # max_abs over A's largest magnitude
    ulps: float          # max_abs in units in the last place of A's largest magnitude, in its format


@dataclass(frozen=True)
class Difference:
    """A tensor that differs between the sides, where it was produced."""

    order: int           # its place in side B's execution order
    phase: str           # forward, backward or gradient
    where: str           # a module path, `attention L` for layer L's attention call, or a parameter's name
    what: str            # output, grad of output, O, dO, dQ, dK, dV, grad
    shape: list[int]
    dtype: str
    deviation: Deviation | None             # None against a trace: its tensors are not kept
    stats: dict[str, Any] | None = None     # against a trace: {"theirs": ..., "ours": ...} statistics


@dataclass(frozen=True)
class HeadDiff:
    """One attention head's deviations (max absolute) over the step's calls, and delta's error sign bias."""

    layer: int
    head: int
    o: float
    do: float
    dq: float
    dk: float
    dv: float
    delta: float
    delta_sign_bias: float   # mean sign of delta's error over the rows where it is not 0 (-1..1)
    wq_alignment: float      # |sum of the tokens' rank-1 terms of W_Q's gradient error| / sum of their norms
    s: float = math.nan      # the scores S = Q K^T * scale; NaN where a side's backend keeps them to itself
    p: float = math.nan      # the probabilities P, likewise (kernels/internals.py)


@dataclass
class StepDiff:
    """`replay diff`'s answer."""

    store: str
    step: int
    overrides: dict[str, Any]
    compared: int                                  # tensors compared
    first: Difference | None                       # None: the sides are the same bit for bit
    differences: list[Difference] = field(default_factory=list)
    heads: list[HeadDiff] = field(default_factory=list)
    only_in_a: list[str] = field(default_factory=list)   # tensors only side A produced (attention weights)
    only_in_b: list[str] = field(default_factory=list)   # ... and only side B
    against: dict[str, Any] | None = None    # side A was a trace: its name, machine and overrides
    other: str | None = None                 # side B was another run (or replay), as it ran
    changes: dict[str, list[Any]] | None = None   # ... and its config's differences from A's: key -> [A's, B's]
    rank: int | None = 0                     # whose micro-batches and RNG states the step ran (None: every rank's)
    notes: list[str] = field(default_factory=list)   # what a side's replay said against the record (a script's run)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def whose(self) -> str:
        """Whose micro-batches the step ran, in words."""
        return ("every rank's micro-batches, their gradients averaged" if self.rank is None else
                f"rank {self.rank}'s micro-batches")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepDiff:
        def difference(x: dict[str, Any]) -> Difference:
            return Difference(**{**x, "deviation": Deviation(**x["deviation"]) if x.get("deviation") else None})

        return cls(**{**d, "first": difference(d["first"]) if d.get("first") else None,
                      "differences": [difference(x) for x in d.get("differences", [])],
                      "heads": [HeadDiff(**h) for h in d.get("heads", [])]})
