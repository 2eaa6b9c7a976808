"""A replay's overrides, applied in the training process: the one place where what a replay changes (the value:
store/overrides.py, parsed and checked by replayer/overrides.py) meets the run, and where what each change
reached is counted.

Read from the replay's store (`ReplayOverrides.read`); the replaying loop (recorder/replaying.py) calls
`begin` when the window begins (the attention plan goes into the model with a counter of its calls, the
learning rates are scaled), `autocast_precision` for every `loop.autocast()`, `skips` at every step, and at
every step's end `counted` (what each override replaced in it: the recorder sums it over the ranks) and
`check` on those sums. The built-in trainer asks it for what only it can apply: the samples a step leaves
out (`kept`, `loss_weight`) and a learning rate scaled on part of the model (`optimizer_step`). `close`
takes back what `begin` put in.

An override that reached nothing stops the replay: in the window's first step an attention override that
no attention call ran, a learning rate scale that no optimizer step used, a precision no forward ran under,
or at a step with dropped samples none left out. `check` raises `UnreachedOverride` (the launcher removes
the replay and says why in one line: replayer/replays.py).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from replay.config import RunConfig
from replay.errors import UsageError
from replay.kernels.plan import AttentionPlan
from replay.kernels.reach import AttentionReach
from replay.store.manifest import ReplaySpec
from replay.store.overrides import AttentionPath, Overrides, Reached


class UnreachedOverride(UsageError):
    """An override of the replay reached nothing it could change: the replay stops and is not kept (rank 0
    writes why into its manifest, which the launcher reads: replayer/replays.py)."""

    said_by_launcher = True


LR_STEPS = "optimizer steps at the scaled learning rate"
SCOPED = "parameter slices with a scaled update"
DROPPED = "samples left out"


@dataclass
class ReplayOverrides:
    start: int                              # the window's first step
    plan: AttentionPlan | None = None       # None: the recorded attention
    changed: dict[tuple[int, int], str] = field(default_factory=dict)   # (layer, head) -> the plan's backend there
    precision: str | None = None            # None: the recorded precision
    lr_scale: float | None = None           # every rate's scale
    lr_scope: dict[str, Any] | None = None  # a scale of part of the model's updates (the built-in trainer's)
    skip: frozenset[int] = frozenset()      # steps left out
    drop: dict[int, frozenset[int]] = field(default_factory=dict)   # step -> sample ids left out of its loss
    given: Overrides = field(default_factory=Overrides)   # as the user gave them, for the messages
    active: bool = False                    # the window has begun
    reach: AttentionReach = field(default_factory=AttentionReach)
    _first: int | None = None               # the first step this process ran inside the window
    _counts: Counter[str] = field(default_factory=Counter)          # this step's, but attention's
    _calls: Counter[tuple[int, int, str]] = field(default_factory=Counter)   # every attention call so far
    _scoped: ScopedUpdate | None = None
    _exits: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, repr=False)

    @classmethod
    def read(cls, spec: ReplaySpec, replay: RunConfig, recorded: RunConfig) -> ReplayOverrides:
        """From the replay's spec and config, against the recorded config."""
        plan, changed = None, {}
        if replay.model.attention != recorded.model.attention:
            plan, was = AttentionPlan.parse(replay.model.attention), AttentionPlan.parse(recorded.model.attention)
            changed = {(layer, head): plan.backend_for(layer, head).canonical()
                       for layer in range(replay.model.n_layer) for head in range(replay.model.n_head)
                       if plan.backend_for(layer, head) != was.backend_for(layer, head)}
        drop: dict[int, set[int]] = {}
        for step, sample in spec.drop:
            drop.setdefault(step, set()).add(sample)
        return cls(start=spec.start, plan=plan, changed=changed,
                   precision=replay.precision if replay.precision != recorded.precision else None,
                   lr_scale=None if spec.lr_scope else spec.overrides.lr_scale, lr_scope=spec.lr_scope,
                   skip=frozenset(spec.skip), drop={s: frozenset(ids) for s, ids in drop.items()},
                   given=spec.overrides)

    # -- what a step counts, and the check ------------------------------------------------------------

    @property
    def counters(self) -> list[str]:
        """What `counted` counts, in its order (the same on every rank)."""
        names = [f"attention {layer}.{head} {backend}" for (layer, head), backend in sorted(self.changed.items())]
        names += [LR_STEPS] if self.lr_scale is not None else []
        names += [SCOPED] if self.lr_scope is not None else []
        names += [DROPPED] if self.drop else []
        names += [f"forwards under autocast {self.precision}"] if self.precision else []
        return names

    def counted(self) -> np.ndarray:
        """What this process's overrides replaced in the step that ends, one count per counter; then anew."""
        calls = self.reach.take()
        self._calls.update(calls)
        attention = [calls[(layer, head, backend)] for (layer, head), backend in sorted(self.changed.items())]
        rest = [self._counts[name] for name in self.counters[len(attention):]]
        self._counts.clear()
        return np.asarray(attention + rest, dtype=np.int64)

    def check(self, step: int, totals: np.ndarray) -> None:
        """Refuse a step in which an override reached nothing (`totals`: `counted` summed over the ranks): in
        the first step this replay runs inside its window, every override; at a step with dropped samples, the
        drop."""
        if not self.active:
            return
        reached = dict(zip(self.counters, totals.tolist(), strict=True))
        first = step == self._first
        missing = [name for name, n in reached.items() if n == 0 and (first or name == DROPPED)
                   and (name != DROPPED or step in self.drop)]
        if missing:
            raise UnreachedOverride(self._unreached(step, missing))

    def _unreached(self, step: int, missing: list[str]) -> str:
        args = self.given.as_args()
        where = f"in step {step}" + (", the window's first" if step == self._first else "")
        if any(name.startswith("attention ") for name in missing):
            layers = sorted({int(name.split()[1].split(".")[0]) for name in missing if name.startswith("attention ")})
            return (f"`{args}` reached no attention call of layer(s) {', '.join(map(str, layers))} {where}: "
                    f"{self.reach.unreached_hint()}; nothing of the replay is kept")
        if LR_STEPS in missing:
            return (f"`{args}` reached no optimizer step {where}: the optimizer given to the loop never stepped; "
                    "pass the optimizer the script steps; nothing of the replay is kept")
        if DROPPED in missing:
            return (f"`{args}` left no sample out {where}: none of its samples was trained on there; nothing of "
                    "the replay is kept")
        return f"`{args}` reached nothing ({', '.join(missing)}) {where}; nothing of the replay is kept"

    def reached(self, steps: list[int], counts: list[list[int]], refused: str | None = None) -> Reached:
        """What the replay's overrides reached, for its manifest: the counts per step (summed over the ranks)
        and the attention path this process's calls took."""
        return Reached(counters=self.counters, steps=steps, counts=counts, path=_path(self._calls),
                       refused=refused)

    # -- the hooks -----------------------------------------------------------------------------------

    def skips(self, step: int) -> bool:
        return step in self.skip

    def begin(self, step: int, optimizer: Any, scheduler: Any,
              apply_attention: Callable[[AttentionPlan, AttentionReach], Any]) -> None:
        """The window begins at `step` (its first step, or the first a resumed replay runs inside it)."""
        self.active, self._first = True, step
        if self.plan is not None:
            applied = apply_attention(self.plan, self.reach)
            if applied is not None:
                self._exits.enter_context(applied)
        if self.lr_scale is None:
            return
        optimizer = torch_optimizer(optimizer)
        handle = optimizer.register_step_post_hook(lambda *_: self._counts.update([LR_STEPS]))
        self._exits.callback(handle.remove)
        if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):   # scale what it scales, once (a replay
            if step == self.start:                 # resumed inside its window restored scaled ones)
                scheduler.base_lrs = [lr * self.lr_scale for lr in scheduler.base_lrs]
                for group in optimizer.param_groups:
                    group["lr"] *= self.lr_scale
        else:   # rates the script (or a scheduler from other state, as OneCycleLR) sets: scaled at each step
            self._exits.enter_context(scaled_lr(optimizer, self.lr_scale))

    def autocast_precision(self, recorded: str) -> str:
        if self.active and self.precision:
            self._counts[f"forwards under autocast {self.precision}"] += 1
            return self.precision
        return recorded

    def check_step(self, autocast_used: bool) -> None:
        if self.active and self.precision and not autocast_used:
            raise UsageError("--precision: this script does not run its forward under loop.autocast(...), so a "
                             "replay cannot change its precision: run the forward under loop.autocast(device_type), or "
                             "leave --precision out")

    # -- what only the built-in trainer applies --------------------------------------------------------

    def kept(self, step: int, micro_ids: np.ndarray) -> torch.Tensor | None:
        """Which samples of a micro-batch of `step` stay in the loss (None: all of them, the recorded
        computation). A step with left-out samples trains on the mean loss over its kept samples: each
        micro-batch's loss counts the left-out ones as 0 and is scaled by `loss_weight`, so the usual
        averaging over micro-batches and ranks gives exactly that mean (and its gradient)."""
        dropped = self.drop.get(step) if self.active else None
        if not dropped:
            return None
        keep = ~np.isin(micro_ids, list(dropped))
        self._counts[DROPPED] += int((~keep).sum())
        return None if keep.all() else torch.from_numpy(keep)

    def loss_weight(self, step: int, step_ids: np.ndarray) -> float:
        """(samples of the step, all ranks) / (kept samples): the scale of a step with left-out samples."""
        dropped = self.drop.get(step) if self.active else None
        return step_ids.size / int((~np.isin(step_ids, list(dropped))).sum()) if dropped else 1.0

    def optimizer_step(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        """The step's update: scaled on part of the model from the window on, when the replay says so."""
        if self.active and self.lr_scope is not None:
            if self._scoped is None:
                self._scoped = ScopedUpdate(model, self.lr_scope)
            self._counts[SCOPED] += self._scoped.step(optimizer)
        else:
            optimizer.step()

    def close(self) -> None:
        self._exits.close()


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer a wrapper holds (accelerate's AcceleratedOptimizer, DeepSpeed's), or itself."""
    inner = optimizer
    while getattr(inner, "optimizer", inner) is not inner:   # AcceleratedOptimizer is an Optimizer without its hooks
        inner = inner.optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        raise UsageError(f"--lr-scale: the loop's optimizer is a {type(optimizer).__name__}, not a torch optimizer "
                         "(nor one wrapping it as .optimizer); pass the torch optimizer to Loop(...)")
    return inner


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


class ScopedUpdate:
    """Scale the optimizer's update of part of a GPT-2 (the built-in trainer's model) by `scale`:
    p <- p_old + scale * (p_new - p_old).

    For AdamW this is the update the scaled learning rate would make (weight decay included). A layer
    scope covers every parameter of that block; a (layer, head) unit covers the head's columns of
    W_Q, W_K, W_V (and their biases) and its rows of W_O (GPT-2's Conv1D weights are [in, out])."""

    def __init__(self, model: torch.nn.Module, scope: dict[str, Any]):
        module: Any = getattr(model, "module", model)
        assert hasattr(module, "transformer"), "a transformers GPT-2 (train/model.py)"
        cfg, blocks = module.config, module.transformer.h
        d = cfg.n_embd // cfg.n_head
        self.scale = float(scope["scale"])
        self.slices: list[tuple[torch.Tensor, tuple]] = []   # (parameter, index)
        for layer in scope.get("layers", []):
            self.slices += [(p, (...,)) for p in blocks[layer].parameters()]
        for layer, head in scope.get("units", []):
            attn = blocks[layer].attn
            for part in range(3):   # q, k, v
                cols = slice(part * cfg.n_embd + head * d, part * cfg.n_embd + (head + 1) * d)
                self.slices += [(attn.c_attn.weight, (slice(None), cols)), (attn.c_attn.bias, (cols,))]
            self.slices.append((attn.c_proj.weight, (slice(head * d, (head + 1) * d), slice(None))))

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> int:
        """The optimizer's step, its update scaled on the scope; returns the slices scaled."""
        before = [p[index].clone() for p, index in self.slices]
        optimizer.step()
        for (p, index), old in zip(self.slices, before, strict=True):
            p[index] = old + self.scale * (p[index] - old)
        return len(self.slices)


def _path(calls: Counter[tuple[int, int, str]]) -> list[AttentionPath]:
    """Every (layer, backend, calls per head) with its heads, from every attention call counted."""
    groups: dict[tuple[int, str, int], list[int]] = {}
    for (layer, head, backend), n in sorted(calls.items()):
        groups.setdefault((layer, backend, n), []).append(head)
    return [AttentionPath(layer, backend, heads, n) for (layer, backend, n), heads in sorted(groups.items())]
