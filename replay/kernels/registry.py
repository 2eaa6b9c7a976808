"""The glue between attention plans (kernels/plan.py) and transformers' models: every head runs on the
backend its plan names.

A plan that is one transformers implementation for the whole model is handed to transformers as is;
anything else runs through `replay`, an attention function registered with transformers'
AttentionInterface (and its mask interface, so padding masks arrive) that splits the heads of each layer
between their backends and runs our own backends with autocast off, so their rounding is theirs alone.
That works for every transformers model whose attention modules call the interface (GPT-2, Llama, Qwen2,
Mistral, ...). A head is a query head: with grouped-query attention (fewer key/value heads than query
heads), query head h reads key/value head h // (heads / key-value heads), so overriding one head changes
that head's attention only, and its group's keys and values stay shared with the other heads.

Attention dropout reaches every backend: `eager` and `sdpa` get it as transformers passes it (their own
masks), ours apply it themselves (kernels/dropout.py), plugins that take a `dropout` argument get it. Each
group of heads draws its own mask, in the order of the groups, so a layer split between backends is
deterministic; a layer whose every head is on one transformers backend runs (and draws) as the model would.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable

import torch

from replay.errors import UsageError
from replay.kernels import internals
from replay.kernels.baseline import baseline_attention, causal_mask
from replay.kernels.dtypes import DTYPES
from replay.kernels.flash_emu import flash_attention
from replay.kernels.plan import EMULATED, PLUGINS, AttentionPlan, BackendSpec
from replay.kernels.reach import AttentionReach


class LayerAttention:
    """One layer's heads, grouped by backend; called by the registered `replay` attention function and by
    `sdpa_dispatch`. Every call is counted in `reach`, per head and backend, when one is given."""

    def __init__(self, plan: AttentionPlan, layer: int, n_head: int, reach: AttentionReach | None = None):
        groups: dict[BackendSpec, list[int]] = {}
        for head in range(n_head):
            groups.setdefault(plan.backend_for(layer, head), []).append(head)
        self.groups = [(spec, heads) for spec, heads in groups.items()]
        self.layer, self.n_head, self.reach = layer, n_head, reach
        self._names = [spec.canonical() for spec, _ in self.groups]

    def __call__(self, module, q, k, v, keep: torch.Tensor | None, scaling: float,
                 dropout: float = 0.0) -> torch.Tensor:
        """q: [B, H, N, d]; k, v: [B, H_kv, M, d] (H_kv divides H); `keep`: bool [B, 1, N, M] (True = attend)
        or None for plain causal; `dropout`: attention dropout's probability."""
        if self.reach is not None:
            for name, (_, heads) in zip(self._names, self.groups, strict=True):
                self.reach.ran(self.layer, heads, name)
        if len(self.groups) == 1:   # the module's own keys and values: a transformers backend runs as it would
            spec, heads = self.groups[0]
            return _run(spec, module, q, k, v, keep, scaling, (self.layer, heads), dropout)
        k, v, module = per_query_head(k, q.shape[1]), per_query_head(v, q.shape[1]), _Ungrouped(module)
        out = q.new_empty(*q.shape[:-1], v.shape[-1])   # values may be of another width than queries and keys
        for spec, heads in self.groups:
            idx = torch.tensor(heads, device=q.device)
            out[:, idx] = _run(spec, module, q[:, idx], k[:, idx], v[:, idx], keep, scaling,
                               (self.layer, heads), dropout).to(out.dtype)
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
    # lazy, as every transformers import here: a model of one's own never loads transformers (1.2 s after torch)
    from transformers.models.gpt2.modeling_gpt2 import eager_attention_forward

    return eager_attention_forward


def _run(spec: BackendSpec, module, q, k, v, keep, scaling, site: tuple[int, list[int]],
         dropout: float) -> torch.Tensor:
    n, m = q.shape[-2], k.shape[-2]
    if spec.name == "eager":
        keep = causal_mask(n, m, q.device) if keep is None else keep
        additive = torch.where(keep, 0.0, torch.finfo(torch.float32).min)   # transformers' eager_mask
        watch = _watch(site)
        call = functools.partial(eager_function(module), module, q, k, v, additive, scaling=scaling, dropout=dropout)
        if watch is None:
            return call()[0].transpose(1, 2)
        (out, weights), scores = internals.eager_scores(call, additive)
        if isinstance(weights, torch.Tensor):   # its P; its S, the input of its softmax
            watch(scores, weights.detach())
        return out.transpose(1, 2)
    if spec.name == "sdpa":
        # lazy: transformers (see eager_function), and triton (0.3 s) for the triton-fa2 backend only
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        out = sdpa_attention_forward(module, q, k, v, keep, dropout=dropout, scaling=scaling, is_causal=keep is None)[0]
        return out.transpose(1, 2)
    k, v = per_query_head(k, q.shape[1]), per_query_head(v, q.shape[1])
    if spec.name in PLUGINS:
        if keep is not None:
            raise UsageError(f"attention backend {spec.name!r} (a plugin) takes no padding masks")
        fn = PLUGINS[spec.name]
        if not dropout:
            return fn(q, k, v, scaling)
        if "dropout" not in inspect.signature(fn).parameters:
            raise UsageError(f"attention backend {spec.name!r} (a plugin) takes no attention dropout: give its "
                             "function a `dropout` argument, or set the model's attention dropout to 0")
        return fn(q, k, v, scaling, dropout=dropout)
    if spec.name in EMULATED and v.shape[-1] != q.shape[-1]:
        raise UsageError(f"attention backend {spec.name!r} takes values as wide as the queries and keys (head dim "
                         f"{q.shape[-1]}); this call's values are {v.shape[-1]} wide: use 'baseline' for these heads")
    with torch.autocast(q.device.type, enabled=False):   # our backends round where they say, nowhere else
        if spec.name == "baseline":
            dtype = DTYPES[spec.dtype] if spec.dtype else q.dtype
            return baseline_attention(q, k, v, dtype, causal=True, scale=scaling, mask=keep,
                                      dropout=dropout, watch=_watch(site)).to(q.dtype)
        assert spec.options is not None, "the emulated and Triton backends always have options (kernels/plan.py)"
        if spec.name == "triton-fa2":
            from replay.kernels.triton_fa2 import triton_flash_attention  # lazy: triton (0.3 s), when a plan names it

            return triton_flash_attention(q, k, v, spec.options, causal=True, scale=scaling, defer_checks=True,
                                          mask=keep, dropout=dropout)
        return flash_attention(q, k, v, spec.options, causal=True, scale=scaling, mask=keep, site=site,
                               dropout=dropout, watch=_watch(site))


def _watch(site: tuple[int, list[int]]) -> Callable[[torch.Tensor | None, torch.Tensor], None] | None:
    """What hands a backend's S and P, for these heads of the layer, to the call's watcher (kernels/internals.py)."""
    watcher = internals.watcher()
    if watcher is None:
        return None
    heads = site[1]
    return lambda s, p: watcher(heads, s, p)


def raise_deferred() -> None:
    """Raise what the backends checked without making the host wait for the GPU (triton-fa2's underflow
    check); the trainer calls it once per step."""
    module = sys.modules.get("replay.kernels.triton_fa2")
    if module is not None:
        module.raise_deferred()


def _replay_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-function signature; returns ([B, N, H, d], None). transformers passes
    `dropout` > 0 only in training."""
    layer_attention: LayerAttention = module.replay_attention
    keep = attention_mask
    if keep is not None:
        n, m = query.shape[-2], key.shape[-2]
        if torch.equal(keep, causal_mask(n, m, keep.device).expand_as(keep)):
            keep = None   # plain causal: the emulation can skip tiles right of the diagonal
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = layer_attention(module, query, key, value, keep, scaling, dropout)
    return out.transpose(1, 2).contiguous(), None


def _replay_mask(*args, **kwargs):
    """Always a materialised boolean mask (True = attend), so padding reaches the backends."""
    # lazy: transformers (see eager_function)
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
        # lazy: transformers (see eager_function)
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


def transformers_model_in(model):
    """`model` if it is a transformers model (`is_transformers_model`), else the one such model it holds (a
    LightningModule, a wrapper of one's own, around a `LlamaForCausalLM`); None if it holds none or several."""
    if is_transformers_model(model):
        return model
    found = [m for m in model.modules() if m is not model and hasattr(m, "set_attn_implementation")
             and hf_attention_modules(m)]
    outermost = [m for m in found if not any(m is not o and any(m is x for x in o.modules()) for o in found)]
    return outermost[0] if len(outermost) == 1 else None


def hf_attention_modules(model) -> list:
    """A transformers model's self-attention modules, by layer: those that know their `layer_idx`."""
    found = [m for m in model.modules() if "attention" in type(m).__name__.lower()
             and isinstance(getattr(m, "layer_idx", None), int) and not getattr(m, "is_cross_attention", False)]
    return sorted(found, key=lambda m: m.layer_idx)


def apply_plan(model, plan: AttentionPlan, reach: AttentionReach | None = None) -> None:
    """Give every attention module of a transformers model (GPT-2, Llama, Qwen2, Mistral, ...) its backends
    and switch the model to them; with `reach`, every attention call is counted there, per head and backend
    (a plan of one transformers implementation: by a forward hook on each attention module, which runs it)."""
    modules = hf_attention_modules(model)
    n_head = model.config.get_text_config().num_attention_heads
    plan.validate(len(modules), n_head)
    if plan.is_transformers_builtin:
        model.set_attn_implementation(plan.default.name)
        if reach is not None:
            name = plan.default.canonical()
            for module in modules:
                module.register_forward_pre_hook(lambda m, *_: reach.ran(m.layer_idx, range(n_head), name))
        return
    register()
    for module in modules:
        module.replay_attention = LayerAttention(plan, module.layer_idx, n_head, reach)
    model.set_attn_implementation("replay")
