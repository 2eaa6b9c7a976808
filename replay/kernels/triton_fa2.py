"""FlashAttention-2 in Triton, forward and backward, rounding exactly where the `fa2` placement of
`replay.kernels.flash_emu` rounds (same tiles, same loop order, the same FP32 operations in the same
order). For BF16 or FP16 inputs, with round() meaning round-to-nearest-even to that format:

forward, one program per (row tile, head):
  S     = Q K^T                        low-precision operands, FP32 accumulate
  r     = FP32 row max of the tile, or with `fix` the safe-softmax offset (`flash_emu._safe_offset`)
  m     = max(m, r), -inf until the row attends to a key (exponents then use 0); c = FP32(scale * log2 e)
  Pbar  = exp2(S*c - m*c),  alpha = exp2(m_old*c - m*c)            FP32
  l     = alpha*l + rowsum(Pbar)                                    from the FP32 Pbar
  acc   = alpha*acc + round(Pbar) @ V                               FP32 accumulator; `hp_pv`: Pbar @ V in FP32
  O     = round(acc * (1 / l))                                      as CUDA FA2: FP32 reciprocal, multiply
  lse2  = m*c + log2(l)                                             FP32, log2 units (+inf: row sees nothing)
  `hp_delta` also writes acc * (1 / l) in FP32.
backward, deterministic (no atomics), three kernels:
  D     = rowsum(dO * O)                                            FP32, from the stored low-precision O
                                                                    (the FP32 O with `hp_delta`)
  dK/dV kernel, one program per (column tile, head), row tiles in increasing order:
  P = exp2(S*c - lse2) FP32;  dV += round(P)^T dO;  dP = dO V^T;  dS = round(P * (dP - D));  dK += dS^T Q;
  then dK = round(dK_acc * scale), dV = round(dV_acc)
  dQ kernel, one program per (row tile, head), column tiles in increasing order, recomputing the same P
  and dS: dQ += dS K, then dQ = round(dQ_acc * scale).

Attention dropout (kernels/dropout.py), where CUDA FA2 applies it and as the `fa2` emulation does: one
seed per call from torch's generator; entry (slice, row, column) is kept when Philox's uniform at
(seed, (slice * N + row) * M + column) is >= p, the same in every kernel and for every tiling. Forward: l
from the undropped Pbar, dropped entries of round(Pbar) zeroed before @ V, O = round(acc * ((1 / l) * rp));
backward: D * (1 - p), dP zeroed where dropped, dV from the dropped P, dV_acc * rp and dQ_acc, dK_acc *
(scale * rp) before rounding (rp = 1 / (1 - p), all FP32).

Two modes, one kernel source:
  GPU (CUDA): BF16/FP16 tensors; round() is `.to(tl.bfloat16)` / `.to(tl.float16)`; tl.dot on tensor
  cores; FP32 multiply-adds contracted to FMA (`enable_fp_fusion`, as nvcc does for CUDA FA2).
  Interpreter (TRITON_INTERPRET=1 set before this module is imported), EMULATE_LP: Triton's interpreter
  cannot do BF16 (its cast truncates, its BF16 arithmetic is wrong), so every tensor is FP32 holding
  low-precision values; round() rounds the FP32 bit pattern to BF16 (ties to even), or for FP16 goes
  through the interpreter's float16 cast (NumPy's, also ties to even); tl.dot is an FP32 matmul.

What differs from the emulation: the accumulation order inside matmuls and row sums (tensor cores or
NumPy here, PyTorch there), exp2/log2 (the GPU's ex2.approx.ftz/lg2.approx, or NumPy's, against
PyTorch's: NumPy's and PyTorch's FP32 exp2 differ by one ulp on about a fifth of inputs) and, on the GPU,
FMA contraction and subnormal Pbar flushed to zero. Each moves an FP32 intermediate by an ulp or so,
which changes a rounded low-precision value only when it sits on a rounding boundary. A score tied with
the row max still gives exactly Pbar = 1.

Kept from the emulation where CUDA FA2 differs: the LSE in log2 units (CUDA FA2 stores the natural-log
LSE and converts it back in the backward: the same P up to an FP32 ulp).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from replay.errors import UsageError
from replay.kernels.baseline import causal_mask
from replay.kernels.dropout import check, draw_seed, fp32_scales
from replay.kernels.dtypes import DTYPES
from replay.kernels.options import AttentionOptions

LOG2E = math.log2(math.e)
LOW_PRECISION = (torch.bfloat16, torch.float16)


def _interpreted() -> bool:
    return bool(triton.knobs.runtime.interpret)


# Fixed when the kernels below are decorated: TRITON_INTERPRET set later changes nothing.
INTERPRETED = _interpreted()


def available() -> tuple[bool, str]:
    """Whether the kernels can run in this process, and how (or why not)."""
    if INTERPRETED:
        return True, "Triton interpreter on the CPU, emulating low precision in FP32 tensors"
    if not torch.cuda.is_available():
        hint = " (it was set after replay.kernels.triton_fa2 was imported)" if _interpreted() else ""
        return False, f"no CUDA device, and TRITON_INTERPRET=1 was not set before import{hint}"
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return False, f"BF16 tensor-core matmuls need compute capability 8.0 or newer; this GPU is {major}.{minor}"
    return True, f"CUDA on {torch.cuda.get_device_name()}"


def triton_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           opts: AttentionOptions = AttentionOptions(), causal: bool = True,
                           scale: float | None = None, defer_checks: bool = False,
                           mask: torch.Tensor | None = None, dropout: float = 0.0) -> torch.Tensor:
    """q: [..., N, d], k and v: [..., M, d]. Causal means query i is the (M - N + i)-th key. `mask` (bool,
    True = attend; padding) broadcasts to [..., N, M] and is combined with the causal mask. `dropout`:
    attention dropout's probability (see the module docstring).

    With the fix, a beta whose probabilities underflow is an error (`_check_underflow`). Checking waits
    for the GPU; `defer_checks` instead notes the failure on the GPU and `raise_deferred()` raises it (the
    trainer calls it once per step, after the loss has made the host wait anyway)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    drop = _Dropout(check(dropout), draw_seed(q.device)) if dropout else None
    return _TritonFlash.apply(q, k, v, opts, causal, scale, defer_checks and not INTERPRETED, mask, drop)


@dataclass(frozen=True)
class _Dropout:
    p: float
    seed: torch.Tensor   # int64 [1], on the inputs' device


_underflowed: dict[torch.device, tuple[torch.Tensor, set[float]]] = {}   # device -> (flag on it, the betas checked)


def raise_deferred() -> None:
    """Raise the error a deferred check noted since the last call (reads one flag per device), and forget
    what was checked."""
    for device, (flag, betas) in list(_underflowed.items()):
        del _underflowed[device]
        if bool(flag):
            raise UsageError(_underflow_message(*sorted(betas)))


def _underflow_message(*betas: float) -> str:
    which = f"beta={betas[0]:g}" if len(betas) == 1 else "one of beta=" + ", ".join(f"{b:g}" for b in betas)
    return (f"safe-softmax {which} underflows: exp(-(beta - 1) * max score) is 0 for some rows, which would "
            "silently zero their output; use a smaller beta (the paper uses 2-8)")


def _check_underflow(out, lse2, causal: bool, n: int, m: int, fix, defer: bool, mask) -> None:
    """As the emulation: a row that attends to keys but whose probabilities all underflowed (a row sum of
    0, and so an infinite lse2, where exp2 flushes subnormals to zero; an infinite 1/l, and so a non-finite
    O, where it does not) is an error, not zeros."""
    if mask is None:
        first = max(0, n - m) if causal else 0   # rows before it see no key: their lse2 is +inf by design
        bad = ~torch.isfinite(lse2[:, first:]).all() | ~torch.isfinite(out[:, first:]).all()
    else:   # rows whose every key is padding see nothing either
        shared = mask[:, :1] if mask.stride(1) == 0 else mask   # one mask for all heads: read it once
        keep = shared.bool() & causal_mask(n, m, mask.device) if causal else shared.bool()
        attends = keep.any(-1).expand(mask.shape[:3]).reshape(-1, n)
        bad = ((~torch.isfinite(lse2) | ~torch.isfinite(out).all(-1)) & attends).any()
    if defer:
        no_flag: tuple[torch.Tensor, set[float]] = (torch.zeros((), dtype=torch.bool, device=lse2.device), set())
        flag, betas = _underflowed.setdefault(lse2.device, no_flag)
        flag.logical_or_(bad)
        betas.add(fix.beta)
    elif bool(bad):
        raise UsageError(_underflow_message(fix.beta))


class _TritonFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, opts: AttentionOptions, causal: bool, scale: float, defer_checks: bool, mask,
                drop: _Dropout | None):
        lp = _check(q, k, v, opts)
        in_dtype, q_shape, k_shape = q.dtype, q.shape, k.shape
        q3, k3, v3 = (_kernel_layout(t, lp) for t in (q, k, v))
        mask4 = _mask_layout(mask, q.shape[:-2], q.shape[-2], k.shape[-2], q3.device)
        out, lse2, o_hp = _forward(q3, k3, v3, mask4, opts, causal, scale, _is_bf16(lp), drop)
        if opts.fix is not None:
            _check_underflow(out, lse2, causal, q3.shape[1], k3.shape[1], opts.fix, defer_checks, mask4)
        ctx.save_for_backward(q3, k3, v3, out, lse2, o_hp)
        ctx.mask4, ctx.drop = mask4, drop
        ctx.opts, ctx.causal, ctx.scale, ctx.lp, ctx.in_dtype = opts, causal, scale, lp, in_dtype
        ctx.shapes = q_shape, k_shape
        return out.to(lp).reshape(q_shape).to(in_dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q3, k3, v3, out, lse2, o_hp = ctx.saved_tensors
        do3 = _kernel_layout(dout, ctx.lp)
        dq, dk, dv = _backward(q3, k3, v3, out, lse2, o_hp, do3, ctx.mask4, ctx.opts, ctx.causal, ctx.scale,
                               _is_bf16(ctx.lp), ctx.drop)
        q_shape, k_shape = ctx.shapes
        return (dq.to(ctx.lp).reshape(q_shape).to(ctx.in_dtype), dk.to(ctx.lp).reshape(k_shape).to(ctx.in_dtype),
                dv.to(ctx.lp).reshape(k_shape).to(ctx.in_dtype), None, None, None, None, None, None)


def _check(q, k, v, opts: AttentionOptions) -> torch.dtype:
    """Refuse what the kernels do not do, then what this machine cannot run; return the compute precision."""
    if opts.placement != "fa2":
        raise UsageError(f"the Triton kernels implement the 'fa2' rounding placement only, not {opts.placement!r}; "
                         "use replay.kernels.flash_emu for it")
    lp = DTYPES[opts.dtype] if opts.dtype else q.dtype
    if lp not in LOW_PRECISION:
        raise UsageError(f"the Triton kernels compute in bf16 or fp16, not {lp}; set opts.dtype or cast the inputs")
    for name, size in (("block_r", opts.block_r), ("block_c", opts.block_c)):
        if size < 16 or size & (size - 1):
            raise UsageError(f"{name} must be a power of two >= 16 for the Triton kernels (tl.dot), got {size}")
    if q.dim() < 2 or k.shape != v.shape or q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise UsageError(f"expected q [..., N, d] and k, v [..., M, d] with the same leading dims and d; "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[:-2].numel() > 65535:
        raise UsageError(f"at most 65535 (batch x heads) slices per call, got {q.shape[:-2].numel()}")
    ok, why = available()
    if not ok:
        raise UsageError(f"the Triton FlashAttention kernels cannot run here: {why}")
    if not INTERPRETED and not (q.is_cuda and k.is_cuda and v.is_cuda):
        raise UsageError("the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter)")
    return lp


def _is_bf16(lp: torch.dtype) -> bool:
    return lp == torch.bfloat16


def _kernel_layout(t: torch.Tensor, lp: torch.dtype) -> torch.Tensor:
    """[G, n, d] contiguous in `lp`; in the interpreter FP32 holding `lp` values (exact)."""
    t = t.to(lp).reshape(-1, *t.shape[-2:])
    return (t.float() if INTERPRETED else t).contiguous()


def _mask_layout(mask, lead: torch.Size, n: int, m: int, device) -> torch.Tensor | None:
    """The padding mask as uint8 [L0, L1, N, M] over q's leading dims (L1 the last of them, usually the
    heads), a strided view of the caller's mask where it can be: a mask broadcast over heads is not copied."""
    if mask is None:
        return None
    if mask.dtype != torch.bool or mask.device.type != device.type:
        raise UsageError(f"the padding mask must be a bool tensor on {device.type} (True = attend), "
                         f"got {mask.dtype} on {mask.device.type}")
    try:
        full = mask.expand(*lead, n, m)
    except RuntimeError:
        raise UsageError(f"the padding mask {tuple(mask.shape)} does not broadcast to {(*lead, n, m)}") from None
    four = full.reshape(-1, lead[-1] if lead else 1, n, m)
    return four.view(torch.uint8)


def _f32(x: float) -> float:
    """x rounded to FP32, as the kernels receive it (and as the emulation's FP32 tensor arithmetic uses it)."""
    return torch.tensor(x, dtype=torch.float32).item()


def _launch(kernel, grid, args: tuple, constexprs: dict, num_warps: int, num_stages: int) -> None:
    """The one place a kernel is launched (tests swap it for an offline compile for a GPU target)."""
    try:
        kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=True)
    except triton.runtime.errors.OutOfResources as error:
        if num_stages > 2:   # a GPU with less shared memory than an H100's: pipeline less deeply
            return _launch(kernel, grid, args, constexprs, num_warps, 2)
        raise UsageError(f"{kernel.__name__} does not fit this GPU with these tiles ({error}); "
                         "choose a smaller block_r or block_c") from error


def _common_constexprs(opts: AttentionOptions, causal: bool, is_bf16: bool, d: int, mask4, drop) -> dict:
    return dict(CAUSAL=causal, MASKED=mask4 is not None, DROPOUT=drop is not None, IS_BF16=is_bf16,
                EMULATE_LP=INTERPRETED,
                BLOCK_R=opts.block_r, BLOCK_C=opts.block_c, BLOCK_D=max(16, triton.next_power_of_2(d)))


def _mask_args(mask4, unused: torch.Tensor) -> tuple:
    """The mask's pointer, strides and slices per outer index; `unused` stands in when there is none."""
    if mask4 is None:
        return unused, 0, 0, 0, 0, 1
    return (mask4, *mask4.stride(), mask4.shape[1])


def _dropout_args(drop: _Dropout | None, unused: torch.Tensor, scale: float) -> tuple:
    """The seed's pointer, p, rp and scale * rp (FP32; `unused` and 1s when there is no dropout)."""
    if drop is None:
        return unused, 0.0, 1.0, _f32(scale)
    _, rp, scale_rp = fp32_scales(drop.p, scale)
    return drop.seed, _f32(drop.p), rp, scale_rp


def _warps_and_stages(opts: AttentionOptions, forward: bool) -> tuple[int, int]:
    """Launch settings, chosen on an H100 (docs/gpu.md): large tiles want 8 warps, and the forward a
    third pipeline stage. They move no rounding point: the tiles and the loop orders are the options'."""
    if opts.block_r * opts.block_c >= 128 * 64:
        return (8, 3) if forward else (8, 2)
    return 4, 2


def _forward(q, k, v, mask4, opts: AttentionOptions, causal: bool, scale: float, is_bf16: bool,
             drop: _Dropout | None = None):
    """q, k, v: [G, n, d] in kernel layout. Returns O (kernel layout), lse2 and the FP32 O (or None)."""
    G, N, d = q.shape
    M = k.shape[1]
    out = torch.empty_like(q)
    lse2 = torch.empty(G, N, dtype=torch.float32, device=q.device)
    o_hp = torch.empty(G, N, d, dtype=torch.float32, device=q.device) if opts.hp_delta else None
    fix = opts.fix
    o_hp_or_unused = lse2 if o_hp is None else o_hp   # written only with HP_DELTA
    seed, p, rp, _ = _dropout_args(drop, lse2, scale)
    args = (q, k, v, *_mask_args(mask4, lse2), seed, p, rp, out, o_hp_or_unused, lse2, N, M, d,
            _f32(scale * LOG2E), _f32(scale), _f32(fix.beta if fix else 1.0), _f32(fix.tie_tol if fix else 0.0))
    constexprs = _common_constexprs(opts, causal, is_bf16, d, mask4, drop) | dict(
        FIX=fix is not None, TIE_EXACT=not (fix and fix.tie_tol), HP_PV=opts.hp_pv, HP_DELTA=opts.hp_delta,
        DECREASING=opts.key_order == "decreasing")
    _launch(_fwd_kernel, (triton.cdiv(N, opts.block_r), G), args, constexprs, *_warps_and_stages(opts, forward=True))
    return out, lse2, o_hp


def _backward(q, k, v, out, lse2, o_hp, do, mask4, opts: AttentionOptions, causal: bool, scale: float,
              is_bf16: bool, drop: _Dropout | None = None):
    """All in kernel layout. Returns dq, dk, dv in kernel layout."""
    G, N, d = q.shape
    M = k.shape[1]
    delta = torch.empty(G, N, dtype=torch.float32, device=q.device)
    consts = _common_constexprs(opts, causal, is_bf16, d, mask4, drop)
    launch = _warps_and_stages(opts, forward=False)
    masking = _mask_args(mask4, lse2)
    _launch(_delta_kernel, (triton.cdiv(N, opts.block_r), G), (do, out if o_hp is None else o_hp, delta, N, d),
            dict(BLOCK_R=opts.block_r, BLOCK_D=consts["BLOCK_D"]), 4, 2)
    if drop is not None:
        delta.mul_(fp32_scales(drop.p, scale)[0])   # as CUDA FA2: D * (1 - p)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    seed, p, rp, grad_scale = _dropout_args(drop, lse2, scale)   # grad_scale: scale * rp, rp folded in as CUDA FA2
    c = _f32(scale * LOG2E)
    _launch(_dkdv_kernel, (triton.cdiv(M, opts.block_c), G),
            (q, k, v, *masking, seed, p, rp, do, lse2, delta, dk, dv, N, M, d, c, grad_scale), consts, *launch)
    _launch(_dq_kernel, (triton.cdiv(N, opts.block_r), G),
            (q, k, v, *masking, seed, p, do, lse2, delta, dq, N, M, d, c, grad_scale), consts, *launch)
    return dq, dk, dv


# -- rounding ---------------------------------------------------------------------------------------

@triton.jit
def _round_to_bf16_bits(x):
    """FP32 -> nearest BF16 (ties to even), as FP32, by integer arithmetic on the bit pattern."""
    bits = x.to(tl.uint32, bitcast=True)
    lowest_kept = (bits >> 16) & 1
    rounded = ((bits + 0x7FFF + lowest_kept) & 0xFFFF0000).to(tl.float32, bitcast=True)
    inf_or_nan = (bits & 0x7F800000) == 0x7F800000
    return tl.where(inf_or_nan, x, rounded)


@triton.jit
def _round_lp(x, IS_BF16: tl.constexpr, EMULATE_LP: tl.constexpr):
    """FP32 -> the low precision, ties to even: a BF16/FP16 tensor, or with EMULATE_LP FP32 holding one."""
    if EMULATE_LP:
        if IS_BF16:
            return _round_to_bf16_bits(x)
        else:
            return x.to(tl.float16).to(tl.float32)
    else:
        if IS_BF16:
            return x.to(tl.bfloat16)
        else:
            return x.to(tl.float16)


@triton.jit
def _dot(a, b):
    # "ieee" matters only for FP32 operands (emulation, hp_pv): no TF32 rounding of the inputs.
    return tl.dot(a, b, input_precision="ieee")


# -- tiles ------------------------------------------------------------------------------------------

@triton.jit
def _load_tile(base, idx, n, HEAD_DIM, BLOCK_D: tl.constexpr):
    """Rows `idx` of an [n, HEAD_DIM] matrix, zero-padded to BLOCK_D columns and beyond row n."""
    cols = tl.arange(0, BLOCK_D)
    mask = (idx < n)[:, None] & (cols < HEAD_DIM)[None, :]
    return tl.load(base + idx[:, None] * HEAD_DIM + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _store_tile(base, idx, n, HEAD_DIM, value, BLOCK_D: tl.constexpr):
    cols = tl.arange(0, BLOCK_D)
    mask = (idx < n)[:, None] & (cols < HEAD_DIM)[None, :]
    tl.store(base + idx[:, None] * HEAD_DIM + cols[None, :], value, mask=mask)


@triton.jit
def _keep(rows, cols, N, M, CAUSAL: tl.constexpr):
    """Which scores of the tile exist and are attended to (causal: key <= query + M - N)."""
    keep = (rows < N)[:, None] & (cols < M)[None, :]
    if CAUSAL:
        keep = keep & (cols[None, :] <= rows[:, None] + (M - N))
    return keep


@triton.jit
def _mask_base(MASK, head, mask_s0, mask_s1, mask_l1):
    """Where this (batch x head) slice's padding mask starts: slice `head` is [head // L1, head % L1]."""
    return MASK + (head // mask_l1) * mask_s0 + (head % mask_l1) * mask_s1


@triton.jit
def _scores(q, k, rows, cols, N, M, mask, mask_sn, mask_sm, CAUSAL: tl.constexpr, MASKED: tl.constexpr):
    """S = Q K^T in FP32, -inf where not attended (causally, or by the padding mask starting at `mask`)."""
    s = _dot(q, tl.trans(k))
    keep = _keep(rows, cols, N, M, CAUSAL)
    if MASKED:
        pad = tl.load(mask + rows[:, None] * mask_sn + cols[None, :] * mask_sm, mask=keep, other=0)
        keep = keep & (pad != 0)
    return tl.where(keep, s, float("-inf"))


@triton.jit
def _kept(seed, head, rows, cols, N, M, p):
    """Which entries of the tile dropout keeps: Philox's uniform at (seed, (slice * N + row) * M + col) >= p,
    so the mask does not depend on the tiling, and the backward's kernels regenerate the forward's."""
    offsets = (head * N + rows[:, None]) * M + cols[None, :]
    return tl.rand(seed, offsets) >= p


@triton.jit
def _load_seed(SEED, DROPOUT: tl.constexpr):
    if DROPOUT:
        return tl.load(SEED)
    else:
        return 0


@triton.jit
def _safe_offset(s, row_max, scale, beta, tie_tol, TIE_EXACT: tl.constexpr):
    """flash_emu._safe_offset: the row max, or with several ties beta * max (max > 0) or 0 (max < 0).
    Masked scores (-inf) never count as ties: they cannot equal a finite max, and a row with no finite
    score is left alone."""
    if TIE_EXACT:
        tied = s == row_max[:, None]
    else:
        tied = (row_max[:, None] - s) * scale <= tie_tol   # NaN or +inf for masked scores: never tied
    several = (tl.sum(tied.to(tl.int32), 1) > 1) & (row_max > float("-inf"))
    offset = tl.where(several & (row_max > 0), row_max * beta, row_max)
    return tl.where(several & (row_max < 0), 0.0, offset)


@triton.jit
def _causal_column_end(r0, N, M, BLOCK_R: tl.constexpr, CAUSAL: tl.constexpr):
    """End of the column tiles the row tile starting at r0 can see."""
    if CAUSAL:
        return tl.minimum(M, r0 + BLOCK_R + (M - N))
    else:
        return M


@triton.jit
def _causal_row_start(c0, N, M, BLOCK_R: tl.constexpr, CAUSAL: tl.constexpr):
    """First row tile that can see column c0 (flash_emu._row_blocks)."""
    if CAUSAL:
        return tl.maximum(c0 - (M - N), 0) // BLOCK_R * BLOCK_R
    else:
        return 0


# -- kernels ----------------------------------------------------------------------------------------

@triton.jit
def _fwd_kernel(Q, K, V, MASK, mask_s0, mask_s1, mask_sn, mask_sm, mask_l1, SEED, p_drop, rp, OUT, O_HP, LSE2, N, M,
                HEAD_DIM, c, scale, beta, tie_tol, CAUSAL: tl.constexpr, MASKED: tl.constexpr, DROPOUT: tl.constexpr,
                FIX: tl.constexpr,
                TIE_EXACT: tl.constexpr, HP_PV: tl.constexpr, HP_DELTA: tl.constexpr, DECREASING: tl.constexpr,
                IS_BF16: tl.constexpr, EMULATE_LP: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr):
    r0 = tl.program_id(0) * BLOCK_R
    head = tl.program_id(1).to(tl.int64)
    q_base, kv_base = head * N * HEAD_DIM, head * M * HEAD_DIM
    rows = r0 + tl.arange(0, BLOCK_R)
    q = _load_tile(Q + q_base, rows, N, HEAD_DIM, BLOCK_D)
    mask = _mask_base(MASK, head, mask_s0, mask_s1, mask_l1)
    seed = _load_seed(SEED, DROPOUT)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    n_tiles = tl.cdiv(_causal_column_end(r0, N, M, BLOCK_R, CAUSAL), BLOCK_C)
    for i in range(0, n_tiles):
        c0 = (n_tiles - 1 - i) * BLOCK_C if DECREASING else i * BLOCK_C
        cols = c0 + tl.arange(0, BLOCK_C)
        k = _load_tile(K + kv_base, cols, M, HEAD_DIM, BLOCK_D)
        v = _load_tile(V + kv_base, cols, M, HEAD_DIM, BLOCK_D)
        s = _scores(q, k, rows, cols, N, M, mask, mask_sn, mask_sm, CAUSAL, MASKED)
        tile_max = tl.max(s, 1)
        if FIX:
            tile_max = _safe_offset(s, tile_max, scale, beta, tie_tol, TIE_EXACT)
        m_new = tl.maximum(m, tile_max)
        m_use = tl.where(tl.abs(m_new) == float("inf"), 0.0, m_new)
        p = tl.math.exp2(s * c - (m_use * c)[:, None])
        alpha = tl.math.exp2(m * c - m_use * c)
        row_sum = alpha * row_sum + tl.sum(p, 1)
        if DROPOUT:   # l above is the undropped sum
            p = tl.where(_kept(seed, head, rows, cols, N, M, p_drop), p, 0.0)
        if HP_PV:
            pv = _dot(p, v.to(tl.float32))
        else:
            pv = _dot(_round_lp(p, IS_BF16, EMULATE_LP), v)
        acc = alpha[:, None] * acc + pv
        m = m_new   # as CUDA FA2: -inf until the row sees a key
    l_safe = tl.where(row_sum > 0, row_sum, 1.0)   # l = 0: the row attends to nothing (its O is 0, its lse2 +inf)
    inv = tl.math.div_rn(1.0, l_safe)
    if DROPOUT:
        inv = inv * rp
    o = tl.where(row_sum[:, None] > 0, acc * inv[:, None], 0.0)   # CUDA FA2: acc * (1 / l), or * ((1 / l) * rp)
    _store_tile(OUT + q_base, rows, N, HEAD_DIM, _round_lp(o, IS_BF16, EMULATE_LP), BLOCK_D)
    if HP_DELTA:
        _store_tile(O_HP + q_base, rows, N, HEAD_DIM, o, BLOCK_D)
    lse2 = tl.where(row_sum > 0, m * c + tl.math.log2(l_safe), float("inf"))
    tl.store(LSE2 + head * N + rows, lse2, mask=rows < N)


@triton.jit
def _delta_kernel(DO, OUT, DELTA, N, HEAD_DIM, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """D = rowsum(dO * O) in FP32; O is the stored low-precision one or the FP32 one (hp_delta)."""
    head = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    do = _load_tile(DO + head * N * HEAD_DIM, rows, N, HEAD_DIM, BLOCK_D).to(tl.float32)
    o = _load_tile(OUT + head * N * HEAD_DIM, rows, N, HEAD_DIM, BLOCK_D).to(tl.float32)
    tl.store(DELTA + head * N + rows, tl.sum(do * o, 1), mask=rows < N)


@triton.jit
def _probs_and_ds(q, k, v, do, lse2, delta, rows, cols, N, M, c, mask, mask_sn, mask_sm, seed, head, p_drop,
                  CAUSAL: tl.constexpr, MASKED: tl.constexpr, DROPOUT: tl.constexpr, IS_BF16: tl.constexpr,
                  EMULATE_LP: tl.constexpr):
    """One tile of the backward: P = exp2(S*c - lse2) in FP32 (zeroed where dropout dropped it), and
    round(P * (dO V^T - D)) with dO V^T zeroed where dropped."""
    s = _scores(q, k, rows, cols, N, M, mask, mask_sn, mask_sm, CAUSAL, MASKED)
    p = tl.math.exp2(s * c - lse2[:, None])
    dp = _dot(do, tl.trans(v))
    if DROPOUT:
        kept = _kept(seed, head, rows, cols, N, M, p_drop)
        dp = tl.where(kept, dp, 0.0)
        ds = _round_lp(p * (dp - delta[:, None]), IS_BF16, EMULATE_LP)
        p = tl.where(kept, p, 0.0)
    else:
        ds = _round_lp(p * (dp - delta[:, None]), IS_BF16, EMULATE_LP)
    return p, ds


@triton.jit
def _load_row_stats(LSE2, DELTA, head, rows, N):
    lse2 = tl.load(LSE2 + head * N + rows, mask=rows < N, other=float("inf"))
    delta = tl.load(DELTA + head * N + rows, mask=rows < N, other=0.0)
    return lse2, delta


@triton.jit
def _dkdv_kernel(Q, K, V, MASK, mask_s0, mask_s1, mask_sn, mask_sm, mask_l1, SEED, p_drop, rp, DO, LSE2, DELTA, DK,
                 DV, N, M, HEAD_DIM, c, scale, CAUSAL: tl.constexpr, MASKED: tl.constexpr, DROPOUT: tl.constexpr,
                 IS_BF16: tl.constexpr, EMULATE_LP: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr):
    """`scale`: the softmax scale, times rp under dropout."""
    c0 = tl.program_id(0) * BLOCK_C
    head = tl.program_id(1).to(tl.int64)
    mask = _mask_base(MASK, head, mask_s0, mask_s1, mask_l1)
    seed = _load_seed(SEED, DROPOUT)
    q_base, kv_base = head * N * HEAD_DIM, head * M * HEAD_DIM
    cols = c0 + tl.arange(0, BLOCK_C)
    k = _load_tile(K + kv_base, cols, M, HEAD_DIM, BLOCK_D)
    v = _load_tile(V + kv_base, cols, M, HEAD_DIM, BLOCK_D)
    dk = tl.zeros([BLOCK_C, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_C, BLOCK_D], tl.float32)
    for r0 in range(_causal_row_start(c0, N, M, BLOCK_R, CAUSAL), N, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        q = _load_tile(Q + q_base, rows, N, HEAD_DIM, BLOCK_D)
        do = _load_tile(DO + q_base, rows, N, HEAD_DIM, BLOCK_D)
        lse2, delta = _load_row_stats(LSE2, DELTA, head, rows, N)
        p, ds = _probs_and_ds(q, k, v, do, lse2, delta, rows, cols, N, M, c, mask, mask_sn, mask_sm, seed, head,
                              p_drop, CAUSAL, MASKED, DROPOUT, IS_BF16, EMULATE_LP)
        dv = dv + _dot(tl.trans(_round_lp(p, IS_BF16, EMULATE_LP)), do)
        dk = dk + _dot(tl.trans(ds), q)
    if DROPOUT:
        dv = dv * rp
    _store_tile(DK + kv_base, cols, M, HEAD_DIM, _round_lp(dk * scale, IS_BF16, EMULATE_LP), BLOCK_D)
    _store_tile(DV + kv_base, cols, M, HEAD_DIM, _round_lp(dv, IS_BF16, EMULATE_LP), BLOCK_D)


@triton.jit
def _dq_kernel(Q, K, V, MASK, mask_s0, mask_s1, mask_sn, mask_sm, mask_l1, SEED, p_drop, DO, LSE2, DELTA, DQ, N, M,
               HEAD_DIM, c, scale, CAUSAL: tl.constexpr, MASKED: tl.constexpr, DROPOUT: tl.constexpr,
               IS_BF16: tl.constexpr, EMULATE_LP: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr):
    """`scale`: the softmax scale, times rp under dropout."""
    r0 = tl.program_id(0) * BLOCK_R
    head = tl.program_id(1).to(tl.int64)
    mask = _mask_base(MASK, head, mask_s0, mask_s1, mask_l1)
    seed = _load_seed(SEED, DROPOUT)
    q_base, kv_base = head * N * HEAD_DIM, head * M * HEAD_DIM
    rows = r0 + tl.arange(0, BLOCK_R)
    q = _load_tile(Q + q_base, rows, N, HEAD_DIM, BLOCK_D)
    do = _load_tile(DO + q_base, rows, N, HEAD_DIM, BLOCK_D)
    lse2, delta = _load_row_stats(LSE2, DELTA, head, rows, N)
    dq = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for c0 in range(0, _causal_column_end(r0, N, M, BLOCK_R, CAUSAL), BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        k = _load_tile(K + kv_base, cols, M, HEAD_DIM, BLOCK_D)
        v = _load_tile(V + kv_base, cols, M, HEAD_DIM, BLOCK_D)
        _, ds = _probs_and_ds(q, k, v, do, lse2, delta, rows, cols, N, M, c, mask, mask_sn, mask_sm, seed, head,
                              p_drop, CAUSAL, MASKED, DROPOUT, IS_BF16, EMULATE_LP)
        dq = dq + _dot(ds, k)
    _store_tile(DQ + q_base, rows, N, HEAD_DIM, _round_lp(dq * scale, IS_BF16, EMULATE_LP), BLOCK_D)
