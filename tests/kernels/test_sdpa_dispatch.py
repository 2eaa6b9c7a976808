"""Attention plans on a model of one's own that calls SDPA: a nanoGPT-style GPT written here, unchanged.

The reference for each backend is the same model with `F.scaled_dot_product_attention` replaced, in the
module that calls it, by the backend called directly (a test double of the call site, not of the
backend): the dispatch must give those bits exactly, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from replay.errors import UsageError
from replay.kernels.flash_emu import flash_attention
from replay.kernels.options import AttentionOptions, SafeSoftmaxFix
from replay.kernels.plan import AttentionPlan
from replay.kernels.sdpa_dispatch import attention_modules, sdpa_dispatch


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, mask: str | dict = "causal"):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.n_head, self.mask = n_head, mask

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.mask == "causal":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.mask == "bool":   # padding on top of causal, as a boolean mask
            keep = torch.ones(T, T, dtype=torch.bool).tril()
            keep = keep.expand(B, 1, T, T).clone()
            keep[0, :, :, :3] = False
            keep[0, :, :3, 0] = True   # the first rows keep one key each
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        else:                       # the arguments of a call that breaks a rule of the backends
            y = F.scaled_dot_product_attention(q, k, v, **self.mask)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, mask: str | dict):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, mask)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, n_layer=2, n_head=4, n_embd=64, vocab=50, block=32, mask="causal"):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, n_embd), wpe=nn.Embedding(block, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head, mask) for _ in range(n_layer)]), ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx):
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1]))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def _model(mask: str | dict = "causal") -> tuple[GPT, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(mask=mask).bfloat16()
    return model, torch.randint(0, 50, (2, 32), generator=torch.Generator().manual_seed(1))


def _forward_backward(model, idx) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    logits = model(idx)
    logits.float().square().mean().backward()
    return [logits.detach()] + [p.grad.clone() for p in model.parameters()]


def _by_hand(model, idx, replace: dict[int, AttentionOptions], monkeypatch) -> list[torch.Tensor]:
    """The reference: layer i's SDPA call replaced by `flash_attention` with `replace[i]`, in its module."""
    import sys

    calls = iter(range(10 ** 6))

    def patched(q, k, v, attn_mask=None, is_causal=False, dropout_p=0.0, **_):
        layer = next(calls) % len(model.transformer.h)
        if layer not in replace:
            return SDPA(q, k, v, attn_mask=attn_mask, is_causal=is_causal, dropout_p=dropout_p)
        with torch.autocast("cpu", enabled=False):
            mask = None if attn_mask is None else attn_mask & torch.ones_like(attn_mask).tril()
            return flash_attention(q, k, v, replace[layer], causal=True, mask=mask, dropout=dropout_p)

    monkeypatch.setattr(sys.modules[__name__].F, "scaled_dot_product_attention", patched)
    try:
        return _forward_backward(model, idx)
    finally:
        monkeypatch.undo()


SDPA = F.scaled_dot_product_attention


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_finds_the_attention_modules_by_name_or_by_pattern():
    model, _ = _model()
    assert [name for name, _ in attention_modules(model)] == ["transformer.h.0.attn", "transformer.h.1.attn"]
    assert [name for name, _ in attention_modules(model, "transformer.h.*.attn")] == ["transformer.h.0.attn",
                                                                                     "transformer.h.1.attn"]
    with pytest.raises(UsageError, match=r"no module of the model matches 'h\.\*\.attention'"):
        attention_modules(model, "h.*.attention")


def test_an_all_sdpa_plan_changes_no_bit():
    model, idx = _model()
    plain = _forward_backward(model, idx)
    with sdpa_dispatch(model, AttentionPlan.parse("sdpa")):
        assert _equal(_forward_backward(model, idx), plain)


@pytest.mark.parametrize("mask", ["causal", "bool"])
def test_one_layer_on_an_emulated_backend_is_that_backend_exactly(mask, monkeypatch):
    model, idx = _model(mask)
    opts = AttentionOptions(placement="reference", block_r=16, block_c=16, fix=SafeSoftmaxFix(7.0))
    with sdpa_dispatch(model, AttentionPlan.parse("sdpa;1=reference-emu:fix=safe-softmax,br=16,bc=16")):
        got = _forward_backward(model, idx)
    want = _by_hand(model, idx, {1: opts}, monkeypatch)
    plain = _forward_backward(model, idx)
    assert _equal(got, want) and not _equal(got, plain)
    assert torch.isfinite(got[0]).all()


def test_per_head_plans_split_the_heads(monkeypatch):
    """Heads 1-2 of layer 0 on fa2-emu, the rest sdpa: those heads' outputs are the emulation's, the others
    PyTorch's, read before the heads are mixed by the output projection."""
    model, idx = _model()
    attn = model.transformer.h[0].attn
    seen = {}
    attn.c_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("y", a[0].detach().clone()))
    with sdpa_dispatch(model, AttentionPlan.parse("sdpa;0.1-2=fa2-emu")):
        model(idx)
    mixed = seen["y"].view(2, 32, 4, 16)
    model(idx)
    plain = seen["y"].view(2, 32, 4, 16)
    _by_hand(model, idx, {0: AttentionOptions()}, monkeypatch)
    emulated = seen["y"].view(2, 32, 4, 16)
    assert torch.equal(mixed[:, :, [0, 3]], plain[:, :, [0, 3]])
    assert torch.equal(mixed[:, :, 1:3], emulated[:, :, 1:3]) and not torch.equal(mixed, plain)


def test_hooks_and_mode_are_gone_after_the_context():
    model, idx = _model()
    plain = _forward_backward(model, idx)
    with pytest.raises(RuntimeError, match="inside"):
        with sdpa_dispatch(model, AttentionPlan.parse("fa2-emu")):
            raise RuntimeError("inside")
    assert _equal(_forward_backward(model, idx), plain)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


DROPOUT = dict(is_causal=True, dropout_p=0.2)   # nanoGPT's call in training, at shakespeare_char's dropout


def _seeded(seed: int, model, idx) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    return _forward_backward(model, idx)


def test_under_dropout_an_all_sdpa_plan_is_the_models_own_call_bit_for_bit():
    model, idx = _model(DROPOUT)
    plain = _seeded(5, model, idx)
    assert not _equal(_seeded(6, model, idx), plain)   # the dropout is on: the RNG state matters
    with sdpa_dispatch(model, AttentionPlan.parse("sdpa")):
        assert _equal(_seeded(5, model, idx), plain)


def test_under_dropout_a_layer_on_the_emulation_is_that_backend_with_dropout(monkeypatch):
    """Layer 1 on the emulation, layer 0 on SDPA, dropout 0.2 in both: the bits of the model whose layer 1
    calls `flash_attention(..., dropout=0.2)` in SDPA's place, from the same RNG state; the same bits twice,
    others from another state."""
    model, idx = _model(DROPOUT)
    opts = AttentionOptions(block_r=16, block_c=16)
    with sdpa_dispatch(model, AttentionPlan.parse("sdpa;1=fa2-emu:br=16,bc=16")):
        got, again, other = _seeded(5, model, idx), _seeded(5, model, idx), _seeded(6, model, idx)
    torch.manual_seed(5)
    want = _by_hand(model, idx, {1: opts}, monkeypatch)
    assert _equal(got, want) and _equal(got, again) and not _equal(got, other)
    assert not _equal(got, _seeded(5, model, idx))   # the emulation ran: not SDPA's own result


def test_under_dropout_heads_split_between_backends_are_deterministic():
    model, idx = _model(DROPOUT)
    with sdpa_dispatch(model, AttentionPlan.parse("sdpa;0.1-2=fa2-emu:br=16,bc=8;1.3=baseline")):
        got, again, other = _seeded(5, model, idx), _seeded(5, model, idx), _seeded(6, model, idx)
    assert _equal(got, again) and not _equal(got, other)
    assert all(torch.isfinite(t).all() for t in got)


@pytest.mark.parametrize("call, message", [
    ({}, "without is_causal=True or a mask"),
    (dict(attn_mask=torch.ones(32, 32, dtype=torch.bool)), "lets queries see later keys"),
    (dict(attn_mask=torch.zeros(32, 32).fill_diagonal_(0.5)), "additive mask"),
    (dict(attn_mask=torch.ones(2, 4, 32, 32, dtype=torch.bool).tril()), "one mask for all heads"),
], ids=["not-causal", "future-keys", "additive", "per-head-mask"])
def test_calls_the_backends_cannot_take_are_refused_in_one_line(call, message):
    model, idx = _model(call)
    with pytest.raises(UsageError, match=message):
        with sdpa_dispatch(model, AttentionPlan.parse("fa2-emu")):
            model(idx)


def test_a_plan_beyond_the_model_is_refused_before_anything_runs():
    model, _ = _model()
    with pytest.raises(UsageError, match="targets layer 2"):
        with sdpa_dispatch(model, AttentionPlan.parse("sdpa;2=fa2-emu")):
            pass
    with pytest.raises(UsageError, match="targets layer 1 head 4"):
        with sdpa_dispatch(model, AttentionPlan.parse("sdpa;1.4=fa2-emu")):
            model(torch.zeros(1, 8, dtype=torch.long))   # the heads are known once a call shows them
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


class _Call(nn.Module):
    """An attention module that calls SDPA as given (`fn(q, k, v)`), for the cases below."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, q, k, v):
        return self.fn(q, k, v)


def test_fewer_queries_than_keys_follow_pytorchs_causal_alignment():
    """SDPA's is_causal aligns the mask to the top left (query i sees keys 0..i) when there are fewer
    queries than keys; the dispatch passes the backends that mask, and refuses more queries than keys."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 4, 16, generator=g)
    k, v = torch.randn(1, 2, 8, 16, generator=g), torch.randn(1, 2, 8, 16, generator=g)
    model = nn.ModuleDict(dict(attn=_Call(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True))))
    plain = model.attn(q, k, v)
    with sdpa_dispatch(model, AttentionPlan.parse("fa2-emu:dtype=fp32,br=16,bc=16")):
        dispatched = model.attn(q, k, v)
    assert torch.allclose(dispatched, plain, atol=1e-5)
    with pytest.raises(UsageError, match="8 queries for 4 keys"):
        with sdpa_dispatch(model, AttentionPlan.parse("fa2-emu")):
            model.attn(k, q, q)


def test_under_autocast_the_backends_get_the_autocast_precision():
    """A model that upcasts q and k (as rotary embeddings do) and calls SDPA under BF16 autocast: SDPA
    computes in BF16, and so do the backends."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, 32, 16, generator=g) for _ in range(3))
    model = nn.ModuleDict(dict(attn=_Call(
        lambda a, b, c: F.scaled_dot_product_attention(a.float(), b.float(), c.bfloat16(), is_causal=True))))
    with torch.autocast("cpu", torch.bfloat16), sdpa_dispatch(model, AttentionPlan.parse("fa2-emu")):
        dispatched = model.attn(q, k, v)
    want = flash_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), AttentionOptions(), causal=True)
    assert dispatched.dtype == torch.bfloat16 and torch.equal(dispatched, want)


def test_an_attention_forward_that_raises_leaves_no_layer_behind():
    """After an attention module raised (and the caller carried on), SDPA outside the attention modules is
    PyTorch's again, not that layer's."""
    def failing(q, k, v):
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        raise MemoryError("out of memory, say")

    model = nn.ModuleDict(dict(attn=_Call(failing)))
    q = torch.randn(1, 1, 8, 16)
    with sdpa_dispatch(model, AttentionPlan.parse("fa2-emu")):
        with pytest.raises(MemoryError):
            model.attn(q, q, q)
        bidirectional = F.scaled_dot_product_attention(q, q, q)   # not causal: refused inside a layer
    assert torch.equal(bidirectional, F.scaled_dot_product_attention(q, q, q))
