"""GPT-2 running on per-layer / per-head attention plans through transformers."""

import pytest
import torch

from replay.config import ModelConfig
from replay.kernels.flash_emu import flash_attention
from replay.kernels.plan import AttentionPlan
from replay.kernels.registry import LayerAttention
from replay.train.model import build_model, lm_loss


def test_each_head_group_gets_exactly_its_backend():
    plan = AttentionPlan.parse("baseline:dtype=fp32;0.1-2=reference-emu:br=16,bc=16")
    layer = LayerAttention(plan, layer=0, n_head=4)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 24, 8, generator=g).bfloat16() for _ in range(3))
    out = layer(None, q, k, v, None, 8 ** -0.5)
    alone = flash_attention(q[:, 1:3], k[:, 1:3], v[:, 1:3], plan.backend_for(0, 1).options, causal=True)
    assert torch.equal(out[:, 1:3], alone)
    from replay.kernels.baseline import baseline_attention

    rest = baseline_attention(q[:, [0, 3]], k[:, [0, 3]], v[:, [0, 3]], torch.float32).bfloat16()
    assert torch.equal(out[:, [0, 3]], rest)


def test_values_wider_than_the_keys_reach_baseline_and_are_refused_in_one_line_by_the_emulations():
    from replay.errors import UsageError
    from replay.kernels.baseline import baseline_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 24, 8, generator=g), torch.randn(2, 4, 24, 8, generator=g), torch.randn(
        2, 4, 24, 16, generator=g)   # values of 16 for heads of 8 (DeepSeek's MLA has such)
    out = LayerAttention(AttentionPlan.parse("baseline;0.1=baseline:dtype=bf16"), layer=0, n_head=4)(
        None, q, k, v, None, 8 ** -0.5)
    assert out.shape == (2, 4, 24, 16)
    assert torch.equal(out[:, [0, 2, 3]], baseline_attention(q[:, [0, 2, 3]], k[:, [0, 2, 3]], v[:, [0, 2, 3]],
                                                             torch.float32, scale=8 ** -0.5))
    with pytest.raises(UsageError, match="values as wide as the queries") as raised:
        LayerAttention(AttentionPlan.parse("baseline;0.1=fa2-emu"), layer=0, n_head=4)(None, q, k, v, None, 8 ** -0.5)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("autocast", [False, True])
def test_eager_through_the_dispatcher_is_bitwise_transformers_eager(autocast):
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    builtin = build_model(ModelConfig(n_head=4), 256, seed=0)
    routed = build_model(ModelConfig(n_head=4, attention="eager;1.2=eager"), 256, seed=0)
    assert routed.config._attn_implementation == "replay" and builtin.config._attn_implementation == "eager"
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        assert torch.equal(builtin(input_ids=x).logits, routed(input_ids=x).logits)


def test_gpt2_trains_with_backends_on_layers_and_heads():
    plan = "sdpa;0=fa2-emu:br=16,bc=16;1.0=reference-emu:fix=safe-softmax,beta=7;1.3=baseline:dtype=bf16"
    model = build_model(ModelConfig(n_head=4, attention=plan), 256, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randint(0, 256, (4, 32), generator=g), torch.randint(0, 256, (4, 32), generator=g)
    losses = []
    for _ in range(5):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model, x, y)
        opt.zero_grad()
        loss.backward()
        for block in model.transformer.h:   # gradients reach every layer's attention through its backends
            grad = block.attn.c_attn.weight.grad
            assert grad is not None and grad.abs().sum() > 0 and torch.isfinite(grad).all()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_padding_masks_reach_the_backends():
    """Left padding: with the mask, valid positions match eager; the backends really see the mask."""
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, :6] = 0
    eager = build_model(ModelConfig(n_head=4), 256, seed=0)
    emu = build_model(ModelConfig(n_head=4, attention="fa2-emu:br=8,bc=8"), 256, seed=0)
    a = eager(input_ids=ids, attention_mask=mask).logits
    b = emu(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(a[0, 6:], b[0, 6:], atol=1e-4) and torch.allclose(a[1], b[1], atol=1e-4)
    unmasked = emu(input_ids=ids).logits
    assert not torch.allclose(unmasked[0, 6:], b[0, 6:], atol=1e-2)   # the padding made a difference


def _loss_and_grads(model, x, seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss = lm_loss(model, x, x)
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_gpt2_with_attention_dropout_trains_deterministically_on_a_mixed_plan():
    """GPT-2 with dropout 0.1 (attention included) on backends per layer and head, in training: the same
    RNG state gives the same loss and gradients, another state others; in eval mode no dropout is drawn."""
    plan = "sdpa;0=fa2-emu:br=16,bc=16;1.0=reference-emu:br=8,bc=8;1.3=baseline:dtype=bf16"
    model = build_model(ModelConfig(n_head=4, dropout=0.1, attention=plan), 256, seed=0).train()
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    first, again, other = (_loss_and_grads(model, x, seed) for seed in (3, 3, 4))
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], other[0]) and torch.isfinite(first[0])
    model.eval()
    assert torch.equal(_loss_and_grads(model, x, 3)[0], _loss_and_grads(model, x, 4)[0])
