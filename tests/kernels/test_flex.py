"""Flex attention through replay's call (kernels/flex.py): without a plan, torch's flex attention with the
arguments as written; under a plan, the plan's backends with the block mask's elements as their mask.

The reference for a routed call is the same module calling SDPA with the mask written out by hand (the dispatch
of that call is tested in test_sdpa_dispatch.py): the two must give the same bits, forward and backward. torch's
own flex attention is the reference for what the mask means (forward: it has no backward on a CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex

from replay.errors import UsageError
from replay.kernels.flex import flex_attention, holds_flex, routable
from replay.kernels.plan import AttentionPlan
from replay.kernels.reach import AttentionReach
from replay.kernels.sdpa_dispatch import sdpa_dispatch

T, HEADS, EMBD = 32, 4, 32


def in_document(i):   # three packed documents in a row of 32 tokens: 0-10, 11-23, 24-31
    return (i >= 11).int() + (i >= 24).int()


def causal(b, h, q, k):
    return q >= k


def document(b, h, q, k):   # torchtitan's and the flex attention blog's document mask on top of causal
    return (q >= k) & (in_document(q) == in_document(k))


def dense(mask_mod, device="cpu") -> torch.Tensor:
    """The mask a mask_mod means, written out by hand: bool [T, T], True = attend."""
    q, k = torch.arange(T, device=device)[:, None], torch.arange(T, device=device)[None, :]
    return mask_mod(0, 0, q, k)


class Attention(nn.Module):
    """A flex-attention module of the kind torchtitan's llama3 has; `sdpa=True` calls SDPA with the same mask
    written out instead (the reference); `kv_heads` < HEADS: grouped-query attention."""

    def __init__(self, mask_mod=causal, sdpa: bool = False, kv_heads: int = HEADS, device: str = "cpu",
                 embd: int = EMBD, **flex_args):
        super().__init__()
        self.q, self.kv = nn.Linear(embd, embd), nn.Linear(embd, 2 * embd * kv_heads // HEADS)
        self.proj = nn.Linear(embd, embd)
        self.mask_mod, self.sdpa, self.kv_heads, self.flex_args = mask_mod, sdpa, kv_heads, flex_args
        self.block_mask = create_block_mask(mask_mod, None, None, T, T, device=device, BLOCK_SIZE=8)

    def forward(self, x):
        B, N, C = x.shape
        q = self.q(x).view(B, N, HEADS, C // HEADS).transpose(1, 2)
        k, v = (t.view(B, N, self.kv_heads, C // HEADS).transpose(1, 2)
                for t in self.kv(x).split(C * self.kv_heads // HEADS, dim=2))
        if self.sdpa:
            k, v = (t.repeat_interleave(HEADS // self.kv_heads, dim=1) for t in (k, v))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=dense(self.mask_mod, x.device))
        else:
            args = {"block_mask": self.block_mask, "enable_gqa": self.kv_heads != HEADS} | self.flex_args
            y = flex_attention(q, k, v, **args)
        return self.proj(y.transpose(1, 2).reshape(B, N, C))


def _pair(device: str = "cpu", **kwargs) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    flex, sdpa = (nn.Sequential(Attention(sdpa=s, device=device, **kwargs)).to(device) for s in (False, True))
    sdpa.load_state_dict(flex.state_dict())
    return flex, sdpa


def _run(model: nn.Module, x: torch.Tensor, plan: str, reach: AttentionReach | None = None):
    model.zero_grad(set_to_none=True)
    with sdpa_dispatch(model, AttentionPlan.parse(plan), reach=reach):
        y = model(x)
    (y ** 2).mean().backward()
    return y.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("mask_mod", [causal, document], ids=["causal", "document"])
@pytest.mark.parametrize("kv_heads", [HEADS, 2], ids=["mha", "gqa"])
def test_under_a_plan_the_call_runs_the_plans_backend_with_the_block_masks_elements(mask_mod, kv_heads):
    flex, sdpa = _pair(mask_mod=mask_mod, kv_heads=kv_heads)
    x = torch.randn(2, T, EMBD)
    reach = AttentionReach()
    for plan in ("baseline:dtype=bf16", "0.1=fa2-emu;0.3=reference-emu:dtype=bf16"):
        (y, grads), (y_ref, grads_ref) = _run(flex, x, plan, reach), _run(sdpa, x, plan)
        assert torch.equal(y, y_ref)
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_ref, strict=True))
    counted = reach.take()
    assert counted[(0, 0, "baseline:dtype=bf16")] == 1 and counted[(0, 3, "reference-emu:dtype=bf16")] == 1
    exact = _run_forward(flex, x, "baseline:dtype=fp64")   # what the mask means: torch's flex attention
    with torch.no_grad():
        assert torch.allclose(exact, flex(x), atol=1e-5)
    if mask_mod is document:   # the documents' bounds are in the mask: plain causal attention is another
        assert not torch.allclose(exact, _run_forward(_pair(kv_heads=kv_heads)[0], x, "baseline:dtype=fp64"),
                                  atol=1e-3)


def _run_forward(model: nn.Module, x: torch.Tensor, plan: str, reach: AttentionReach | None = None) -> torch.Tensor:
    with torch.no_grad(), sdpa_dispatch(model, AttentionPlan.parse(plan), reach=reach):
        return model(x)


def test_without_a_plan_the_call_is_the_kernel_called_as_written():
    calls = []

    def kernel(*args, **kwargs):   # the user's compiled flex attention, as the call reaches it
        calls.append(kwargs)
        return torch_flex(*args, **kwargs)

    torch.manual_seed(0)
    module = Attention(mask_mod=document, kernel=kernel)
    q, k, v = (torch.randn(2, HEADS, T, 8) for _ in range(3))
    assert torch.equal(flex_attention(q, k, v, block_mask=module.block_mask),
                       torch_flex(q, k, v, block_mask=module.block_mask))
    x = torch.randn(2, T, EMBD)
    with torch.no_grad():
        plain = module(x)
    assert len(calls) == 1 and calls[0]["block_mask"] is module.block_mask and calls[0]["enable_gqa"] is False
    reach = AttentionReach()
    untouched = _run_forward(nn.Sequential(module), x, "sdpa", reach)   # every head the model's own: the kernel's
    assert torch.equal(untouched, plain) and len(calls) == 2
    assert reach.take() == {(0, h, "sdpa"): 1 for h in range(HEADS)}


class CallAttention(nn.Module):
    """replay's flex attention call on given q, k, v, or (`sdpa`) SDPA with the mask written out: the reference."""

    def __init__(self, sdpa: bool = False):
        super().__init__()
        self.sdpa = sdpa

    def forward(self, q, k, v, mask=None, **kwargs):
        if self.sdpa:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return flex_attention(q, k, v, **kwargs)


def _call(plan: str, *args, sdpa: bool = False, **kwargs) -> torch.Tensor:
    module = CallAttention(sdpa)
    with torch.no_grad(), sdpa_dispatch(nn.Sequential(module), AttentionPlan.parse(plan)):
        return module(*args, **kwargs)


def _qkv(batch: int = 2, n: int = T, m: int = T, kv_heads: int = HEADS) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(1)
    return torch.randn(batch, HEADS, n, 8), torch.randn(batch, kv_heads, m, 8), torch.randn(batch, kv_heads, m, 8)


def test_full_blocks_are_whole_and_partial_ones_masked_by_the_mask_mod_as_flex_computes_them():
    # blocks of 8: the diagonal ones partial (the document mask within them), those below it full (every element,
    # across documents too: flex does not call the mask_mod there); written out by hand below
    below = torch.tensor([[i > j for j in range(4)] for i in range(4)])
    num, full_num = torch.ones(1, 1, 4, dtype=torch.int32), below.sum(1).int().view(1, 1, 4)
    indices = torch.arange(4).view(1, 1, 4, 1).expand(1, 1, 4, 4).contiguous().int()
    full_indices = torch.stack([torch.cat([torch.arange(i), torch.full((4 - i,), 0)]) for i in range(4)]).view(
        1, 1, 4, 4).int()
    block_mask = BlockMask.from_kv_blocks(num, indices, full_num, full_indices, BLOCK_SIZE=8, mask_mod=document)
    expected = (below.repeat_interleave(8, 0).repeat_interleave(8, 1)
                | torch.block_diag(*[torch.ones(8, 8, dtype=torch.bool)] * 4) & dense(document))
    q, k, v = _qkv()
    routed = _call("baseline:dtype=fp64", q, k, v, block_mask=block_mask)
    assert torch.equal(routed, _call("baseline:dtype=fp64", q, k, v, expected, sdpa=True))
    assert not torch.equal(routed, _call("baseline:dtype=fp64", q, k, v, dense(document), sdpa=True))


def test_a_mask_of_each_batch_row_and_one_that_does_not_divide_into_blocks():
    def rows(b, h, q, k):   # row b's first document ends at 11 + 5 b
        return (q >= k) & ((q >= 11 + 5 * b) == (k >= 11 + 5 * b))

    q, k, v = _qkv()
    per_row = torch.stack([dense(lambda _, h, i, j, b=b: rows(b, h, i, j)) for b in range(2)])[:, None]
    block_mask = create_block_mask(rows, None, None, T, T, device="cpu", BLOCK_SIZE=8)   # B=None: evaluated per row
    routed = _call("baseline:dtype=fp64", q, k, v, block_mask=block_mask)
    assert torch.equal(routed, _call("baseline:dtype=fp64", q, k, v, per_row, sdpa=True))
    assert torch.allclose(routed, torch_flex(q, k, v, block_mask=block_mask), atol=1e-5)
    q, k, v = _qkv(n=30, m=30)   # blocks of 8 over 30 tokens: the last ones cut
    block_mask = create_block_mask(document, None, None, 30, 30, device="cpu", BLOCK_SIZE=8)
    routed = _call("baseline:dtype=fp64", q, k, v, block_mask=block_mask)
    assert torch.allclose(routed, torch_flex(q, k, v, block_mask=block_mask), atol=1e-5)


def by_head(b, h, q, k):   # head 0 sees every earlier key, the others not the first
    return (q >= k) & ((h == 0) | (k > 0) | (q == 0))


def _mask(mask_mod=causal, batch=None, n=T, m=T):
    return create_block_mask(mask_mod, batch, None, n, m, device="cpu", BLOCK_SIZE=8)


@pytest.mark.parametrize(("shapes", "kwargs", "expected"), [
    ({}, {"score_mod": lambda score, b, h, q, k: score * 0.5}, "with score_mod"),
    ({}, {"return_lse": True}, "with return_lse"),
    ({}, {"return_aux": AuxRequest(lse=True)}, "with return_aux=lse"),
    ({}, {"block_mask": None}, "without a block mask"),
    ({}, {"block_mask": _mask(lambda b, h, q, k: in_document(q) == in_document(k))}, "see later keys"),
    ({}, {"block_mask": _mask(by_head)}, "differs between heads"),
    ({}, {"block_mask": _mask(lambda b, h, q, k: (q >= k) & (k > 0))}, "sees no key"),
    ({}, {"block_mask": _mask(causal, batch=3)}, "block mask for batch 3"),
    ({}, {"block_mask": _mask(causal, n=64, m=64)}, "for 64 queries and 64 keys, and 32 queries"),
    ({"kv_heads": 2}, {"block_mask": _mask()}, "or enable_gqa=True"),
], ids=["score_mod", "lse", "aux-lse", "no-mask", "not-causal", "by-head", "no-key", "batch", "length", "gqa"])
def test_what_the_backends_cannot_compute_is_refused_in_one_line(shapes, kwargs, expected):
    q, k, v = _qkv(**shapes)
    with pytest.raises(UsageError, match=expected) as raised:
        _call("baseline", q, k, v, **({"block_mask": _mask()} | kwargs))
    assert "\n" not in str(raised.value) and "layer 0" in str(raised.value)
    if "score_mod" in kwargs:   # on a layer left to the model's own attention the call runs as written
        assert _call("sdpa", q, k, v, **({"block_mask": _mask()} | kwargs)).shape == q.shape


class FlexAttention(nn.Module):   # torchtitan 0.3's: a compiled flex attention as a class variable, aux asked for
    _compiled_flex_attn = torch.compile(torch_flex)

    def forward(self, q, block_mask):
        out, aux = FlexAttention._compiled_flex_attn(q, q, q, block_mask=block_mask, return_aux=AuxRequest(lse=False))
        assert aux.lse is None
        return out


def test_a_module_calling_torchs_flex_attention_is_named_with_its_one_line_change():
    block_mask = create_block_mask(causal, None, None, T, T, device="cpu", BLOCK_SIZE=8)
    assert holds_flex(FlexAttention()) and not holds_flex(nn.MultiheadAttention(8, 2))
    compiled = FlexAttention._compiled_flex_attn
    model, reach = nn.Sequential(FlexAttention()), AttentionReach()
    q = torch.randn(1, HEADS, T, 8)
    try:
        FlexAttention._compiled_flex_attn = torch_flex   # eager: the same call, without compiling it here
        assert holds_flex(FlexAttention())
        with torch.no_grad(), sdpa_dispatch(model, AttentionPlan.parse("baseline"), reach=reach):
            model[0](q, block_mask)   # torch's own call: no plan sees it
        assert reach.take() == {} and "routable(kernel)" in reach.unreached_hint()
        FlexAttention._compiled_flex_attn = routable(torch_flex)   # the one line
        with torch.no_grad(), sdpa_dispatch(model, AttentionPlan.parse("baseline"), reach=reach):
            routed = model[0](q, block_mask)
        assert reach.take() == {(0, h, "baseline"): 1 for h in range(HEADS)}
        with torch.no_grad():
            assert torch.allclose(routed, torch_flex(q, q, q, block_mask=block_mask), atol=1e-5)
    finally:
        FlexAttention._compiled_flex_attn = compiled


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: torch's flex attention trains on one only")
def test_on_a_gpu_the_call_trains_as_torchs_compiled_flex_attention_and_routes_as_sdpa():
    kernel = torch.compile(torch_flex)
    flex, sdpa = _pair("cuda", mask_mod=document, embd=64, kernel=kernel)   # heads of 16: Triton's smallest dot
    flex[0].block_mask = create_block_mask(document, None, None, T, T, device="cuda")   # blocks of 128: Triton's
    x = torch.randn(2, T, 64, device="cuda")
    own, own_grads = _run(flex, x, "sdpa")   # every head the model's own: torch's kernel, forward and backward
    flex.zero_grad(set_to_none=True)
    q, k, v = (torch.randn(2, HEADS, T, 16, device="cuda", requires_grad=True) for _ in range(3))
    block_mask = flex[0].block_mask
    ours = flex_attention(q, k, v, block_mask=block_mask, kernel=kernel)
    theirs = kernel(q, k, v, block_mask=block_mask)
    assert torch.equal(ours, theirs)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(ours.sum(), (q, k, v)),
                                                 torch.autograd.grad(theirs.sum(), (q, k, v)), strict=True))
    for plan in ("baseline:dtype=bf16", "0.1=fa2-emu;0.3=reference-emu:dtype=bf16"):
        (y, grads), (y_ref, grads_ref) = _run(flex, x, plan), _run(sdpa, x, plan)
        assert torch.equal(y, y_ref) and all(torch.equal(a, b) for a, b in zip(grads, grads_ref, strict=True))
        assert not torch.equal(y, own)
    assert torch.allclose(_run_forward(flex, x, "baseline:dtype=fp64"), own, atol=1e-4)


def test_a_module_holding_flex_that_computed_attention_by_hand_is_told_of_the_hand_written_change():
    reach = AttentionReach()
    reach.entered(0, "attn", "Attention", flex=True)
    reach.called(0, "softmax")
    assert "causal_attention(q, k, v" in reach.unreached_hint() and "routable" not in reach.unreached_hint()
