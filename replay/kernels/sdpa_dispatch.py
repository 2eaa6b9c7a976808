"""Attention plans for a model of your own that calls `torch.nn.functional.scaled_dot_product_attention`
(nanoGPT, torchtitan and most hand-written models): no change to its code.

    with sdpa_dispatch(model, AttentionPlan.parse("sdpa;1=fa2-emu:fix=safe-softmax")):
        loss = model(x, y)          # layer 1's attention now runs the emulated FA2 with the fix

The attention modules are found by a pattern of module names (`transformer.h.*.attn`) or, without one,
as the innermost modules whose class name contains "Attention" (else those named `attn`, `attention`,
`self_attn` or `self_attention`); the i-th of them, in the model's order, is layer i. A forward pre-hook
on each notes which layer is running, and a TorchFunctionMode hands every SDPA call made inside one of them
(and every call of `kernels.explicit.causal_attention`, which hand-written attention calls instead of its
explicit softmax, and of `kernels.flex.flex_attention`, which flex attention calls instead) to that layer's backends
(`registry.LayerAttention`: per head, with autocast off for our own backends). SDPA called anywhere else,
and layers whose every head is `sdpa`, run PyTorch's own kernel untouched.

The backends compute causal attention, so a call must be causal (`is_causal=True`, or a boolean mask
that allows no future key: padding on top of causal). Additive float masks other than 0 / -inf and
grouped-query attention with fewer key heads are refused with a clear error. A call's `dropout_p` goes to
every backend (kernels/dropout.py); a layer whose every head is `sdpa` draws exactly the model's own mask.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from replay.errors import UsageError
from replay.kernels.baseline import causal_mask
from replay.kernels.explicit import causal_attention, dropout_probability
from replay.kernels.flex import flex_attention, holds_flex, routed_call, routed_output
from replay.kernels.plan import AttentionPlan
from replay.kernels.reach import AttentionReach
from replay.kernels.registry import LayerAttention, raise_deferred

_SDPA = torch.nn.functional.scaled_dot_product_attention


def attention_modules(model: torch.nn.Module, pattern: str | None = None) -> list[tuple[str, torch.nn.Module]]:
    """The model's attention modules in order (layer i is the i-th), by `pattern` or by their names."""
    named = list(model.named_modules())
    if pattern:
        found = [(name, m) for name, m in named if fnmatch.fnmatchcase(name, pattern)]
        if not found:
            hint = ", ".join(name for name, _ in named[1:6]) + (", ..." if len(named) > 6 else "")
            raise UsageError(f"no module of the model matches {pattern!r} (its modules: {hint})")
        return found
    found = [(name, m) for name, m in named if name and "attention" in type(m).__name__.lower()]
    found = found or [(name, m) for name, m in named if name.rsplit(".", 1)[-1].lower() in ATTENTION_NAMES]
    innermost = [(name, m) for name, m in found
                 if not any(other.startswith(name + ".") for other, _ in found if other != name)]
    if not innermost:
        raise UsageError("no attention module found (no class named *Attention*, no module named "
                         f"{', '.join(ATTENTION_NAMES)}); name them with a pattern such as 'transformer.h.*.attn'")
    return innermost


ATTENTION_NAMES = ("attn", "attention", "self_attn", "self_attention")


@contextlib.contextmanager
def sdpa_dispatch(model: torch.nn.Module, plan: AttentionPlan, pattern: str | None = None,
                  reach: AttentionReach | None = None) -> Iterator[list[str]]:
    """Route the model's SDPA calls through `plan` while the context is open; yields the attention modules'
    names (layer i is the i-th). With `reach`, every call an attention module makes is counted there (per
    head and backend, the model's own SDPA calls as `sdpa`), and what each module called besides. Hooks and
    mode are removed on exit, whatever happens."""
    modules = attention_modules(model, pattern)
    plan.validate(len(modules), n_head=1 << 30)   # layers now; heads once a call shows how many there are
    mode = _PlanMode(plan, len(modules), reach)
    handles = []
    try:
        for layer, (name, module) in enumerate(modules):
            handles.append(module.register_forward_pre_hook(mode.entering(layer, module, name)))
            handles.append(module.register_forward_hook(mode.leaving(), always_call=True))   # also when it raises
        with mode:
            yield [name for name, _ in modules]
    finally:
        for handle in handles:
            handle.remove()
    raise_deferred()   # what the backends noted without waiting for the GPU (triton-fa2's underflow check)


class _PlanMode(TorchFunctionMode):
    def __init__(self, plan: AttentionPlan, n_layer: int, reach: AttentionReach | None = None):
        super().__init__()
        self.plan, self.n_layer, self.reach = plan, n_layer, reach
        self.active: list[tuple[int, torch.nn.Module]] = []   # the attention modules running, innermost last
        self.layers: dict[tuple[int, int], LayerAttention] = {}
        self.flex_masks: dict[str, Any] = {}   # kernels/flex.py's: the last block mask's elements

    def entering(self, layer: int, module: torch.nn.Module, name: str):
        flex = self.reach is not None and holds_flex(module)

        def hook(*_):
            self.active.append((layer, module))
            if self.reach is not None:
                self.reach.entered(layer, name, type(module).__name__, flex)
        return hook

    def leaving(self):
        def hook(*_):
            self.active.pop()
        return hook

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in (_SDPA, causal_attention, flex_attention) or not self.active:
            if self.active and self.reach is not None:
                self.reach.called(self.active[-1][0], getattr(func, "__name__", ""))
            return func(*args, **kwargs)
        layer, module = self.active[-1]
        if func is _SDPA:
            bound = dict(zip(_PARAMS, args, strict=False)) | kwargs
            q, k, v = _qkv(bound)
            keep, scale = _causal_keep(layer, q, k, bound)
            dropout = bound.get("dropout_p", 0.0)
        elif func is flex_attention:   # kernels/flex.py: its arguments are read once the call is routed
            bound = dict(zip(_FLEX_PARAMS, args, strict=False)) | kwargs
            q, dropout = bound["query"], 0.0
        else:   # kernels/explicit.py: causal, no mask beyond it
            bound = dict(zip(("q", "k", "v"), args, strict=False)) | kwargs
            q, k, v = _qkv({"query": bound["q"], "key": bound["k"], "value": bound["v"]})
            keep = None if q.shape[-2] == k.shape[-2] else causal_mask(q.shape[-2], k.shape[-2], q.device).expand(
                q.shape[0], 1, -1, -1)
            scale = bound.get("scale") or 1.0 / math.sqrt(k.shape[-1])
            dropout = dropout_probability(bound.get("dropout"))
        n_head = q.shape[1]
        attention = self.layers.get((layer, n_head))
        if attention is None:
            self.plan.validate(self.n_layer, n_head)
            attention = self.layers[(layer, n_head)] = LayerAttention(self.plan, layer, n_head, self.reach)
        if all(spec.name == "sdpa" for spec, _ in attention.groups):   # the model's own attention, untouched
            if self.reach is not None:
                self.reach.ran(layer, range(n_head), "sdpa")
            return func(*args, **kwargs)
        if func is flex_attention:
            q, k, v, keep, scale = routed_call(layer, bound, self.flex_masks)
        device = q.device.type
        if torch.is_autocast_enabled(device):   # SDPA under autocast computes in the autocast dtype
            q, k, v = (t.to(torch.get_autocast_dtype(device)) for t in (q, k, v))
        out = attention(module, q, k, v, keep, scale, dropout)
        return routed_output(bound, out) if func is flex_attention else out


_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_FLEX_PARAMS = ("query", "key", "value", "score_mod", "block_mask", "scale", "enable_gqa", "return_lse",
                "kernel_options")


def _qkv(bound: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = bound["query"], bound["key"], bound["value"]
    if q.dim() != 4 or k.shape[1] != q.shape[1]:
        raise UsageError(f"replay's attention backends take q, k, v as [batch, heads, seq, head_dim] with as many "
                         f"key as query heads; this call has {tuple(q.shape)} and {tuple(k.shape)} (grouped-query "
                         "attention: repeat the keys and values to the query heads before calling SDPA)")
    return q, k, v


def _causal_keep(layer: int, q, k, bound: dict) -> tuple[torch.Tensor | None, float]:
    """The call's mask as the backends take it (None: plain causal; else bool, True = attend), and its scale."""
    mask, causal = bound.get("attn_mask"), bool(bound.get("is_causal", False))
    scale = bound.get("scale") or q.shape[-1] ** -0.5
    n, m = q.shape[-2], k.shape[-2]
    if mask is None:
        if not causal:
            raise UsageError(f"layer {layer} calls SDPA without is_causal=True or a mask: replay's attention "
                             "backends compute causal attention only")
        if n == m:
            return None, scale
        if n > m:
            raise UsageError(f"layer {layer} calls SDPA with is_causal=True and {n} queries for {m} keys: PyTorch "
                             "aligns that mask to the top left, where the first queries see no key; replay's "
                             "backends cannot; pass a boolean mask")
        mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril()   # PyTorch's: top-left aligned
        causal = False
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == float("-inf"))).all()):
            raise UsageError(f"layer {layer} calls SDPA with an additive mask of values other than 0 and -inf; "
                             "pass a boolean mask (True = attend)")
        mask = mask == 0
    if mask.dim() > 4 or mask.dim() >= 3 and mask.shape[-3] != 1:
        raise UsageError(f"layer {layer} calls SDPA with a mask of shape {tuple(mask.shape)}: replay's attention "
                         "backends take one mask for all heads, [batch, 1, seq, seq] or [seq, seq]")
    keep = torch.broadcast_to(mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)), (q.shape[0], 1, n, m))
    within = causal_mask(n, m, keep.device)
    if not causal and bool((keep & ~within).any()):
        raise UsageError(f"layer {layer} calls SDPA with a mask that lets queries see later keys: replay's "
                         "attention backends compute causal attention only")
    keep = keep & within
    return (None if torch.equal(keep, within.expand_as(keep)) else keep), scale   # None: plain causal
