"""A replay's overrides (the value: store/overrides.py) parsed from the command line, checked against the
recorded run and folded into the replay's config; they are applied in the training process by
recorder/overrides.py.

Attention overrides rewrite the recorded attention plan (replay.kernels.plan) in their scope: `attention`
swaps the backend; `fix` and `hp_delta` need an emulated or Triton flash backend (`eager` and `sdpa` have
no such knobs). A skipped step's optimizer step does not happen, but the LR schedule moves on, so later
steps keep their recorded learning rates.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from replay.config import PRECISIONS, RunConfig
from replay.errors import UsageError
from replay.kernels.options import SafeSoftmaxFix
from replay.kernels.plan import AttentionPlan, BackendSpec, check_numerics
from replay.store.capabilities import Capabilities
from replay.store.overrides import Overrides


def parse_fix(text: str) -> float:
    """`safe-softmax` or `safe-softmax:BETA` -> beta (7 by default: the paper's stabilising value)."""
    name, _, beta = text.partition(":")
    if name != "safe-softmax":
        raise UsageError(f"unknown fix {text!r}; the fix is safe-softmax[:BETA]")
    try:
        return float(beta) if beta else 7.0
    except ValueError:
        raise UsageError(f"--fix beta must be a number, got {beta!r}") from None


def parse_heads(text: str) -> tuple[list[int] | None, list[list[int]] | None]:
    """`--heads 7,8` (heads of --layers) -> (heads, None); `--heads 1.0,0.3` (layer.head) -> (None, units)."""
    if "." not in text:
        return parse_steps(text, "--heads"), None
    units = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        layer, _, head = part.partition(".")
        if not (layer.isdigit() and head.isdigit()):
            raise UsageError("--heads expects heads like 7,8 (with --layers) or layer.head pairs like 1.0,0.3, "
                             f"got {text!r}")
        units.append([int(layer), int(head)])
    return None, sorted(units)


def parse_drop(text: str) -> list[list[int]]:
    """`261:3,261:5` -> [[261, 3], [261, 5]] (step:sample id)."""
    pairs = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        step, _, sample = part.partition(":")
        if not (step.isdigit() and sample.isdigit()):
            raise UsageError(f"--drop expects step:sample pairs like 261:3,261:5 (sample ids as `replay batch` "
                             f"prints them), got {text!r}")
        pairs.append([int(step), int(sample)])
    return sorted(pairs)


def parse_steps(text: str, what: str = "--skip") -> list[int]:
    """`5,8-10` -> [5, 8, 9, 10]."""
    steps: set[int] = set()
    for part in (p.strip() for p in text.split(",") if p.strip()):
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise UsageError(f"{what} expects numbers and ranges like 5,8-10, got {text!r}") from None
        if last < first:
            raise UsageError(f"{what} range {part} runs backwards")
        steps.update(range(first, last + 1))
    return sorted(steps)


def apply(cfg: RunConfig, o: Overrides, window: tuple[int, int], caps: Capabilities) -> RunConfig:
    """The replay's config: the recorded one with the overrides folded in (validated against the model and
    against what the recorded run can do)."""
    cfg = RunConfig.from_dict(cfg.to_dict())
    scope = _scope(cfg, o, caps)
    if o.touches_attention:
        cfg.model.attention = _attention(cfg, o, scope, caps)
    if o.precision is not None:
        if o.precision not in PRECISIONS:
            raise UsageError(f"--precision must be one of {', '.join(PRECISIONS)}, got {o.precision!r}")
        if o.precision != cfg.precision and caps.precision_refusal:
            raise UsageError(caps.precision_refusal)
        cfg.precision = o.precision
    _check_steps(o, window, caps)
    if o.lr_scale is not None and not 0 < o.lr_scale < math.inf:
        raise UsageError(f"--lr-scale must be > 0 and finite, got {o.lr_scale}")
    return cfg


def _scope(cfg: RunConfig, o: Overrides, caps: Capabilities) -> list[tuple[int, int]]:
    """The (layer, head) pairs `--layers`/`--heads` select, checked against the model."""
    if o.heads is not None and o.layers is None:
        raise UsageError("--heads needs --layers: heads are numbered within a layer (or give layer.head pairs)")
    if o.units is not None and (o.layers is not None or o.heads is not None):
        raise UsageError("--heads layer.head pairs name their layers; drop --layers")
    if o.scoped and not (o.touches_attention or o.lr_scale is not None):
        raise UsageError("--layers/--heads select where an attention override or --lr-scale applies; "
                         "add --attention, --fix, --hp-delta or --lr-scale")
    if o.scoped and o.lr_scale is not None and caps.scoped_lr_refusal:
        raise UsageError(caps.scoped_lr_refusal)
    if o.touches_attention and cfg.model.n_layer == 0:
        raise UsageError("attention overrides need the model's attention modules, and none was found when this run "
                         "was recorded: record with Loop(..., attention='PATTERN') naming them")
    scope = o.scope(cfg.model.n_layer, cfg.model.n_head)
    for layer, head in scope:
        if not (0 <= layer < cfg.model.n_layer and 0 <= head < cfg.model.n_head):
            raise UsageError(f"layer {layer} head {head} is out of range: the model has layers "
                             f"0..{cfg.model.n_layer - 1} "
                             f"with heads 0..{cfg.model.n_head - 1}")
    return scope


def _attention(cfg: RunConfig, o: Overrides, scope: list[tuple[int, int]], caps: Capabilities) -> str:
    """The replay's attention plan: the recorded one with the override on `scope`, in canonical form."""
    try:
        plan = AttentionPlan.parse(cfg.model.attention)
    except UsageError:
        if caps.attention_refusal is None:
            raise
        raise UsageError(caps.attention_refusal) from None
    new = BackendSpec.parse(o.attention) if o.attention else None
    heads = dict(plan.heads)
    for layer, head in scope:
        spec = new or plan.backend_for(layer, head)
        if o.fix is not None or o.hp_delta:
            spec = _with_options(spec, o)
        heads[(layer, head)] = spec
    plan = _simplify(AttentionPlan(plan.default, dict(plan.layers), heads), cfg.model.n_layer, cfg.model.n_head)
    plan.validate(cfg.model.n_layer, cfg.model.n_head)
    if cfg.numerics:
        check_numerics(plan, cfg.model.n_layer, cfg.model.n_head)
    return plan.canonical()


def _check_steps(o: Overrides, window: tuple[int, int], caps: Capabilities) -> None:
    """Skipped steps and dropped samples lie in the window, each step in one of them, drops where they can be."""
    outside = [s for s in o.skip if not window[0] <= s <= window[1]]
    if outside:
        raise UsageError(f"--skip step {outside[0]} is outside the window {window[0]}..{window[1]}")
    outside = [s for s, _ in o.drop if not window[0] <= s <= window[1]]
    if outside:
        raise UsageError(f"--drop step {outside[0]} is outside the window {window[0]}..{window[1]}")
    if o.drop and caps.drop_refusal:
        raise UsageError(caps.drop_refusal)
    both = sorted({s for s, _ in o.drop} & set(o.skip))
    if both:
        raise UsageError(f"step {both[0]} is both skipped and has samples dropped; give it to one of --skip, --drop")


def _with_options(spec: BackendSpec, o: Overrides) -> BackendSpec:
    if spec.options is None:
        raise UsageError(f"--fix and --hp-delta change a flash backend, but these heads use {spec.name!r}; "
                         "add --attention fa2-emu (or reference-emu, triton-fa2)")
    opts = spec.options
    if o.fix is not None:
        opts = opts.with_(fix=SafeSoftmaxFix(beta=o.fix, tie_tol=opts.fix.tie_tol if opts.fix else 0.0))
    if o.hp_delta:
        opts = opts.with_(hp_delta=True)
    return dataclasses.replace(spec, options=opts)


def _simplify(plan: AttentionPlan, n_layer: int, n_head: int) -> AttentionPlan:
    """Per-head entries that cover a whole layer become a layer entry, and layer entries that cover the
    whole model the default, so a whole-model override reads as one backend."""
    layers, heads = dict(plan.layers), dict(plan.heads)
    for layer in range(n_layer):
        whole = _one(heads.get((layer, h)) for h in range(n_head))
        if whole is not None:
            layers[layer] = whole
            for h in range(n_head):
                heads.pop((layer, h))
    default = plan.default
    everywhere = _one(layers.get(layer) for layer in range(n_layer))
    if everywhere is not None and not heads:
        default, layers = everywhere, {}
    layers = {k: v for k, v in layers.items() if v != default}
    return AttentionPlan(default, layers, {k: v for k, v in heads.items() if v != layers.get(k[0], default)})


def _one(specs: Iterable[BackendSpec | None]) -> BackendSpec | None:
    """The backend all of `specs` name, if they are one and none is missing."""
    distinct = set(specs)
    return distinct.pop() if len(distinct) == 1 and None not in distinct else None
