"""The FA2 emulation and baseline attention against an FP64 golden value, and where they round.

Tolerances come from the precision's unit roundoff u (BF16 2^-8, FP16 2^-11, FP32 2^-24): the output may
be off by at most 8 u max|V| (a few roundings of values of V's size), the gradients by at most 32 u times
the largest golden gradient (more accumulation steps). Measured errors sit at 1-4 u; a backend computing
in a lower precision than it claims fails these bounds by orders of magnitude.
"""

import math
import warnings

import pytest
import torch

from replay.errors import UsageError
from replay.kernels.baseline import baseline_attention
from replay.kernels.flash_emu import LOG2E, _safe_offset, flash_attention
from replay.kernels.options import AttentionOptions, SafeSoftmaxFix

UNIT = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def _inputs(seed=0, shape=(2, 3, 77, 32)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for _ in range(4)]   # q, k, v, dO


def _run(fn, q, k, v, do, dtype):
    leaves = [t.to(dtype).detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(do.to(out.dtype))
    return [out.double()] + [t.grad.double() for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("placement", ["fa2", "reference"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("tiles", [(16, 32), (64, 16), (128, 128)])
def test_emulation_matches_the_fp64_golden_within_the_precision(dtype, placement, causal, tiles):
    q, k, v, do = _inputs()
    # the golden value sees the same rounded inputs: only the attention's own rounding is measured
    q, k, v = (t.to(dtype).double() for t in (q, k, v))
    gold = _run(lambda a, b, c: baseline_attention(a, b, c, torch.float64, causal), q, k, v, do, torch.float64)
    opts = AttentionOptions(placement=placement, block_r=tiles[0], block_c=tiles[1])
    got = _run(lambda a, b, c: flash_attention(a, b, c, opts, causal), q, k, v, do, dtype)
    u = UNIT[dtype]
    assert (got[0] - gold[0]).abs().max() <= 8 * u * v.abs().max()
    for g, ref in zip(got[1:], gold[1:], strict=True):
        assert (g - ref).abs().max() <= 32 * u * ref.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_baseline_matches_the_fp64_golden_within_the_precision(dtype):
    q, k, v, do = _inputs(seed=1)
    q, k, v = (t.to(dtype).double() for t in (q, k, v))
    gold = _run(lambda a, b, c: baseline_attention(a, b, c, torch.float64), q, k, v, do, torch.float64)
    got = _run(lambda a, b, c: baseline_attention(a, b, c, dtype), q, k, v, do, dtype)
    u = UNIT[dtype]
    assert (got[0] - gold[0]).abs().max() <= 8 * u * v.abs().max()
    for g, ref in zip(got[1:], gold[1:], strict=True):
        assert (g - ref).abs().max() <= 32 * u * ref.abs().max()


def test_fa2_placement_rounds_exactly_where_it_says_in_one_tile():
    """One tile (N <= B_r, N <= B_c): the forward written out with PyTorch's own casts, bit for bit."""
    q, k, v, do = (t.bfloat16() for t in _inputs(seed=2, shape=(1, 2, 48, 32)))
    scale = 32 ** -0.5
    c = torch.tensor(scale * LOG2E, dtype=torch.float32).item()
    s = q.float() @ k.float().transpose(-1, -2)                       # BF16 operands, FP32 accumulate
    s = s.masked_fill(torch.ones(48, 48, dtype=torch.bool).triu(1), float("-inf"))
    m = s.amax(-1, keepdim=True)                                      # row max in FP32
    p = torch.exp2(s * c - m * c)                                     # FP32 Pbar, scale folded into exp2
    row_sum = p.sum(-1, keepdim=True)                                 # row sum from the FP32 Pbar
    acc = p.bfloat16().float() @ v.float()                            # Pbar rounded to BF16 before Pbar V
    expected = (acc * (1 / row_sum)).bfloat16()                       # times the FP32 1/l, rounded once
    got = flash_attention(q, k, v, AttentionOptions(block_r=64, block_c=64))
    assert torch.equal(got, expected)
    # and the rounding of Pbar matters: without it (hp-pv) the output differs somewhere
    unrounded = flash_attention(q, k, v, AttentionOptions(block_r=64, block_c=64, hp_pv=True))
    assert torch.equal(unrounded, (p @ v.float() * (1 / row_sum)).bfloat16()) and not torch.equal(unrounded, expected)

    # backward: D from the stored BF16 O; P from the LSE in FP32; dS rounded before dQ and dK
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    flash_attention(*leaves, AttentionOptions(block_r=64, block_c=64)).backward(do)
    lse2 = m * c + torch.log2(row_sum)
    p_bw = torch.exp2(s * c - lse2)
    D = (do.float() * expected.float()).sum(-1, keepdim=True)
    dv = (p_bw.bfloat16().float().transpose(-1, -2) @ do.float()).bfloat16()
    ds = (p_bw * (do.float() @ v.float().transpose(-1, -2) - D)).bfloat16().float()
    dq = ((ds @ k.float()) * scale).bfloat16()
    dk = ((ds.transpose(-1, -2) @ q.float()) * scale).bfloat16()
    assert torch.equal(leaves[2].grad, dv) and torch.equal(leaves[0].grad, dq) and torch.equal(leaves[1].grad, dk)


def test_reference_placement_accumulates_in_bf16_tensors():
    """Two column tiles: the per-tile Pbar V and the O accumulator are BF16 tensors, as under autocast."""
    q, k, v, _ = (t.bfloat16() for t in _inputs(seed=3, shape=(1, 1, 32, 16)))
    scale = 16 ** -0.5
    got = flash_attention(q, k, v, AttentionOptions(placement="reference", block_r=32, block_c=16), causal=False)
    s = (q @ k.transpose(-1, -2)) * scale                              # BF16 tensors throughout
    s1, s2 = s[..., :16], s[..., 16:]
    m1 = s1.amax(-1)
    p1 = torch.exp(s1 - m1[..., None])
    row_sum, acc = p1.sum(-1), p1 @ v[..., :16, :]
    m2 = torch.maximum(m1, s2.amax(-1))
    p2, alpha = torch.exp(s2 - m2[..., None]), torch.exp(m1 - m2)
    row_sum = alpha * row_sum + p2.sum(-1)
    acc = alpha[..., None] * acc + p2 @ v[..., 16:, :]
    assert torch.equal(got, acc / row_sum[..., None])


def test_fix_changes_nothing_beyond_the_precision():
    q, k, v, do = _inputs(seed=4)
    for dtype in (torch.float32, torch.bfloat16):
        plain = flash_attention(q.to(dtype), k.to(dtype), v.to(dtype), AttentionOptions())
        fixed = flash_attention(q.to(dtype), k.to(dtype), v.to(dtype), AttentionOptions(fix=SafeSoftmaxFix(7.0)))
        assert (plain.double() - fixed.double()).abs().max() <= 8 * UNIT[dtype] * v.abs().max()


def _tied_tile(max_value: float):
    """Rows whose maximum score appears at three columns; every other score at least 3 below it."""
    s = max_value - 3.0 - 4.0 * torch.rand(4, 8, 32, generator=torch.Generator().manual_seed(6))
    s[..., [3, 11, 20]] = max_value
    return s


@pytest.mark.parametrize("max_value", [2.5, -1.5])
def test_fix_removes_the_exact_ones_that_ties_produce(max_value):
    s = _tied_tile(max_value)
    c = LOG2E
    plain = torch.exp2((s - s.amax(-1, keepdim=True)) * c)
    assert ((plain == 1.0).sum(-1) == 3).all()                       # the trigger of the mechanism
    offset = _safe_offset(s, s.amax(-1), SafeSoftmaxFix(beta=7.0), scale=1.0)
    fixed = torch.exp2((s - offset[..., None]) * c)
    assert (fixed < 1.0).all() and (fixed > 0).all()
    # softmax is unchanged (up to FP32 rounding): the offset cancels in the normalisation
    assert torch.allclose(fixed / fixed.sum(-1, keepdim=True), plain / plain.sum(-1, keepdim=True), rtol=1e-5)


def test_fix_leaves_rows_with_a_single_maximum_alone():
    s = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(7))
    assert torch.equal(_safe_offset(s, s.amax(-1), SafeSoftmaxFix(7.0), 1.0), s.amax(-1))


def test_tie_tolerance_counts_near_ties():
    s = torch.zeros(1, 1, 8) - 4.0
    s[..., 2], s[..., 5] = 3.0, 3.0 - 5e-4
    exact = _safe_offset(s, s.amax(-1), SafeSoftmaxFix(7.0, tie_tol=0.0), 1.0)
    tolerant = _safe_offset(s, s.amax(-1), SafeSoftmaxFix(7.0, tie_tol=1e-3), 1.0)
    assert exact.item() == 3.0 and tolerant.item() == 21.0


def test_tiny_beta_warns_that_it_rounds_back_to_one_in_bf16():
    with pytest.warns(UserWarning, match="rounds back to 1 in BF16"):
        SafeSoftmaxFix(beta=1.001)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SafeSoftmaxFix(beta=2.0)


def test_huge_beta_is_a_clear_error_not_silent_zeros():
    q = torch.zeros(1, 1, 4, 8)
    q[..., 0] = 30.0
    k = torch.zeros(1, 1, 4, 8)
    k[..., 0] = 30.0                                     # every score ties at 900 / sqrt(8)
    with pytest.raises(UsageError, match="underflows"):
        flash_attention(q, k, torch.randn(1, 1, 4, 8), AttentionOptions(fix=SafeSoftmaxFix(beta=1e6)), causal=False)
    # a beta that leaves only subnormal probabilities: 1 / l would be inf and the output NaN
    q2 = torch.zeros(1, 1, 2, 8)
    q2[..., 0] = 1.0
    k2 = torch.zeros(1, 1, 2, 8)
    k2[..., 0] = 20.0 * 8 ** 0.5                         # scores tie at 20 (scaled): exp2(-(beta-1)*20*log2 e)
    with pytest.raises(UsageError, match="underflows"):  # beta 5.5: p = e^-90, a subnormal row sum
        flash_attention(q2, k2, torch.randn(1, 1, 2, 8), AttentionOptions(fix=SafeSoftmaxFix(beta=5.5)), causal=False)


@pytest.mark.parametrize("bad", [{"placement": "cuda"}, {"block_r": 0}, {"dtype": "fp8"}])
def test_bad_options_are_usage_errors(bad):
    with pytest.raises(UsageError):
        AttentionOptions(**bad)
    with pytest.raises(UsageError, match="beta must be > 1"):
        SafeSoftmaxFix(beta=0.5)


def test_padding_mask_excludes_keys():
    q, k, v, _ = _inputs(seed=5, shape=(2, 2, 10, 16))
    keep = torch.ones(2, 1, 10, 10, dtype=torch.bool)
    keep[0, ..., :3] = False                              # batch 0: the first 3 keys are padding
    got = flash_attention(q, k, v, AttentionOptions(block_r=4, block_c=4), causal=True, mask=keep)
    ref = baseline_attention(q.double(), k.double(), v.double(), torch.float64, causal=True, mask=keep)
    valid = torch.ones(2, 2, 10, dtype=torch.bool)
    valid[0, :, :3] = False                               # rows that see only padding are 0 in both
    assert torch.allclose(got.double()[valid], ref[valid], atol=1e-5)
    assert math.isclose(got[0, :, :3].abs().max().item(), 0.0)


def test_a_fully_masked_tile_leaves_the_row_as_if_it_were_absent():
    """As CUDA FA2: a key tile a row attends none of (padding, or under `keys=decreasing` a causal row's
    first visited tile) moves no bit; the running max stays -inf, not 0, until the row sees a key."""
    q, k, v, _ = (t.bfloat16() for t in _inputs(seed=7, shape=(1, 2, 16, 16)))
    k = -k.abs()
    q = q.abs()   # every score negative: an offset of 0 instead of the row max would change Pbar's rounding
    keep = torch.ones(1, 1, 16, 24, dtype=torch.bool)
    keep[..., :8] = False   # keys 0-7, the first tile of 8, are padding
    padded_k, padded_v = torch.cat([torch.randn(1, 2, 8, 16).bfloat16(), k], 2), torch.cat([v[:, :, :8], v], 2)
    opts = AttentionOptions(block_r=8, block_c=8)
    got = flash_attention(q, padded_k, padded_v, opts, causal=False, mask=keep)
    assert torch.equal(got, flash_attention(q, k, v, opts, causal=False))


def test_decreasing_key_order_visits_the_tiles_last_to_first():
    """keys=decreasing is the increasing order on keys reversed tile by tile (the same tiles, visited
    last to first); it agrees with FP64 as closely and is a different sum: some bits differ."""
    q, k, v, do = _inputs(seed=8, shape=(2, 2, 256, 32))
    q, k, v = (t.bfloat16() for t in (q, k, v))
    opts = AttentionOptions(block_r=64, block_c=64)
    backward = opts.with_(key_order="decreasing")
    perm = torch.arange(256).view(4, 64).flip(0).reshape(-1)
    got = flash_attention(q, k, v, backward, causal=False)
    assert torch.equal(got, flash_attention(q, k[:, :, perm], v[:, :, perm], opts, causal=False))
    increasing = flash_attention(q, k, v, opts, causal=False)
    assert not torch.equal(got, increasing)
    gold = baseline_attention(q.double(), k.double(), v.double(), torch.float64, causal=False)
    assert (got.double() - gold).abs().max() <= 8 * UNIT[torch.bfloat16] * v.abs().max()
    with pytest.raises(UsageError, match="fa2 placement only"):
        AttentionOptions(placement="reference", key_order="decreasing")


@pytest.mark.parametrize("placement", ["fa2", "reference"])
def test_a_watched_call_hands_out_the_s_and_p_its_backward_recomputes_and_computes_the_same(placement):
    """kernels/internals.py: S (scaled, -inf where masked) and P (normalised, 0 there) of every head, whole,
    after the backward (where the tiles recompute them), within BF16's rounding of the FP64 values; the call's
    outputs and gradients are the unwatched call's bit for bit. Baseline attention hands out its own S and P."""
    q, k, v, do = (t.bfloat16() for t in _inputs(shape=(2, 2, 40, 16)))
    opts = AttentionOptions(placement=placement, block_r=16, block_c=8)
    handed = []
    watched = _run(lambda a, b, c: flash_attention(a, b, c, opts, watch=lambda s, p: handed.append((s, p))),
                   q, k, v, do, torch.bfloat16)
    plain = _run(lambda a, b, c: flash_attention(a, b, c, opts), q, k, v, do, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(watched, plain, strict=True))
    assert len(handed) == 1
    s, p = handed[0]
    causal = torch.ones(40, 40, dtype=torch.bool).tril()
    exact_s = (q.double() @ k.double().transpose(-1, -2)) * 16 ** -0.5
    exact_p = torch.softmax(exact_s.masked_fill(~causal, -math.inf), dim=-1)
    assert s.shape == p.shape == (2, 2, 40, 40)
    assert torch.isinf(s[..., ~causal]).all() and (p[..., ~causal] == 0).all()
    assert ((s.double() - exact_s)[..., causal].abs() <= 4 * UNIT[torch.bfloat16] * exact_s.abs().amax()).all()
    assert ((p.double() - exact_p).abs() <= 4 * UNIT[torch.bfloat16]).all()
    seen = []
    baseline_attention(q, k, v, torch.bfloat16, watch=lambda s, p: seen.append((s, p)))
    assert torch.equal(seen[0][0].isinf(), s.isinf()) and ((seen[0][1].double() - exact_p).abs() <= 4 * 2 ** -8).all()
