"""Attention plans: which backend computes each head of each layer, parsed and checked without torch, so
that the processes launching a run or a replay read them before any rank has started.

A backend spec is `NAME[:OPTION,OPTION=VALUE,...]`:

    eager, sdpa                     transformers' own implementations (no options)
    baseline[:dtype=bf16]           materialised attention at one precision (replay.kernels.baseline)
    fa2-emu[:...]                   the FA2 emulation, CUDA FA2's rounding points
    reference-emu[:...]             the FA2 emulation, Qiu & Yao's reference-code rounding points
    triton-fa2[:...]                the Triton kernels (a GPU, or TRITON_INTERPRET=1 for a slow CPU run)

    options of the last three: fix=safe-softmax, beta=7, tie=exact|1e-3, br=128, bc=128, hp-delta, hp-pv,
    dtype=bf16|fp16|fp32 (compute precision; default: the model's activations), keys=decreasing (the
    forward visits the key tiles last to first, as CUDA FA2 does; fa2 placement only)

A plan gives every head of every layer a backend: `SPEC(;TARGET=SPEC)*` with TARGET `L` (layer L),
`L.H` (head H of layer L) or `L.H1-H2` (a range of heads); the most specific entry wins. Example:
`eager;1=fa2-emu;1.7-8=reference-emu:fix=safe-softmax` ("layer 1 uses fa2-emu, heads 7 and 8 of layer 1
use reference-emu with the fix, the rest eager").
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from replay.config import ModelConfig
from replay.errors import UsageError
from replay.kernels.options import AttentionOptions, SafeSoftmaxFix, check_precision

TRANSFORMERS_NAMES = ("eager", "sdpa")
EMULATED = {"fa2-emu": "fa2", "reference-emu": "reference", "triton-fa2": "fa2"}
NAMES = (*TRANSFORMERS_NAMES, "baseline", *EMULATED)
NUMERICS = ("fa2-emu", "reference-emu")   # the backends whose intermediates `--numerics` reads
_TARGET = re.compile(r"^(\d+)(?:\.(\d+)(?:-(\d+))?)?$")


@dataclass(frozen=True)
class BackendSpec:
    name: str
    options: AttentionOptions | None = None   # fa2-emu, reference-emu, triton-fa2
    dtype: str | None = None                  # baseline

    @classmethod
    def parse(cls, text: str) -> BackendSpec:
        name, _, rest = text.strip().partition(":")
        _load_plugins()
        if name in PLUGINS:
            if rest:
                raise UsageError(f"attention backend {name!r} (a plugin) takes no options (got {rest!r})")
            return cls(name)
        if name not in NAMES:
            raise UsageError(f"unknown attention backend {name!r}; choose one of {', '.join([*NAMES, *PLUGINS])}")
        opts = dict(_option(o, text) for o in rest.split(",") if o.strip()) if rest else {}
        if name in TRANSFORMERS_NAMES:
            if opts:
                raise UsageError(f"attention backend {name!r} takes no options (got {rest!r})")
            return cls(name)
        if name == "baseline":
            unknown = set(opts) - {"dtype"}
            if unknown:
                raise UsageError(f"baseline takes only dtype=..., not {', '.join(sorted(unknown))}")
            dtype = opts.get("dtype")
            if dtype is not None:
                check_precision(dtype, f" in {text!r}")
            return cls(name, dtype=dtype)
        return cls(name, options=_emulation_options(name, opts, text))

    def canonical(self) -> str:
        if self.name == "baseline":
            return f"baseline:dtype={self.dtype}" if self.dtype else "baseline"
        if self.options is None:
            return self.name
        o, default = self.options, AttentionOptions()
        parts = []
        if o.fix:
            parts += ["fix=safe-softmax", f"beta={o.fix.beta:g}"]
            parts += [f"tie={o.fix.tie_tol:g}"] if o.fix.tie_tol else []
        parts += [f"br={o.block_r}"] if o.block_r != default.block_r else []
        parts += [f"bc={o.block_c}"] if o.block_c != default.block_c else []
        parts += ["hp-delta"] if o.hp_delta else []
        parts += ["hp-pv"] if o.hp_pv else []
        parts += [f"dtype={o.dtype}"] if o.dtype else []
        parts += [f"keys={o.key_order}"] if o.key_order != default.key_order else []
        return self.name + (":" + ",".join(parts) if parts else "")

    def check_available(self) -> None:
        if self.name == "triton-fa2":
            # lazy: the launchers check plans without torch and triton (1.5 s)
            from replay.kernels.triton_fa2 import available

            ok, why = available()
            if not ok:
                raise UsageError(f"triton-fa2 cannot run here: {why}")


def _option(item: str, text: str) -> tuple[str, str | None]:
    key, sep, value = item.strip().partition("=")
    return key, (value if sep else None)


def _emulation_options(name: str, opts: dict[str, str | None], text: str) -> AttentionOptions:
    known = {"fix", "beta", "tie", "br", "bc", "hp-delta", "hp-pv", "dtype", "keys"}
    unknown = set(opts) - known
    if unknown:
        raise UsageError(f"unknown option {sorted(unknown)[0]!r} in {text!r}; known: {', '.join(sorted(known))}")
    if opts.get("fix") not in (None, "safe-softmax", "none"):
        raise UsageError(f"unknown fix {opts['fix']!r} in {text!r}; the fix is fix=safe-softmax")
    if ("beta" in opts or "tie" in opts) and opts.get("fix") != "safe-softmax":
        raise UsageError(f"beta and tie go with fix=safe-softmax in {text!r}")
    try:
        fix = None
        if opts.get("fix") == "safe-softmax":
            tie = opts.get("tie") or "exact"
            fix = SafeSoftmaxFix(beta=float(opts.get("beta") or 7.0), tie_tol=0.0 if tie == "exact" else float(tie))
        return AttentionOptions(
            placement=EMULATED[name], fix=fix,
            block_r=int(opts.get("br") or AttentionOptions.block_r),
            block_c=int(opts.get("bc") or AttentionOptions.block_c),
            hp_delta="hp-delta" in opts, hp_pv="hp-pv" in opts, dtype=opts.get("dtype"),
            key_order=opts.get("keys") or AttentionOptions.key_order)
    except ValueError as e:
        raise UsageError(f"bad option value in {text!r}: {e}") from None


@dataclass(frozen=True)
class AttentionPlan:
    default: BackendSpec
    layers: dict[int, BackendSpec] = field(default_factory=dict)
    heads: dict[tuple[int, int], BackendSpec] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> AttentionPlan:
        default, layers, heads = None, {}, {}
        for entry in (e.strip() for e in text.split(";")):
            if not entry:
                continue
            target, sep, spec = entry.partition("=")
            match = _TARGET.match(target.strip()) if sep else None
            if match is None:   # no target: the default for everything
                if default is not None:
                    raise UsageError(f"attention plan {text!r} has two defaults; target the others as L=... or L.H=...")
                default = BackendSpec.parse(entry)
                continue
            layer, h1, h2 = match.groups()
            if h2 is not None and int(h2) < int(h1):
                raise UsageError(f"attention plan entry {entry!r}: the head range {h1}-{h2} runs backwards; "
                                 f"write it {layer}.{h2}-{h1}")
            backend = BackendSpec.parse(spec)
            if h1 is None:
                layers[int(layer)] = backend
            else:
                for head in range(int(h1), int(h2 if h2 is not None else h1) + 1):
                    heads[(int(layer), head)] = backend
        return cls(default or BackendSpec("eager"), layers, heads)

    def canonical(self) -> str:
        entries = [self.default.canonical()]
        entries += [f"{layer}={b.canonical()}" for layer, b in sorted(self.layers.items())]
        entries += [f"{layer}.{head}={b.canonical()}" for (layer, head), b in sorted(self.heads.items())]
        return ";".join(entries)

    def backend_for(self, layer: int, head: int) -> BackendSpec:
        return self.heads.get((layer, head)) or self.layers.get(layer) or self.default

    @property
    def is_transformers_builtin(self) -> bool:
        return not self.layers and not self.heads and self.default.name in TRANSFORMERS_NAMES

    def validate(self, n_layer: int, n_head: int) -> None:
        for layer in self.layers:
            if not 0 <= layer < n_layer:
                raise UsageError(f"attention plan targets layer {layer}, but the model has layers 0..{n_layer - 1}")
        for layer, head in self.heads:
            if not 0 <= layer < n_layer or not 0 <= head < n_head:
                raise UsageError(f"attention plan targets layer {layer} head {head}, but the model has "
                                 f"layers 0..{n_layer - 1} with heads 0..{n_head - 1}")
        for backend in {self.default, *self.layers.values(), *self.heads.values()}:
            backend.check_available()


# Backends added by plugins: name -> a causal attention function (q, k, v, scaling) -> out, on [B, H, N, d].
PLUGINS: dict[str, Callable] = {}
_loaded: set[str] = set()


def register_backend(name: str, fn: Callable) -> None:
    """Add an attention backend that plans can name: `fn(q, k, v, scaling)` computes causal attention on
    [batch, heads, seq, head_dim] tensors; one that also takes a `dropout` argument (the probability,
    passed only when the model asks for attention dropout) can run under it. Modules listed in
    REPLAY_PLUGINS (comma-separated) are imported before the first plan is read, in every process of a
    command (its ranks inherit the variable), so a backend of your own can be recorded, replayed and
    bisected like the built-in ones."""
    if name in NAMES:
        raise UsageError(f"attention backend {name!r} exists already")
    PLUGINS[name] = fn


def plugin_env() -> dict[str, str]:
    """The plugin setting, for processes that do not inherit this one's environment (Ray workers)."""
    return {"REPLAY_PLUGINS": os.environ["REPLAY_PLUGINS"]} if os.environ.get("REPLAY_PLUGINS") else {}


def _load_plugins() -> None:
    for module in filter(None, (m.strip() for m in os.environ.get("REPLAY_PLUGINS", "").split(","))):
        if module in _loaded:
            continue
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise UsageError(f"REPLAY_PLUGINS names {module!r}, which cannot be imported: {e}") from None
        _loaded.add(module)


def check_numerics(plan: AttentionPlan, n_layer: int, n_head: int) -> None:
    """The numerics probe reads the emulation's intermediates, so every head must run on an emulated backend."""
    for layer in range(n_layer):
        for head in range(n_head):
            name = plan.backend_for(layer, head).name
            if name not in NUMERICS:
                raise UsageError(f"--numerics measures the emulated flash backends, but layer {layer} head {head} "
                                 f"uses {name!r}; record with --attention reference-emu (or fa2-emu)")


def check_attention(cfg: ModelConfig, numerics: bool = False) -> str:
    """Fail early, in the launching process, on an attention plan that cannot run on this model (or
    that the numerics probe cannot measure); returns the plan in canonical form (what the manifest records)."""
    plan = AttentionPlan.parse(cfg.attention)
    plan.validate(cfg.n_layer, cfg.n_head)
    if numerics:
        check_numerics(plan, cfg.n_layer, cfg.n_head)
    return plan.canonical()
