"""The call that replaces hand-written attention (kernels/explicit.py): without a plan, the bits of minGPT's own
five lines, forward, backward and dropout draw; under a plan, the plan's backend, counted where it ran."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from replay.kernels.baseline import baseline_attention
from replay.kernels.explicit import causal_attention
from replay.kernels.plan import AttentionPlan
from replay.kernels.reach import AttentionReach
from replay.kernels.sdpa_dispatch import sdpa_dispatch


class CausalSelfAttention(nn.Module):
    """minGPT's attention module (mingpt/model.py), with `call=True` the one-line change."""

    def __init__(self, n_embd=32, n_head=4, block_size=16, pdrop=0.1, call=False):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(pdrop)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))
        self.n_head, self.n_embd, self.call = n_head, n_embd, call

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.call:
            y = causal_attention(q, k, v, dropout=self.attn_dropout)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


def _step(module: nn.Module, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(seed)
    module.zero_grad(set_to_none=True)
    y = module(x)
    (y.float() ** 2).mean().backward()
    return y.detach(), [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_without_a_plan_the_call_is_the_hand_written_attention_bit_for_bit(autocast, training):
    torch.manual_seed(0)
    hand, call = CausalSelfAttention(), CausalSelfAttention(call=True)
    call.load_state_dict(hand.state_dict())
    hand.train(training)
    call.train(training)
    x = torch.randn(3, 16, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        (y0, g0), (y1, g1) = _step(hand, x, seed=5), _step(call, x, seed=5)   # the same dropout draw
    assert torch.equal(y0, y1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))
    if training:   # dropout drew: another seed gives other bits, so the equality above is not vacuous
        assert not torch.equal(_step(call, x, seed=6)[0], y1)


def test_under_a_plan_the_call_runs_the_plans_backend_and_is_counted():
    torch.manual_seed(0)
    model = nn.Sequential(CausalSelfAttention(pdrop=0.0, call=True))
    x = torch.randn(2, 16, 32)
    module = model[0]
    q, k, v = (t.view(2, 16, 4, 8).transpose(1, 2) for t in module.c_attn(x).split(32, dim=2))
    expected = module.c_proj(baseline_attention(q, k, v, torch.bfloat16).float().transpose(1, 2).reshape(2, 16, 32))
    reach = AttentionReach()
    with sdpa_dispatch(model, AttentionPlan.parse("baseline:dtype=bf16"), reach=reach):
        got = model(x)
    assert torch.equal(got, expected)
    assert reach.take() == {(0, h, "baseline:dtype=bf16"): 1 for h in range(4)}
    with sdpa_dispatch(model, AttentionPlan.parse("sdpa"), reach=reach):   # the model's own: untouched
        own = model(x)
    assert torch.equal(own, model(x)) and not torch.equal(own, expected)
    assert reach.take() == {(0, h, "sdpa"): 1 for h in range(4)}
