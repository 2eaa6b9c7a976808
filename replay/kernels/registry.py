"""Attention backends by name, a per-layer / per-head plan, and the glue into transformers' models.

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

A plan that is one transformers implementation for the whole model is handed to transformers as is;
anything else runs through `replay`, an attention function registered with transformers'
AttentionInterface (and its mask interface, so padding masks arrive) that splits the heads of each layer
between their backends and runs our own backends with autocast off, so their rounding is theirs alone.
That works for every transformers model whose attention modules call the interface (GPT-2, Llama, Qwen2,
Mistral, ...). A head is a query head: with grouped-query attention (fewer key/value heads than query
heads), query head h reads key/value head h // (heads / key-value heads), so overriding one head changes
that head's attention only, and its group's keys and values stay shared with the other heads.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch

from replay.config import ModelConfig
from replay.errors import UsageError
from replay.kernels.baseline import baseline_attention, causal_mask
from replay.kernels.flash_emu import flash_attention
from replay.kernels.options import DTYPES, AttentionOptions, SafeSoftmaxFix

TRANSFORMERS_NAMES = ("eager", "sdpa")
EMULATED = {"fa2-emu": "fa2", "reference-emu": "reference", "triton-fa2": "fa2"}
NAMES = (*TRANSFORMERS_NAMES, "baseline", *EMULATED)
_TARGET = re.compile(r"^(\d+)(?:\.(\d+)(?:-(\d+))?)?$")


@dataclass(frozen=True)
class BackendSpec:
    name: str
    options: AttentionOptions | None = None   # fa2-emu, reference-emu, triton-fa2
    dtype: str | None = None                  # baseline

    @classmethod
    def parse(cls, text: str) -> "BackendSpec":
        name, _, rest = text.strip().partition(":")
        _load_plugins()
        if name in _PLUGINS:
            if rest:
                raise UsageError(f"attention backend {name!r} (a plugin) takes no options (got {rest!r})")
            return cls(name)
        if name not in NAMES:
            raise UsageError(f"unknown attention backend {name!r}; choose one of {', '.join([*NAMES, *_PLUGINS])}")
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
            if dtype is not None and dtype not in DTYPES:
                raise UsageError(f"unknown precision {dtype!r} in {text!r}; choose one of {', '.join(DTYPES)}")
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
            parts += ["fix=safe-softmax", f"beta={o.fix.beta:g}"] + ([f"tie={o.fix.tie_tol:g}"] if o.fix.tie_tol else [])
        parts += [f"br={o.block_r}"] if o.block_r != default.block_r else []
        parts += [f"bc={o.block_c}"] if o.block_c != default.block_c else []
        parts += ["hp-delta"] if o.hp_delta else []
        parts += ["hp-pv"] if o.hp_pv else []
        parts += [f"dtype={o.dtype}"] if o.dtype else []
        parts += [f"keys={o.key_order}"] if o.key_order != default.key_order else []
        return self.name + (":" + ",".join(parts) if parts else "")

    def check_available(self) -> None:
        if self.name == "triton-fa2":
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
            block_r=int(opts.get("br") or AttentionOptions.block_r), block_c=int(opts.get("bc") or AttentionOptions.block_c),
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
    def parse(cls, text: str) -> "AttentionPlan":
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


# -- the glue into transformers --------------------------------------------------------------------

class LayerAttention:
    """One layer's heads, grouped by backend; called by the registered `replay` attention function and by
    `sdpa_dispatch`."""

    def __init__(self, plan: AttentionPlan, layer: int, n_head: int):
        groups: dict[BackendSpec, list[int]] = {}
        for head in range(n_head):
            groups.setdefault(plan.backend_for(layer, head), []).append(head)
        self.groups = [(spec, heads) for spec, heads in groups.items()]
        self.layer, self.n_head = layer, n_head

    def __call__(self, module, q, k, v, keep: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """q: [B, H, N, d]; k, v: [B, H_kv, M, d] (H_kv divides H); `keep`: bool [B, 1, N, M] (True = attend)
        or None for plain causal."""
        if len(self.groups) == 1:   # the module's own keys and values: a transformers backend runs as it would
            spec, heads = self.groups[0]
            return _run(spec, module, q, k, v, keep, scaling, (self.layer, heads))
        k, v, module = per_query_head(k, q.shape[1]), per_query_head(v, q.shape[1]), _Ungrouped(module)
        out = torch.empty_like(q)
        for spec, heads in self.groups:
            idx = torch.tensor(heads, device=q.device)
            out[:, idx] = _run(spec, module, q[:, idx], k[:, idx], v[:, idx], keep, scaling,
                               (self.layer, heads)).to(out.dtype)
        return out


def per_query_head(kv: torch.Tensor, n_head: int) -> torch.Tensor:
    """Keys or values [B, H_kv, M, d] as one per query head [B, H, M, d] (query head h reads key/value head
    h // (H / H_kv)), as transformers' repeat_kv lays them out."""
    n_kv = kv.shape[1]
    if n_kv == n_head:
        return kv
    if n_head % n_kv:
        raise UsageError(f"{n_head} query heads cannot share {n_kv} key/value heads evenly")
    return kv.repeat_interleave(n_head // n_kv, dim=1)


class _Ungrouped:
    """An attention module as transformers' attention functions see it once its keys and values have
    been repeated per query head (`per_query_head`): one query head per key/value head."""

    num_key_value_groups = 1

    def __init__(self, module):
        self.module = module

    def __getattr__(self, name):
        return getattr(self.module, name)


def eager_function(module) -> Callable:
    """The model's own eager attention: the `eager_attention_forward` of the file defining its attention
    class (or a class it derives from; every transformers model file has one), else GPT-2's (an attention
    module of one's own, with as many key as query heads, under `sdpa_dispatch`)."""
    owner = module.module if isinstance(module, _Ungrouped) else module
    for cls in type(owner).__mro__:
        fn = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
        if fn is not None:
            return fn
    from transformers.models.gpt2.modeling_gpt2 import eager_attention_forward

    return eager_attention_forward


# Backends added by plugins: name -> a causal attention function (q, k, v, scaling) -> out, on [B, H, N, d].
_PLUGINS: dict[str, Callable[..., torch.Tensor]] = {}
_loaded: set[str] = set()


def register_backend(name: str, fn: Callable[..., torch.Tensor]) -> None:
    """Add an attention backend that plans can name: `fn(q, k, v, scaling)` computes causal attention on
    [batch, heads, seq, head_dim] tensors. Modules listed in REPLAY_PLUGINS (comma-separated) are imported
    before the first plan is read, in every process of a command (its ranks inherit the variable), so a
    backend of your own can be recorded, replayed and bisected like the built-in ones."""
    if name in NAMES:
        raise UsageError(f"attention backend {name!r} exists already")
    _PLUGINS[name] = fn


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


def _run(spec: BackendSpec, module, q, k, v, keep, scaling, site: tuple[int, list[int]]) -> torch.Tensor:
    n, m = q.shape[-2], k.shape[-2]
    if spec.name == "eager":
        keep = causal_mask(n, m, q.device) if keep is None else keep
        additive = torch.where(keep, 0.0, torch.finfo(torch.float32).min)   # transformers' eager_mask
        return eager_function(module)(module, q, k, v, additive, scaling=scaling, dropout=0.0)[0].transpose(1, 2)
    if spec.name == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        out = sdpa_attention_forward(module, q, k, v, keep, dropout=0.0, scaling=scaling, is_causal=keep is None)[0]
        return out.transpose(1, 2)
    k, v = per_query_head(k, q.shape[1]), per_query_head(v, q.shape[1])
    if spec.name in _PLUGINS:
        if keep is not None:
            raise UsageError(f"attention backend {spec.name!r} (a plugin) takes no padding masks")
        return _PLUGINS[spec.name](q, k, v, scaling)
    with torch.autocast(q.device.type, enabled=False):   # our backends round where they say, nowhere else
        if spec.name == "baseline":
            dtype = DTYPES[spec.dtype] if spec.dtype else q.dtype
            return baseline_attention(q, k, v, dtype, causal=True, scale=scaling, mask=keep).to(q.dtype)
        if spec.name == "triton-fa2":
            from replay.kernels.triton_fa2 import triton_flash_attention

            return triton_flash_attention(q, k, v, spec.options, causal=True, scale=scaling, defer_checks=True,
                                          mask=keep)
        return flash_attention(q, k, v, spec.options, causal=True, scale=scaling, mask=keep, site=site)


def raise_deferred() -> None:
    """Raise what the backends checked without making the host wait for the GPU (triton-fa2's underflow
    check); the trainer calls it once per step."""
    module = sys.modules.get("replay.kernels.triton_fa2")
    if module is not None:
        module.raise_deferred()


def _replay_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-function signature; returns ([B, N, H, d], None)."""
    if dropout:
        raise UsageError("replay's attention backends do not apply attention dropout; set model.dropout=0")
    layer_attention: LayerAttention = module.replay_attention
    keep = attention_mask
    if keep is not None:
        n, m = query.shape[-2], key.shape[-2]
        if torch.equal(keep, causal_mask(n, m, keep.device).expand_as(keep)):
            keep = None   # plain causal: the emulation can skip tiles right of the diagonal
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    return layer_attention(module, query, key, value, keep, scaling).transpose(1, 2).contiguous(), None


def _replay_mask(*args, **kwargs):
    """Always a materialised boolean mask (True = attend), so padding reaches the backends."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


_registered = False


def _probe_attention(module, query, key, value, attention_mask, **kwargs):
    """`replay-probe` (the analysis probe): the model's own eager attention, noting the q and k the module
    receives (after RoPE) in its `replay_probe` dict, by layer."""
    module.replay_probe[module.layer_idx] = (query, key)
    return eager_function(module)(module, query, key, value, attention_mask, **kwargs)


def register() -> None:
    """Register `replay` (attention plans) and `replay-probe` with transformers' interfaces, once."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, eager_mask

        AttentionInterface.register("replay", _replay_attention)
        AttentionMaskInterface.register("replay", _replay_mask)
        AttentionInterface.register("replay-probe", _probe_attention)
        AttentionMaskInterface.register("replay-probe", eager_mask)
        _registered = True


def is_transformers_model(model) -> bool:
    """A transformers model whose attention a plan can reach through the AttentionInterface."""
    return bool(hf_attention_modules(model)) and hasattr(model, "set_attn_implementation")


def hf_attention_modules(model) -> list:
    """A transformers model's self-attention modules, by layer: those that know their `layer_idx`."""
    found = [m for m in model.modules() if "attention" in type(m).__name__.lower()
             and isinstance(getattr(m, "layer_idx", None), int) and not getattr(m, "is_cross_attention", False)]
    return sorted(found, key=lambda m: m.layer_idx)


def apply_plan(model, plan: AttentionPlan) -> None:
    """Give every attention module of a transformers model (GPT-2, Llama, Qwen2, Mistral, ...) its backends
    and switch the model to them."""
    modules = hf_attention_modules(model)
    n_head = model.config.get_text_config().num_attention_heads
    plan.validate(len(modules), n_head)
    if plan.is_transformers_builtin:
        model.set_attn_implementation(plan.default.name)
        return
    register()
    for module in modules:
        module.replay_attention = LayerAttention(plan, module.layer_idx, n_head)
    model.set_attn_implementation("replay")


def check_attention(cfg: ModelConfig, numerics: bool = False) -> str:
    """Fail early, in the launching process, on an attention plan that cannot run on this model (or
    that the numerics probe cannot measure); returns the plan in canonical form (what the manifest records)."""
    from replay.kernels.numerics import check_plan

    plan = AttentionPlan.parse(cfg.attention)
    plan.validate(cfg.n_layer, cfg.n_head)
    if numerics:
        check_plan(plan, cfg.n_layer, cfg.n_head)
    return plan.canonical()
