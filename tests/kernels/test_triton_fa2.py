"""The Triton FlashAttention-2 kernels against the fa2 emulation, an FP64 golden value and (on a GPU) SDPA.

Interpreter tests (test_triton_fa2_integration.py, on the CPU): one subprocess with TRITON_INTERPRET=1
runs every case in CASES through `triton_flash_attention`, forward and backward, and the kernels' rounding
helper on chosen FP32 values; the test process compares, by the criteria here. There the kernels hold
BF16/FP16 values in FP32 tensors and round by bits (see the module docstring of replay.kernels.triton_fa2).

Against the emulation (`flash_emu`, placement "fa2", run here on real BF16/FP16 tensors):
  - bit for bit where every FP32 operation is exact or rounded identically: the "integer" case has
    integer scores and c = scale * log2(e) = 1, so every exp2 is a power of two, every sum and product
    exact, and the one inexact step (acc * (1 / l)) is an IEEE division and a multiply in both. O must be equal
    bit for bit.
  - elsewhere the operation order differs in the row sums (NumPy's pairwise np.sum in the interpreter,
    PyTorch's vectorised sum in the emulation), in exp2/log2 (NumPy's and PyTorch's FP32 results are one
    ulp apart on about 20% / 2% of inputs) and possibly in matmul accumulation. An FP32 value one ulp off
    changes its low-precision rounding only on a rounding boundary, so at least 97% of the elements of
    every output must be equal bit for bit, and each other one within one ulp of the format or, where the
    value is a cancellation, within u times the size of its terms (dQ of a causal row that sees only one
    key is exactly 0 in real arithmetic and rounding noise of dP - D in both).
  A kernel rounding at another place than the emulation leaves far fewer than 97% of the elements equal:
  `test_a_misplaced_rounding_would_fail_the_emulation_comparison` measures that on the emulation itself.

Against FP64 (baseline attention on the same rounded inputs), first-order componentwise bounds with u
the unit roundoff (BF16 2^-8, FP16 2^-11), P the exact softmax:
  O:  |err| <= 3u P|V|          (Pbar rounded: u, O rounded: u, one u spare for the FP32 steps)
  dV: |err| <= 3u P^T|dO|       (P rounded: u, dV rounded: u)
  dQ: |err| <= 3u scale mag_dS |K|,   dK: |err| <= 3u scale mag_dS^T |Q|,   where
      mag_dS = P (|dP| + |D| + 2 |dO|.(P|V|)) bounds dS's rounding and D's error from the rounded O
  plus the terms' count times half the smallest subnormal, for values that underflow.

GPU tests (skipped without CUDA): the real BF16 kernels against the emulation and the FP64 golden value,
against PyTorch's flash SDPA, run-to-run determinism, and the rounding helper on the GPU. The offline
compile test (test_triton_fa2_integration.py) needs no GPU: it compiles the real BF16/FP16 code path for
sm_90 and sm_80 with ptxas.
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass

import pytest
import torch
import triton
import triton.language as tl

from replay.errors import UsageError
from replay.kernels import triton_fa2
from replay.kernels.baseline import baseline_attention, causal_mask
from replay.kernels.flash_emu import flash_attention
from replay.kernels.options import AttentionOptions, SafeSoftmaxFix
from replay.kernels.triton_fa2 import _round_lp, triton_flash_attention

UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
HALF_SMALLEST_SUBNORMAL = {torch.bfloat16: 2.0 ** -134, torch.float16: 2.0 ** -25}
MIN_BITWISE_FRACTION = {torch.bfloat16: 0.97, torch.float16: 0.9}   # FP16 rounds 3 bits finer: ~8x the boundaries
HEADS = 2   # batch x heads of every interpreter case
OUTPUTS = ("o", "dq", "dk", "dv")


@dataclass(frozen=True)
class Case:
    n: int                    # queries
    m: int                    # keys
    d: int
    causal: bool
    opts: AttentionOptions
    dtype: torch.dtype = torch.bfloat16
    data: str = "random"      # random | ties | near_ties | integer (exact arithmetic): see _inputs
    scale: float | None = None
    padding: int = 0          # the first slice's first `padding` keys are padding (a bool mask): see _mask


def _opts(block_r, block_c, **kw) -> AttentionOptions:
    return AttentionOptions(block_r=block_r, block_c=block_c, **kw)


CASES = {
    "causal": Case(64, 64, 32, True, _opts(16, 32)),
    "noncausal_ragged": Case(40, 40, 32, False, _opts(32, 16)),
    "hp_delta_d64": Case(64, 64, 64, True, _opts(32, 32, hp_delta=True)),
    "hp_pv_d24": Case(40, 40, 24, False, _opts(16, 32, hp_pv=True)),
    "fix_exact_ties": Case(64, 64, 32, True, _opts(16, 16, fix=SafeSoftmaxFix(beta=7.0)), data="ties"),
    "fix_tolerance_hp_delta": Case(40, 40, 32, False, _opts(32, 16, fix=SafeSoftmaxFix(beta=2.0, tie_tol=1e-3),
                                                            hp_delta=True), data="near_ties"),
    "fp16_causal": Case(40, 40, 32, True, _opts(16, 16), dtype=torch.float16),
    "more_keys": Case(40, 64, 32, True, _opts(16, 32)),     # queries are the last 40 of 64 keys
    "fewer_keys": Case(64, 40, 32, True, _opts(32, 16)),    # the first 24 queries see no key
    "integer": Case(64, 64, 16, True, _opts(16, 16, fix=SafeSoftmaxFix(beta=2.0)), data="integer",
                    scale=math.log(2.0)),
    "decreasing_keys": Case(64, 64, 32, True, _opts(16, 16, key_order="decreasing")),   # as CUDA FA2's loop
    "padded": Case(64, 64, 32, True, _opts(16, 16), padding=24),   # rows 0-23 of slice 0 see only padding
    "padded_fix_decreasing": Case(64, 64, 32, True, _opts(16, 32, fix=SafeSoftmaxFix(beta=7.0), key_order="decreasing"),
                                  data="ties", padding=20),
}
GPU_CASES = {
    "gpu_causal_128": Case(256, 256, 64, True, AttentionOptions()),
    "gpu_noncausal_64x32": Case(200, 200, 64, False, _opts(64, 32)),
    "gpu_fix_hp": Case(256, 256, 64, True, _opts(64, 64, fix=SafeSoftmaxFix(7.0), hp_delta=True, hp_pv=True),
                       data="ties"),
    "gpu_fp16_decreasing_128x64": Case(384, 384, 128, True, _opts(128, 64, key_order="decreasing"),
                                       dtype=torch.float16),
    "gpu_fix_tolerance": Case(256, 256, 64, False, _opts(128, 128, fix=SafeSoftmaxFix(2.0, 1e-3)), data="near_ties"),
    "gpu_padded_decreasing": Case(384, 384, 64, True, _opts(128, 128, key_order="decreasing"), padding=150),
}
ALL_CASES = CASES | GPU_CASES


# -- inputs and runs, shared by this process and the interpreter subprocess -------------------------

def _inputs(name: str) -> tuple[torch.Tensor, ...]:
    """q, k, v, dO of one case, already in its precision; the same in every process."""
    case = ALL_CASES[name]
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if case.data == "integer":
        ones = torch.rand(HEADS, case.n, case.d, generator=g).argsort(-1)[..., :3]
        q = torch.zeros(HEADS, case.n, case.d).scatter_(-1, ones, 1.0)   # 3 ones a row: scores in [-3, 3]
        k = torch.randint(-1, 2, (HEADS, case.m, case.d), generator=g).float()
        v = torch.randint(-2, 3, (HEADS, case.m, case.d), generator=g).float()
    else:
        q = 2 * torch.randn(HEADS, case.n, case.d, generator=g)
        k = torch.randn(HEADS, case.m, case.d, generator=g)
        v = torch.randn(HEADS, case.m, case.d, generator=g)
        if case.data in ("ties", "near_ties"):   # every key twice; even rows score high, odd rows low
            k[:, 1::2] = k[:, 0::2]
            k[..., 0], q[..., 0] = 4.0, torch.tensor([6.0, -6.0]).repeat(case.n // 2)
        if case.data == "near_ties":   # one coordinate one BF16 ulp larger in magnitude: scores close, not equal
            k[:, 1::2, 1] = (k[:, 1::2, 1].bfloat16().view(torch.int16) + 1).view(torch.bfloat16).float()
    do = torch.randn(HEADS, case.n, case.d, generator=g)
    return tuple(t.to(case.dtype) for t in (q, k, v, do))


def _mask(name: str) -> torch.Tensor | None:
    """The case's padding mask, [HEADS, n, m], True = attend: slice 0's first `padding` keys are padding."""
    case = ALL_CASES[name]
    if not case.padding:
        return None
    keep = torch.ones(HEADS, case.n, case.m, dtype=torch.bool)
    keep[0, :, :case.padding] = False
    return keep


def _run(attention, name: str, device: str = "cpu", **changes) -> dict[str, torch.Tensor]:
    """O, dQ, dK, dV (on the CPU) of one case through `attention` (triton_flash_attention or flash_attention)."""
    case = ALL_CASES[name]
    q, k, v, do = (t.to(device) for t in _inputs(name))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = _mask(name)
    out = attention(*leaves, case.opts.with_(**changes), causal=case.causal, scale=case.scale,
                    mask=None if mask is None else mask.to(device))
    out.backward(do)
    return {key: t.cpu() for key, t in zip(OUTPUTS, [out.detach()] + [t.grad for t in leaves], strict=True)}


def _rounding_probes() -> torch.Tensor:
    """FP32 values: random bit patterns (every magnitude, subnormals, Inf, NaN), exact BF16 and FP16
    ties and their neighbours, the largest finite values (some round to Inf), zeros and infinities."""
    g = torch.Generator().manual_seed(11)
    random_bits = torch.randint(0, 2 ** 32, (60_000,), generator=g, dtype=torch.int64)
    upper = random_bits[:20_000] & 0xFFFF0000
    bf16_ties = torch.cat([upper | 0x8000, upper | 0x7FFF, upper | 0x8001])
    near_max = 0x7F7F0000 + torch.arange(0, 0x10000, 97)
    bits = torch.cat([random_bits, bf16_ties, near_max, near_max | 0x80000000])
    as_fp32 = ((bits + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32).view(torch.float32)
    halves = torch.randint(0, 0x7BFF, (20_000,), generator=g, dtype=torch.int16)   # positive finite FP16
    lower, upper16 = halves.view(torch.float16).double(), (halves + 1).view(torch.float16).double()
    fp16_ties = ((lower + upper16) / 2).float()   # midpoints are exact in FP32
    signs = torch.randint(0, 2, fp16_ties.shape, generator=g) * 2 - 1
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 65504.0, 65519.99, 65520.0, 2.0 ** -24,
                            2.0 ** -25, 3 * 2.0 ** -26, 2.0 ** -133, 2.0 ** -134, 3.3895314e38, 3.4028235e38])
    return torch.cat([as_fp32, fp16_ties * signs, fp16_ties + 2.0 ** -30, special])


@triton.jit
def _round_kernel(X, Y, n, IS_BF16: tl.constexpr, EMULATE_LP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n)
    tl.store(Y + offs, _round_lp(x, IS_BF16, EMULATE_LP).to(tl.float32), mask=offs < n)


def _round_in_kernel(x: torch.Tensor, dtype: torch.dtype, emulate: bool) -> torch.Tensor:
    y = torch.empty_like(x)
    block = 1024
    _round_kernel[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), IS_BF16=dtype == torch.bfloat16,
                                                    EMULATE_LP=emulate, BLOCK=block)
    return y


# -- comparisons ------------------------------------------------------------------------------------

def _ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable BF16/FP16 values apart a and b are (+0 and -0 are the same)."""
    def ordered(t):
        bits = t.contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return (ordered(a) - ordered(b)).abs()


def _bounds(name: str, q, k, v, do) -> dict[str, torch.Tensor]:
    """Per element, the first-order error bound of each output against FP64 (see the module docstring)."""
    case = ALL_CASES[name]
    q, k, v, do = (t.double() for t in (q, k, v, do))
    scale = case.d ** -0.5 if case.scale is None else case.scale
    s = q @ k.transpose(1, 2) * scale
    if case.causal:
        s = s.masked_fill(~causal_mask(case.n, case.m), float("-inf"))
    if case.padding:
        s = s.masked_fill(~_mask(name), float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)   # a row that sees no key: all 0
    p_abs_v = p @ v.abs()
    dp, o = do @ v.transpose(1, 2), p @ v
    delta = (do * o).sum(-1, keepdim=True)
    o_error = (do.abs() * p_abs_v).sum(-1, keepdim=True)
    mag_ds = p * (dp.abs() + delta.abs() + 2 * o_error)
    u, eta = UNIT[case.dtype], HALF_SMALLEST_SUBNORMAL[case.dtype]
    return dict(o=3 * u * p_abs_v + case.m * eta * v.abs().max(),
                dq=3 * u * scale * mag_ds @ k.abs() + scale * case.m * eta * k.abs().max(),
                dk=3 * u * scale * mag_ds.transpose(1, 2) @ q.abs() + scale * case.n * eta * q.abs().max(),
                dv=3 * u * p.transpose(1, 2) @ do.abs() + case.n * eta * do.abs().max())


def _fp64_golden(name: str) -> dict[str, torch.Tensor]:
    case = ALL_CASES[name]
    q, k, v, do = (t.double() for t in _inputs(name))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = baseline_attention(*leaves, torch.float64, case.causal, case.scale, _mask(name))
    out.backward(do)
    return dict(zip(OUTPUTS, [out.detach()] + [t.grad for t in leaves], strict=True))


def _check_against_emulation(got: torch.Tensor, want: torch.Tensor, cancellation: torch.Tensor, what: str) -> None:
    """At least 97% (FP16: 90%) bitwise equal; every other element within one ulp, or (cancellations) `cancellation`."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    equal = got.view(torch.int16) == want.view(torch.int16)
    close = (_ulp_distance(got, want) <= 1) | ((got.double() - want.double()).abs() <= cancellation)
    assert close.all(), f"{what}: {int((~close).sum())} beyond one ulp: {got[~close][:4]} vs {want[~close][:4]}"
    fraction = equal.double().mean().item()
    assert fraction >= MIN_BITWISE_FRACTION[got.dtype], f"{what}: only {fraction:.2%} bitwise equal to the emulation"


# -- the criteria and the cases, checked on the emulation -------------------------------------------

@pytest.mark.parametrize("name, change, moved_outputs", [
    ("causal", dict(hp_pv=True), ("o", "dq", "dk")),                      # Pbar not rounded before Pbar @ V
    ("causal", dict(hp_delta=True), ("dq", "dk")),                        # D from the FP32 O
    ("fix_exact_ties", dict(fix=None), ("o", "dq", "dk")),                # the row max instead of the offset
    ("fix_tolerance_hp_delta", dict(fix=SafeSoftmaxFix(2.0)), ("o", "dq", "dk")),   # exact ties, not within 1e-3
    ("noncausal_ragged", dict(block_c=32), ("o", "dq", "dk")),            # other column tiles
])
def test_a_misplaced_rounding_would_fail_the_emulation_comparison(name, change, moved_outputs):
    """The 97% bitwise criterion can fail: each change of one rounding point leaves under 90% of the
    elements of the outputs it affects unchanged (dV depends on none of these)."""
    moved, placed = _run(flash_attention, name, **change), _run(flash_attention, name)
    for key in moved_outputs:
        fraction = (moved[key].view(torch.int16) == placed[key].view(torch.int16)).double().mean().item()
        assert fraction < 0.9, f"{name} {change} {key}: {fraction:.2%} unchanged"


@pytest.mark.parametrize("name", ["fix_exact_ties", "fix_tolerance_hp_delta"])
def test_tie_cases_exercise_both_branches_of_the_fix(name):
    """Tiles whose maximum is tied (exactly, or within tie_tol) with a positive and with a negative max."""
    case = CASES[name]
    q, k, _, _ = _inputs(name)
    s = (q.double() @ k.double().transpose(1, 2)).masked_fill(~causal_mask(case.n, case.m) if case.causal else
                                                              torch.zeros(case.n, case.m, dtype=torch.bool), -math.inf)
    counts = torch.zeros(2)
    for c0 in range(0, case.m, case.opts.block_c):
        tile = s[:, :, c0:c0 + case.opts.block_c]
        row_max = tile.amax(-1, keepdim=True)
        tied = (((row_max - tile) * case.d ** -0.5 <= case.opts.fix.tie_tol).sum(-1) > 1) & row_max[..., 0].isfinite()
        counts += torch.stack([(tied & (row_max[..., 0] > 0)).sum(), (tied & (row_max[..., 0] < 0)).sum()])
    assert (counts >= 30).all(), f"tied tiles with positive / negative max: {counts.tolist()}"


# -- in this process: argument checks, availability -------------------------------------------------

@pytest.mark.parametrize("opts, message", [
    (AttentionOptions(block_r=24), "block_r must be a power of two >= 16"),
    (AttentionOptions(block_c=8), "block_c must be a power of two >= 16"),
    (AttentionOptions(placement="reference"), "'fa2' rounding placement only"),
    (AttentionOptions(dtype="fp32"), "bf16 or fp16"),
])
def test_refuses_what_the_kernels_do_not_do(opts, message):
    q = torch.zeros(1, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(UsageError, match=re.escape(message)):
        triton_flash_attention(q, q, q, opts)


def test_refuses_mismatched_shapes():
    q, k = torch.zeros(1, 16, 16, dtype=torch.bfloat16), torch.zeros(1, 16, 32, dtype=torch.bfloat16)
    with pytest.raises(UsageError, match="same leading dims and d"):
        triton_flash_attention(q, k, k)


@pytest.mark.skipif(torch.cuda.is_available() or triton_fa2.INTERPRETED, reason="this machine can run the kernels")
def test_says_why_it_cannot_run(monkeypatch):
    ok, why = triton_fa2.available()
    assert not ok and "no CUDA device" in why and "TRITON_INTERPRET=1" in why
    q = torch.zeros(1, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(UsageError, match="cannot run here"):
        triton_flash_attention(q, q, q)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "set after replay.kernels.triton_fa2 was imported" in triton_fa2.available()[1]


# -- GPU tests --------------------------------------------------------------------------------------

def needs_gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(
        not torch.cuda.is_available() or triton_fa2.INTERPRETED,
        reason="needs a CUDA GPU (and TRITON_INTERPRET unset): real BF16 kernels cannot run on the CPU; the "
               "interpreter tests cover the kernels' logic")(test))


@needs_gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_kernels_agree_with_the_emulation_and_fp64(name):
    got = _run(triton_flash_attention, name, device="cuda")
    want, gold = _run(flash_attention, name), _fp64_golden(name)
    bounds = _bounds(name, *_inputs(name))
    for key in OUTPUTS:
        assert ((got[key].double() - gold[key]).abs() <= bounds[key]).all(), f"{name} {key} vs FP64"
        difference = (got[key].double() - want[key].double()).abs()
        assert (difference <= 2 * bounds[key]).all(), f"{name} {key} vs emulation"


@needs_gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_kernels_match_the_emulation_bitwise_almost_everywhere(name):
    """The interpreter's criterion on the GPU, against the emulation run on the GPU: at least 97% of every
    output bitwise equal, the rest within one ulp or (cancellations) the size of the FP32 noise."""
    got = _run(triton_flash_attention, name, device="cuda")
    want = _run(flash_attention, name, device="cuda")
    bounds = _bounds(name, *_inputs(name))
    for key in OUTPUTS:
        _check_against_emulation(got[key], want[key], bounds[key] / 3, f"{name} {key}")


@needs_gpu
def test_gpu_deferred_underflow_check_raises_at_the_next_check():
    """In training (defer_checks) the underflow is noted on the GPU, without a wait, and raised once."""
    from replay.kernels.registry import raise_deferred

    q = torch.zeros(1, 1, 16, 16, device="cuda")
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, 16, 16, device="cuda")
    k[..., 0] = 80.0   # 16 keys tie at score 20
    v = torch.randn(1, 1, 16, 16, device="cuda")
    opts = AttentionOptions(block_r=16, block_c=16, fix=SafeSoftmaxFix(beta=6.0))
    args = (q.bfloat16(), k.bfloat16(), v.bfloat16(), opts)
    triton_flash_attention(*args, causal=False, defer_checks=True)
    with pytest.raises(UsageError, match="beta=6 underflows"):
        raise_deferred()
    raise_deferred()   # raised once
    triton_flash_attention(*args[:3], opts.with_(fix=SafeSoftmaxFix(beta=2.0)), causal=False, defer_checks=True)
    raise_deferred()   # a beta that does not underflow notes nothing
    with pytest.raises(UsageError, match="underflows"):
        triton_flash_attention(*args, causal=False)   # called directly: checked at once


@needs_gpu
def test_gpu_kernels_agree_with_flash_sdpa():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(2, 4, 256, 64, generator=g).bfloat16().cuda() for _ in range(4))
    results = []
    for attention in (lambda a, b, c: triton_flash_attention(a, b, c, AttentionOptions(), causal=True),
                      lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=True)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = attention(*leaves)
            out.backward(do)
        results.append([out.detach()] + [t.grad for t in leaves])
    gold_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    gold_out = baseline_attention(*gold_leaves, torch.float64, True)
    gold_out.backward(do.double())
    gold = [gold_out.detach()] + [t.grad for t in gold_leaves]
    for key, ours, theirs, ref in zip(OUTPUTS, *results, gold, strict=True):
        ours_err, theirs_err = (ours.double() - ref).abs().max(), (theirs.double() - ref).abs().max()
        allowed = 2 * theirs_err + UNIT[torch.bfloat16] * ref.abs().max()
        assert ours_err <= allowed, f"{key}: error {ours_err} against SDPA's {theirs_err}"


@needs_gpu
def test_gpu_kernels_are_deterministic():
    g = torch.Generator().manual_seed(6)
    q, k, v, do = (torch.randn(3, 512, 64, generator=g).bfloat16().cuda() for _ in range(4))
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = triton_flash_attention(*leaves, AttentionOptions(block_r=64, block_c=64))
        out.backward(do)
        runs.append([out.detach()] + [t.grad for t in leaves])
    for key, first, second in zip(OUTPUTS, *runs, strict=True):
        assert torch.equal(first.view(torch.int16), second.view(torch.int16)), key


@needs_gpu
@pytest.mark.parametrize("emulate", [True, False], ids=["bit-rounding", "native-cast"])
@pytest.mark.parametrize("dtype", list(UNIT), ids=["bf16", "fp16"])
def test_gpu_rounding_matches_torch(dtype, emulate):
    probes = _rounding_probes().cuda()
    got, want = _round_in_kernel(probes, dtype, emulate).cpu(), probes.cpu().to(dtype).float()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))
