"""Flex attention (`torch.nn.attention.flex_attention`) made reachable by `--attention` with one call.

A model that calls flex attention calls no SDPA, so no attention plan reaches it. Its call

    y = flex_attention(q, k, v, block_mask=block_mask)            # or a compiled flex_attention

becomes

    y = replay.kernels.flex.flex_attention(q, k, v, block_mask=block_mask, kernel=compiled_flex)

or, for a model that calls a flex attention it holds (torchtitan's `FlexAttention._compiled_flex_attn`), that
kernel is replaced once by `routable(kernel)`, which makes the same call.

Where no attention plan routes it (and for a layer whose every head is `sdpa`, the model's own attention), the
call is `kernel(q, k, v, score_mod=..., block_mask=..., scale=..., enable_gqa=...)` as written: the run keeps
its bits. Inside an attention module under `sdpa_dispatch`, it is handed to the layer's backends as an SDPA call
would be: the block mask's elements (its blocks, and its `mask_mod` within them) become the boolean mask the
backends take, which must be causal (a document mask on top of causal is) and the same for every head; keys and
values of fewer heads (`enable_gqa`) are repeated per query head. What the backends cannot compute is refused
in one line: a `score_mod`, the log-sum-exp or other auxiliary outputs (a `return_aux` that asks for none gets
the output and an empty `AuxOutput`, as torch's gives).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention.flex_attention import AuxOutput, BlockMask, create_mask
from torch.nn.attention.flex_attention import flex_attention as _torch_flex
from torch.overrides import handle_torch_function, has_torch_function

from replay.errors import UsageError
from replay.kernels.baseline import causal_mask


def flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   score_mod: Callable[..., torch.Tensor] | None = None, block_mask: BlockMask | None = None,
                   scale: float | None = None, enable_gqa: bool = False, *,
                   kernel: Callable[..., Any] | None = None, **options: Any) -> Any:
    """torch's `flex_attention` (or `kernel`, e.g. `torch.compile(flex_attention)`) with its arguments as given;
    `options` (`kernel_options`, `return_aux`, ...) go to it unchanged. Under an attention plan, see above."""
    if has_torch_function((query, key, value)):   # a TorchFunctionMode is active: sdpa_dispatch's routes this call
        return handle_torch_function(flex_attention, (query, key, value), query, key, value, score_mod=score_mod,
                                     block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, kernel=kernel,
                                     **options)
    return (kernel or _torch_flex)(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                   enable_gqa=enable_gqa, **options)


def routable(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """`kernel` (a flex attention, compiled or not) as `flex_attention(..., kernel=kernel)`: the same call where no
    plan routes it, the plan's backends where one does."""
    return functools.partial(flex_attention, kernel=kernel)


def routed_output(bound: dict[str, Any], out: torch.Tensor) -> Any:
    """A routed call's result as the call asked for it: the output, with an empty `AuxOutput` where it passed a
    `return_aux` that requests nothing (torchtitan's way when it needs no log-sum-exp)."""
    return out if bound.get("return_aux") is None else (out, AuxOutput(lse=None, max_scores=None))


def holds_flex(module: torch.nn.Module) -> bool:
    """Whether an attention module's class, or the module its forward is defined in, holds torch's flex attention,
    compiled or not (torchtitan's `FlexAttention._compiled_flex_attn`, an imported `flex_attention`): its
    calls reach no TorchFunctionMode, so a replay that finds no call says so, naming this module's way out."""
    forward = getattr(type(module), "forward", None)
    places = [*(vars(cls) for cls in type(module).__mro__), getattr(forward, "__globals__", {})]
    return any(_is_torch_flex(value) for place in places for value in list(place.values()))


def _is_torch_flex(value: Any) -> bool:
    for _ in range(4):   # a staticmethod of a compiled function of torch's flex attention, at most
        if not callable(value) and not isinstance(value, staticmethod):
            return False
        if value is _torch_flex:
            return True
        value = next((getattr(value, name) for name in ("__func__", "_torchdynamo_orig_callable", "__wrapped__")
                      if getattr(value, name, None) is not None), None)
    return False


def routed_call(layer: int, bound: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                             torch.Tensor | None, float]:
    """A `flex_attention` call's arguments (`bound`, by name) as the backends take them: q, k, v with as many
    key as query heads, the mask (bool [B, 1, N, M], True = attend, causal; None where it is plain causal)
    and the scale. Refuses what the backends cannot compute."""
    q, k, v = bound["query"], bound["key"], bound["value"]
    aux = bound.get("return_aux")
    refused = [name for name in ("score_mod", "return_lse") if bound.get(name)]
    refused += [f"return_aux={name}" for name in ("lse", "max_scores") if aux is not None and getattr(aux, name)]
    if refused:
        raise UsageError(f"layer {layer} calls flex attention with {', '.join(refused)}: replay's attention "
                         "backends compute masked softmax attention only; route this layer's heads to 'sdpa' "
                         "(its own attention) or drop the argument")
    if q.dim() != 4 or k.shape[1] != q.shape[1] and not bound.get("enable_gqa"):
        raise UsageError(f"layer {layer} calls flex attention with q {tuple(q.shape)} and k {tuple(k.shape)}: "
                         "replay takes [batch, heads, seq, head_dim] with as many key as query heads, or "
                         "enable_gqa=True")
    if q.shape[1] % k.shape[1]:
        raise UsageError(f"layer {layer}: {q.shape[1]} query heads cannot share {k.shape[1]} key/value heads "
                         "evenly")
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scale = bound.get("scale") or q.shape[-1] ** -0.5
    return q, k, v, _keep(layer, bound.get("block_mask"), q.shape[0], q.shape[-2], k.shape[-2], q.device), scale


def _keep(layer: int, block_mask: BlockMask | None, batch: int, n: int, m: int,
          device: torch.device) -> torch.Tensor | None:
    """The elements a block mask lets through (its blocks, and its mask_mod within them) as one bool mask for
    all heads, [B, 1, N, M]; None where that is plain causal."""
    if block_mask is None:
        raise UsageError(f"layer {layer} calls flex attention without a block mask: every query sees every key; "
                         "replay's attention backends compute causal attention only (pass a causal block mask)")
    rows, cols = block_mask.BLOCK_SIZE
    blocks = block_mask.to_dense().bool()   # [B, H, N / rows, M / cols]: the blocks computed, partial or full
    if blocks.shape[0] not in (1, batch):
        raise UsageError(f"layer {layer} calls flex attention with a block mask for batch {blocks.shape[0]} and "
                         f"inputs of batch {batch}")
    dense = blocks.repeat_interleave(rows, dim=-2).repeat_interleave(cols, dim=-1)[..., :n, :m].to(device)
    heads = blocks.shape[1]
    dense = dense & create_mask(block_mask.mask_mod, blocks.shape[0], heads, n, m, device=device)
    if heads > 1 and not bool((dense == dense[:, :1]).all()):
        raise UsageError(f"layer {layer} calls flex attention with a mask that differs between heads: replay's "
                         "attention backends take one mask for all heads")
    keep = dense[:, :1].expand(batch, 1, n, m)
    within = causal_mask(n, m, device)
    if bool((keep & ~within).any()):
        raise UsageError(f"layer {layer} calls flex attention with a mask that lets queries see later keys: "
                         "replay's attention backends compute causal attention only")
    if not bool(keep.any(dim=-1).all()):
        raise UsageError(f"layer {layer} calls flex attention with a mask under which a query sees no key")
    return None if torch.equal(keep, within.expand_as(keep)) else keep
