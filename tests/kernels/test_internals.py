"""kernels/internals.py: the S and P an attention call hands a watcher. The flash emulation's and baseline's:
tests/kernels/test_flash_emu.py; transformers' eager attention's here."""

import math

import pytest
import torch
from transformers.models.gpt2.modeling_gpt2 import eager_attention_forward

from replay.config import ModelConfig
from replay.kernels import internals
from replay.train.model import build_model

MIN = torch.finfo(torch.float32).min


def _inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 3, 24, 8, generator=g) for _ in range(3))


@pytest.mark.parametrize("autocast", [False, True])
def test_eager_attention_hands_out_its_softmax_input_and_computes_the_same(autocast):
    """S is the scaled scores (within FP32's or BF16's rounding of the FP64 ones), -inf where the additive mask
    is not 0; the softmax of S is the P eager returns, bit for bit (no dropout); the call's output is the
    unwatched call's bit for bit."""
    q, k, v = _inputs()
    keep = torch.ones(24, 24, dtype=torch.bool).tril()
    keep[:, 0] = False   # a padded first key too
    keep[0, 0] = True
    additive = torch.where(keep, 0.0, MIN)
    module = torch.nn.Module().eval()
    call = lambda: eager_attention_forward(module, q, k, v, additive, scaling=8 ** -0.5)   # noqa: E731
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        plain = call()
        (out, weights), s = internals.eager_scores(call, additive)
    assert torch.equal(out, plain[0]) and torch.equal(weights, plain[1])
    assert s is not None and s.shape == (2, 3, 24, 24)
    assert torch.isinf(s[..., ~keep]).all() and torch.isfinite(s[..., keep]).all()
    exact = (q.double() @ k.double().transpose(-1, -2)) * 8 ** -0.5
    unit = 2.0 ** -8 if autocast else 2.0 ** -23
    assert ((s.double() - exact)[..., keep].abs() <= 4 * unit * exact.abs().amax()).all()
    assert torch.equal(torch.softmax(s.float(), dim=-1).to(weights.dtype), weights)


def test_eager_heads_of_a_plan_hand_out_s_and_p_and_the_model_computes_the_same():
    """Heads of a plan on `eager` (through replay's attention dispatcher) give the watcher their S and P for
    exactly those heads; watched, the model's logits are the unwatched ones bit for bit."""
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    model = build_model(ModelConfig(n_head=4, attention="sdpa;1.1-2=eager"), 256, seed=0).eval()
    handed = []
    plain = model(input_ids=x).logits
    with internals.watching(lambda heads, s, p: handed.append((heads, s, p))):
        watched = model(input_ids=x).logits
    assert torch.equal(plain, watched)
    assert [h for h, _, _ in handed] == [[1, 2]]
    _, s, p = handed[0]
    assert s.shape == p.shape == (2, 2, 16, 16)
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    assert torch.isinf(s[..., ~causal]).all() and (p[..., ~causal] == 0).all()
    assert torch.equal(torch.softmax(s, dim=-1), p)
    assert math.isclose(p.sum(-1).mean().item(), 1.0, rel_tol=1e-6)
