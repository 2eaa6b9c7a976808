"""Attention dropout in replay's own backends (kernels/dropout.py): baseline, the flash emulation with two
tilings and both placements here; triton-fa2 runs the same checks under the Triton interpreter
(test_triton_fa2_integration.py). The checks are functions of a backend, so both files share them.

The expectation check reads the dropped probabilities off the output: with V the identity (d = M), the
output is the dropped, rescaled probability matrix itself, Z * P / (1 - p), so an entry is dropped exactly
where the output is 0 (every attended P is > 0 for these scores)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from replay.errors import UsageError
from replay.kernels import plan
from replay.kernels.baseline import baseline_attention, causal_mask
from replay.kernels.flash_emu import flash_attention
from replay.kernels.options import AttentionOptions
from replay.kernels.plan import AttentionPlan
from replay.kernels.registry import LayerAttention

P = 0.3
UNIT = 2.0 ** -8   # BF16's unit roundoff

Backend = Callable[..., torch.Tensor]   # (q, k, v, **{"dropout": p}) -> O, causal


def emulation(placement: str, block_r: int, block_c: int) -> Backend:
    opts = AttentionOptions(placement=placement, block_r=block_r, block_c=block_c)
    return lambda q, k, v, **kw: flash_attention(q, k, v, opts, causal=True, **kw)


BACKENDS: dict[str, Backend] = {
    "baseline": lambda q, k, v, **kw: baseline_attention(q, k, v, torch.bfloat16, causal=True, **kw),
    "fa2-emu-16x8": emulation("fa2", 16, 8),
    "fa2-emu-32x32": emulation("fa2", 32, 32),
    "reference-emu-16x16": emulation("reference", 16, 16),
}


def inputs(d: int = 16, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k, v, dO: [2, 4, 32, d] in BF16."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 4, 32, d, generator=g).bfloat16() for _ in range(4))


def run(fn: Backend, q, k, v, do, seed: int | None, **kw) -> list[torch.Tensor]:
    """O, dQ, dK, dV of one call, torch's RNG seeded with `seed` first (None: left as it is)."""
    if seed is not None:
        torch.manual_seed(seed)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, **kw)
    out.backward(do)
    return [out.detach()] + [t.grad for t in leaves]


def identity_values(q: torch.Tensor) -> torch.Tensor:
    """V = I per slice (d = N = M): the output is the attention matrix each slice used."""
    n = q.shape[-2]
    return torch.eye(n, dtype=q.dtype).expand(*q.shape[:-2], n, n)


# -- the checks, shared with the interpreter run of triton-fa2 ------------------------------------

def check_same_rng_state_same_result(fn: Backend) -> None:
    q, k, v, do = inputs()
    first, again = run(fn, q, k, v, do, 1, dropout=P), run(fn, q, k, v, do, 1, dropout=P)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    other = run(fn, q, k, v, do, 2, dropout=P)
    assert not torch.equal(first[0], other[0])


def check_zero_dropout_is_the_undropped_path(fn: Backend) -> None:
    """p = 0 gives the bits of a call without dropout, and draws nothing from the generator."""
    q, k, v, do = inputs()
    torch.manual_seed(3)
    state = torch.get_rng_state()
    zero = run(fn, q, k, v, do, None, dropout=0.0)
    assert torch.equal(torch.get_rng_state(), state)
    plain = run(fn, q, k, v, do, None)
    assert all(torch.equal(a, b) for a, b in zip(zero, plain, strict=True))
    assert not torch.equal(run(fn, q, k, v, do, 3, dropout=P)[0], plain[0])


def check_expectation_and_drop_rate(fn: Backend, draws: int = 50) -> None:
    """Over `draws` calls on 8 slices that share q and k: every kept entry is the undropped one times
    1 / (1 - p) (within 3u, BF16 rounding of both); the mean output approaches the undropped one entrywise
    within 6 standard deviations, sigma = P_ij sqrt(p / ((1 - p) n)) for n samples of the Bernoulli-scaled
    entry Z P_ij / (1 - p), plus 3u P_ij; and the dropped fraction of the attended entries is within 5
    binomial standard deviations of p."""
    q, k, _, _ = inputs(d=32, seed=5)
    q, k = q[:1, :1].expand_as(q), k[:1, :1].expand_as(k)   # one attention matrix, 8 independent masks
    v = identity_values(q)
    undropped = fn(q, k, v).float()[0, 0]
    attended = causal_mask(32, 32)
    assert (undropped[attended] > 0).all(), "every attended probability is > 0: a zero output means dropped"
    torch.manual_seed(11)
    outs = torch.stack([fn(q, k, v, dropout=P).float() for _ in range(draws)]).flatten(0, 2)   # [n, N, M]
    n = outs.shape[0]
    kept = outs != 0
    scaled = (undropped / (1 - P)).expand_as(outs)
    assert ((outs - scaled).abs()[kept] <= 3 * UNIT * scaled[kept]).all()
    sigma = undropped * math.sqrt(P / ((1 - P) * n))
    error = (outs.mean(0) - undropped).abs()
    assert (error <= 6 * sigma + 3 * UNIT * undropped).all(), (error / sigma.clamp_min(1e-30)).max()
    assert (error[~attended] == 0).all()
    dropped = (outs[:, attended] == 0).double().mean().item()
    assert abs(dropped - P) <= 5 * math.sqrt(P * (1 - P) / (n * int(attended.sum()))), dropped


def check_tiles_drop_the_same_entries(fn_a: Backend, fn_b: Backend) -> None:
    """Two tilings, one RNG state: the same entries are dropped (the zeros of the V = I output agree
    exactly), and on random inputs the outputs differ by no more than the tilings' own rounding does
    without dropout (times 1 / (1 - p), the scale of the dropped outputs)."""
    q, k, v, do = inputs(d=32)
    eye = identity_values(q)
    dropped_a = run(fn_a, q, k, eye, do, 4, dropout=P)[0] == 0
    dropped_b = run(fn_b, q, k, eye, do, 4, dropout=P)[0] == 0
    assert torch.equal(dropped_a, dropped_b) and dropped_a[..., causal_mask(32, 32)].any()
    q, k, v, do = inputs(d=16)
    with_a, with_b = run(fn_a, q, k, v, do, 4, dropout=P), run(fn_b, q, k, v, do, 4, dropout=P)
    plain_a, plain_b = run(fn_a, q, k, v, do, None), run(fn_b, q, k, v, do, None)
    other_seed = run(fn_b, q, k, v, do, 5, dropout=P)
    for x, y, x0, y0, z in zip(with_a, with_b, plain_a, plain_b, other_seed, strict=True):
        own = (x0.float() - y0.float()).abs().max().item()
        assert (x.float() - y.float()).abs().max().item() <= own / (1 - P) + 2 * UNIT * x0.float().abs().max().item()
        assert (x.float() - z.float()).abs().max().item() > 8 * own   # another mask moves it far more


# -- the unit tests ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(BACKENDS))
def test_the_same_rng_state_gives_the_same_outputs_and_gradients(name):
    check_same_rng_state_same_result(BACKENDS[name])


@pytest.mark.parametrize("name", list(BACKENDS))
def test_zero_dropout_is_bit_for_bit_the_path_without_it(name):
    check_zero_dropout_is_the_undropped_path(BACKENDS[name])


@pytest.mark.parametrize("name", list(BACKENDS))
def test_the_mean_over_draws_is_the_undropped_output_and_p_of_them_drop(name):
    check_expectation_and_drop_rate(BACKENDS[name])


@pytest.mark.parametrize("a, b", [("fa2-emu-16x8", "fa2-emu-32x32"), ("fa2-emu-16x8", "baseline")])
def test_the_mask_does_not_depend_on_the_tiles(a, b):
    """Baseline draws the emulation's mask too: one draw over [B, H, N, M], whatever the tiles."""
    check_tiles_drop_the_same_entries(BACKENDS[a], BACKENDS[b])


@pytest.mark.parametrize("placement", ["fa2", "reference"])
def test_the_emulations_gradients_are_those_of_the_dropped_attention(placement):
    """In FP32 the emulation's outputs and gradients are FP64 baseline attention's with the same mask
    (the emulation's backward uses its forward's mask; dropped probabilities get no gradient, kept ones
    the 1 / (1 - p) scaled one): within FP32 rounding, far below what another mask would change."""
    q, k, v, do = (t.double() for t in inputs())
    opts = AttentionOptions(placement=placement, block_r=16, block_c=8, dtype="fp32")
    got = run(lambda *a, **kw: flash_attention(*a, opts, causal=True, **kw), q, k, v, do, 6, dropout=P)
    want = run(lambda *a, **kw: baseline_attention(*a, torch.float64, causal=True, **kw), q, k, v, do, 6, dropout=P)
    other = run(lambda *a, **kw: baseline_attention(*a, torch.float64, causal=True, **kw), q, k, v, do, 7, dropout=P)
    for x, y, z in zip(got, want, other, strict=True):
        assert (x - y).abs().max() < 1e-5 < (z - y).abs().max()


def test_dropout_outside_zero_to_one_is_refused():
    q, k, v, _ = inputs()
    for bad in (1.0, -0.1):
        with pytest.raises(UsageError, match="attention dropout must be in"):
            flash_attention(q, k, v, dropout=bad)


@pytest.fixture
def plugins():
    """A plugin that takes dropout (it notes the p it was given) and one that does not."""
    seen: list[float] = []

    def with_dropout(q, k, v, scaling, dropout=0.0):
        seen.append(dropout)
        return torch.zeros_like(q)

    added = {"dropout-taking-test": with_dropout, "dropout-less-test": lambda q, k, v, scaling: torch.zeros_like(q)}
    for name, fn in added.items():
        plan.register_backend(name, fn)
    yield seen
    for name in added:
        del plan.PLUGINS[name]


def test_a_plugin_gets_dropout_if_it_takes_it_and_is_refused_otherwise(plugins):
    q, k, v, _ = inputs()
    LayerAttention(AttentionPlan.parse("dropout-taking-test"), 0, 4)(None, q, k, v, None, 0.25, 0.2)
    LayerAttention(AttentionPlan.parse("dropout-taking-test"), 0, 4)(None, q, k, v, None, 0.25)
    assert plugins == [0.2, 0.0]   # without dropout the plugin is called as before, with its default
    less = LayerAttention(AttentionPlan.parse("dropout-less-test"), 0, 4)
    assert less(None, q, k, v, None, 0.25).eq(0).all()
    with pytest.raises(UsageError, match="takes no attention dropout"):
        less(None, q, k, v, None, 0.25, 0.2)
