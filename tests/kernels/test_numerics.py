"""The numerics probe against quantities recomputed here from the model's own Q, K and gradients."""

import numpy as np
import pytest
import torch

from replay.config import ModelConfig
from replay.errors import UsageError
from replay.kernels.numerics import NumericsProbe
from replay.kernels.plan import AttentionPlan, check_numerics
from replay.kernels.registry import apply_plan
from replay.train.model import build_model, lm_loss

CFG = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=48)


def _model(attention: str):
    return build_model(ModelConfig(**{**vars(CFG), "attention": attention}), 64, seed=3)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (4, CFG.block_size), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _step(model, probe, seed=0):
    """One BF16 forward/backward with the probe collecting; returns (its numbers, W_Q gradient per layer)."""
    model.zero_grad(set_to_none=True)
    x, y = _batch(seed)
    with probe.collecting(), torch.autocast("cpu", dtype=torch.bfloat16):
        lm_loss(model, x, y).backward()
    E = CFG.n_embd
    return probe.end_step(), [b.attn.c_attn.weight.grad[:, :E].double().clone() for b in model.transformer.h]


def _bf16_scores(model, x) -> list[torch.Tensor]:
    """Each layer's S = Q K^T * scale as the reference placement holds it (BF16), from c_attn's output."""
    outs = []
    hooks = [b.attn.c_attn.register_forward_hook(lambda m, a, out: outs.append(out.detach()))
             for b in model.transformer.h]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=x)
    for h in hooks:
        h.remove()
    B, N, E, H = x.shape[0], x.shape[1], CFG.n_embd, CFG.n_head
    d = E // H
    scores = []
    for out in outs:
        q = out[..., :E].reshape(B, N, H, d).transpose(1, 2).to(torch.bfloat16)
        k = out[..., E:2 * E].reshape(B, N, H, d).transpose(1, 2).to(torch.bfloat16)
        s = (q @ k.transpose(-1, -2)) * d ** -0.5
        scores.append(s.masked_fill(~torch.ones(N, N, dtype=torch.bool).tril(), float("-inf")))
    return scores


def test_tied_rate_counts_rows_whose_bf16_max_repeats():
    model = _model("reference-emu")
    probe = NumericsProbe(model)
    numbers, _ = _step(model, probe)
    x, _ = _batch()
    for layer, s in enumerate(_bf16_scores(model, x)):
        top = s.amax(-1, keepdim=True)
        expected = ((s == top).sum(-1) > 1).double().mean().item()
        assert numbers["tied_rate"][layer] == pytest.approx(expected, abs=1e-12)
    assert (numbers["tied_rate"] > 0).all(), "BF16 scores of a fresh model tie somewhere in 384 rows"


def test_hp_delta_has_no_delta_error_and_the_reference_placement_has_one():
    plain, exact = _model("reference-emu"), _model("reference-emu:hp-delta")
    got, _ = _step(plain, NumericsProbe(plain))
    none, _ = _step(exact, NumericsProbe(exact))
    assert (none["delta_err"] == 0).all() and (none["wq_err_norm"] == 0).all()
    assert (got["delta_err"] != 0).all() and (got["wq_err_norm"] > 0).all()


@pytest.mark.parametrize("heads", [[0, 1], [1]])
def test_wq_error_is_the_w_q_gradient_of_the_delta_error(heads):
    """An error e in delta changes dS by -e_i P_ij: the gradient, with respect to S, of
    -sum_i e_i logsumexp(S_i). So the W_Q gradient error is autograd's gradient of that function through
    S = scale * (X W_Q) K^T, with K held fixed: computed here in FP64 and compared with the probe's."""
    torch.manual_seed(0)
    B, N, E, H = 2, 12, CFG.n_embd, CFG.n_head
    d, scale = E // H, (E // H) ** -0.5
    x = torch.randn(B, N, E, dtype=torch.float64)
    w_q = torch.randn(E, E, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, len(heads), N, d, dtype=torch.float64)
    e = torch.randn(B, len(heads), N, dtype=torch.float64)
    q = (x @ w_q).reshape(B, N, H, d).transpose(1, 2)[:, heads]
    tied = torch.rand(B, len(heads), N) < 0.3
    keep = torch.ones(N, N, dtype=torch.bool).tril()
    s = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~keep, float("-inf"))
    expected_tied = torch.autograd.grad(-(e * tied * torch.logsumexp(s, dim=-1)).sum(), w_q, retain_graph=True)[0]
    (-(e * torch.logsumexp(s, dim=-1)).sum()).backward()

    probe = NumericsProbe(_model("reference-emu"))
    probe._inputs[0] = x.float()
    G = B * len(heads)
    def flat(t):
        return t.detach().reshape(G, *t.shape[2:]).float()
    probe.delta_error(0, heads, torch.Size([B, len(heads)]), flat(q), flat(k), keep, scale,
                      flat(e), torch.zeros(G, N), tied.reshape(G, N))
    got = probe.wq_err[0]
    assert torch.allclose(got, w_q.grad, rtol=1e-4, atol=1e-5 * float(w_q.grad.abs().max()))
    assert torch.allclose(probe.wq_tied_err[0], expected_tied, rtol=1e-4, atol=1e-5 * float(expected_tied.abs().max()))
    untouched = [h for h in range(H) if h not in heads]
    for h in untouched:
        assert (got[:, h * d:(h + 1) * d] == 0).all()


def test_successive_cosine_compares_with_the_previous_step():
    model = _model("reference-emu")
    probe = NumericsProbe(model)
    first, _ = _step(model, probe, seed=0)
    a = probe.last_wq_err[0].clone()
    second, _ = _step(model, probe, seed=0)   # the same batch and weights: the same error
    b = probe.last_wq_err[0]
    assert np.isnan(first["wq_err_cos"]).all() and np.isnan(first["wq_tied_err_cos"]).all()
    assert torch.equal(a, b)
    assert second["wq_err_cos"] == pytest.approx(1.0)
    third, _ = _step(model, probe, seed=1)
    assert (third["wq_err_cos"] < 1 - 1e-6).all()


def test_probe_leaves_the_computation_bitwise_unchanged():
    watched, bare = _model("reference-emu"), _model("reference-emu")
    _, g_watched = _step(watched, NumericsProbe(watched))
    bare.zero_grad(set_to_none=True)
    x, y = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lm_loss(bare, x, y).backward()
    for p, q in zip(watched.parameters(), bare.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_plans_the_probe_cannot_read_are_refused():
    with pytest.raises(UsageError, match="layer 1 head 0 uses 'eager'"):
        check_numerics(AttentionPlan.parse("reference-emu;1=eager"), 2, 2)
    check_numerics(AttentionPlan.parse("reference-emu;1.1=fa2-emu"), 2, 2)
    model = _model("eager")
    apply_plan(model, AttentionPlan.parse("fa2-emu"))
    numbers, _ = _step(model, NumericsProbe(model))
    assert np.isfinite(numbers["delta_err"]).all()

