"""A replay's overrides, as the loop applies them: what changes from the window's first step on.

Read from the replay's store (`ReplayOverrides.read`); the replaying loop (recorder/replaying.py) calls
three hooks: `begin` when the window begins (the attention plan goes into the model, the learning rates are
scaled), `precision` for every `loop.autocast()`, and `skips` at every step. `close` takes back what
`begin` put in. (The CLI's overrides, parsed and checked against the record, are replayer/overrides.py.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from replay.config import RunConfig
from replay.errors import UsageError
from replay.kernels.plan import AttentionPlan
from replay.store.manifest import ReplaySpec


@dataclass
class ReplayOverrides:
    start: int                              # the window's first step
    plan: AttentionPlan | None = None       # None: the recorded attention
    precision: str | None = None            # None: the recorded precision
    lr_scale: float | None = None           # every rate's scale (a scoped one is the built-in trainer's to apply)
    skip: frozenset[int] = frozenset()      # steps left out
    active: bool = False                    # the window has begun
    _exits: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, repr=False)

    @classmethod
    def read(cls, spec: ReplaySpec, replay: RunConfig, recorded: RunConfig) -> ReplayOverrides:
        """From the replay's spec and config, against the recorded config."""
        changed = replay.model.attention != recorded.model.attention
        return cls(start=spec.start, plan=AttentionPlan.parse(replay.model.attention) if changed else None,
                   precision=replay.precision if replay.precision != recorded.precision else None,
                   lr_scale=None if spec.lr_scope else spec.overrides.get("lr_scale"), skip=frozenset(spec.skip))

    def skips(self, step: int) -> bool:
        return step in self.skip

    def begin(self, step: int, optimizer: torch.optim.Optimizer, scheduler: Any,
              apply_attention: Callable[[AttentionPlan], Any]) -> None:
        """The window begins at `step` (its first step, or the first a resumed replay runs inside it)."""
        self.active = True
        if self.plan is not None:
            applied = apply_attention(self.plan)
            if applied is not None:
                self._exits.enter_context(applied)
        if self.lr_scale is None:
            return
        if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):   # scale what it scales, once (a replay
            if step == self.start:                 # resumed inside its window restored scaled ones)
                scheduler.base_lrs = [lr * self.lr_scale for lr in scheduler.base_lrs]
                for group in optimizer.param_groups:
                    group["lr"] *= self.lr_scale
        else:   # rates the script (or a scheduler from other state, as OneCycleLR) sets: scaled at each step
            self._exits.enter_context(scaled_lr(optimizer, self.lr_scale))

    def autocast_precision(self, recorded: str) -> str:
        return self.precision if self.active and self.precision else recorded

    def check_step(self, autocast_used: bool) -> None:
        if self.active and self.precision and not autocast_used:
            raise UsageError("--precision: this script does not run its forward under loop.autocast(...), so a "
                             "replay cannot change its precision: run the forward under loop.autocast(device_type), or "
                             "leave --precision out")

    def close(self) -> None:
        self._exits.close()


@contextlib.contextmanager
def scaled_lr(optimizer: torch.optim.Optimizer, scale: float) -> Iterator[None]:
    """Every optimizer step with its learning rates times `scale` (set back after the step, so a schedule
    that assigns them keeps working)."""
    saved: list[float] = []

    def before(*_: Any) -> None:
        saved[:] = [g["lr"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["lr"] = g["lr"] * scale

    def after(*_: Any) -> None:
        for g, lr in zip(optimizer.param_groups, saved, strict=True):
            g["lr"] = lr

    handles = [optimizer.register_step_pre_hook(before), optimizer.register_step_post_hook(after)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
