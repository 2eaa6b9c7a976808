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
from replay.kernels.registry import per_query_head


def flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   score_mod: Callable[..., torch.Tensor] | None = None, block_mask: BlockMask | None = None,
                   scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False,
                   kernel_options: Any = None, *, kernel: Callable[..., Any] | None = None,
                   **options: Any) -> Any:
    """torch's `flex_attention` (or `kernel`, e.g. `torch.compile(flex_attention)`) with its arguments as given;
    `options` (`return_aux`) go to it unchanged. Under an attention plan, see above."""
    if has_torch_function((query, key, value)):   # a TorchFunctionMode is active: sdpa_dispatch's routes this call
        return handle_torch_function(flex_attention, (query, key, value), query, key, value, score_mod=score_mod,
                                     block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, return_lse=return_lse,
                                     kernel_options=kernel_options, kernel=kernel, **options)
    return (kernel or _torch_flex)(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                   enable_gqa=enable_gqa, return_lse=return_lse, kernel_options=kernel_options,
                                   **options)


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
    try:
        return any(_is_torch_flex(value) for place in places for value in list(place.values()))
    except Exception:   # an object whose attributes raise: this only chooses the words of a hint
        return False


def _is_torch_flex(value: Any) -> bool:
    for _ in range(4):   # a staticmethod of a compiled function of torch's flex attention, at most
        if not callable(value) and not isinstance(value, staticmethod):
            return False
        if value is _torch_flex:
            return True
        value = next((getattr(value, name) for name in ("__func__", "_torchdynamo_orig_callable", "__wrapped__")
                      if getattr(value, name, None) is not None), None)
    return False


def routed_call(layer: int, bound: dict[str, Any], cache: dict[str, Any]) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float]:
    """A `flex_attention` call's arguments (`bound`, by name) as the backends take them: q, k, v with as many
    key as query heads, the mask (bool [B, 1, N, M], True = attend, causal; None where it is plain causal)
    and the scale. Refuses what the backends cannot compute. `cache`: a dict the caller keeps for its calls."""
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
    k, v = per_query_head(k, q.shape[1]), per_query_head(v, q.shape[1])
    scale = bound.get("scale") or q.shape[-1] ** -0.5
    keep = _keep(layer, bound.get("block_mask"), q.shape[0], q.shape[1], q.shape[-2], k.shape[-2], q.device, cache)
    return q, k, v, keep, scale


def _keep(layer: int, block_mask: BlockMask | None, batch: int, heads: int, n: int, m: int, device: torch.device,
          cache: dict[str, Any]) -> torch.Tensor | None:
    """The elements a block mask lets through, as flex computes them (its partial blocks where its mask_mod allows,
    its full blocks whole), as one bool mask for all heads, [B, 1, N, M]; None where that is plain causal. `cache`
    keeps the last one: every layer of a step takes the same block mask."""
    if block_mask is None:
        raise UsageError(f"layer {layer} calls flex attention without a block mask: every query sees every key; "
                         "replay's attention backends compute causal attention only (pass a causal block mask)")
    if tuple(block_mask.seq_lengths) != (n, m):
        raise UsageError(f"layer {layer} calls flex attention with a block mask for {block_mask.seq_lengths[0]} "
                         f"queries and {block_mask.seq_lengths[1]} keys, and {n} queries and {m} keys")
    if block_mask.kv_num_blocks.shape[0] not in (1, batch):
        raise UsageError(f"layer {layer} calls flex attention with a block mask for batch "
                         f"{block_mask.kv_num_blocks.shape[0]} and inputs of batch {batch}")
    cached = cache.get("keep")
    if cached is not None and cached[0] is block_mask and cached[1] == (batch, heads, n, m, device):
        return cached[2]
    partial, full = _blocks(block_mask, block_mask.kv_num_blocks, block_mask.kv_indices, n, m, device), None
    if block_mask.full_kv_num_blocks is not None:
        full = _blocks(block_mask, block_mask.full_kv_num_blocks, block_mask.full_kv_indices, n, m, device)
    first = None
    for head in range(heads):   # one head at a time: [B, N, M] each, not [B, H, N, M] at once
        dense = _head(block_mask, partial, full, batch, head, n, m, device)
        if first is None:
            first = dense
        elif not torch.equal(dense, first):
            raise UsageError(f"layer {layer} calls flex attention with a mask that differs between heads (0 and "
                             f"{head}): replay's attention backends take one mask for all heads")
    assert first is not None
    elements = first[:, None]
    within = causal_mask(n, m, device)
    if bool((elements & ~within).any()):
        raise UsageError(f"layer {layer} calls flex attention with a mask that lets queries see later keys: "
                         "replay's attention backends compute causal attention only")
    if not bool(elements.any(dim=-1).all()):
        raise UsageError(f"layer {layer} calls flex attention with a mask under which a query sees no key")
    keep = None if torch.equal(elements, within.expand_as(elements)) else elements
    cache["keep"] = (block_mask, (batch, heads, n, m, device), keep)
    return keep


def _blocks(block_mask: BlockMask, num_blocks: torch.Tensor, indices: torch.Tensor | None, n: int, m: int,
            device: torch.device) -> torch.Tensor:
    """Which elements one kind of block (partial or full) covers: bool [B or 1, H or 1, N, M]."""
    assert indices is not None
    rows, cols = block_mask.BLOCK_SIZE
    blocks = BlockMask.from_kv_blocks(num_blocks, indices, BLOCK_SIZE=(rows, cols), seq_lengths=(n, m),
                                      compute_q_blocks=False).to_dense().bool()
    return blocks.repeat_interleave(rows, dim=-2).repeat_interleave(cols, dim=-1)[..., :n, :m].to(device)


def _head(block_mask: BlockMask, partial: torch.Tensor, full: torch.Tensor | None, batch: int, head: int, n: int,
          m: int, device: torch.device) -> torch.Tensor:
    """Head `head`'s elements, bool [B, N, M]: its partial blocks where the mask_mod allows (evaluated at every
    batch row and this head, as flex evaluates it), and its full blocks."""
    mask_mod = block_mask.mask_mod

    def at_head(b, h, q, k):
        return mask_mod(b, h + head, q, k)

    pick = min(head, partial.shape[1] - 1)
    allowed = create_mask(at_head, batch, 1, n, m, device=device)[:, 0]
    dense = partial[:, pick] & allowed
    if full is not None:
        dense = dense | full[:, min(head, full.shape[1] - 1)]
    return dense.expand(batch, n, m)
