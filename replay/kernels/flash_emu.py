"""A tiled FlashAttention-2 in PyTorch whose rounding points are a named, documented choice.

Two placements (`AttentionOptions.placement`), both round-to-nearest-even through PyTorch's own casts:

`fa2`: what the CUDA FlashAttention-2 kernels do (whose numerics PyTorch's GPU flash backend inherits), for
BF16/FP16 inputs:
  forward   S = Q K^T from low-precision operands, FP32 accumulate; row max in FP32; the softmax scale
            folded into a base-2 exponent: Pbar = exp2(S * scale*log2(e) - m * scale*log2(e)) in FP32; the
            row sum l accumulates the FP32 Pbar; Pbar is rounded to low precision before Pbar @ V (FP32
            accumulate); the O accumulator stays FP32 across tiles, is multiplied by the FP32 reciprocal
            1 / l (as CUDA FA2 does) and rounded once when written; the log-sum-exp is kept in FP32.
  backward  D = rowsum(dO * O) in FP32 from the stored low-precision O; P recomputed in FP32 from the
            LSE; a low-precision copy of P feeds dV = P^T dO; dS = P * (dP - D) in FP32, rounded to low
            precision for the dQ and dK matmuls; dQ, dK, dV accumulate in FP32 and are rounded once.
  Not copied: the GPU's ex2.approx and FMA (here exp2 and the subtraction round separately, which moves
  FP32 values by an ulp or two before they are rounded to BF16; a tie with the row max still gives
  exactly 1), the GPU's accumulation order inside a matmul, and the LSE's units (log2 here, natural log
  in CUDA FA2, converted back in its backward: the same P up to an FP32 ulp).

`reference`: Qiu & Yao's released code, a tiled FA2 written with PyTorch ops under BF16 autocast: every
  intermediate is a low-precision tensor. S = Q K^T rounded, scaled and rounded; Pbar = exp(S - m)
  rounded; the per-tile unnormalised Pbar @ V rounded; the O accumulator, l and m low precision, each
  update rounded; O = acc / l rounded; the backward in low-precision tensors (D, P, dP, dS and the
  running dQ, dK, dV, each rounded as produced).

Attention dropout (kernels/dropout.py; one mask over the whole [..., N, M] per call, drawn before the
tiling, so it does not depend on the tiles), where CUDA FA2 applies it:
  `fa2`     forward: the row sum l accumulates the undropped FP32 Pbar; the dropped entries of the
            low-precision Pbar are zeroed before Pbar @ V; 1 / (1 - p) is folded into the final scaling,
            O = round(acc * ((1 / l) * rp)) with rp = 1 / (1 - p) in FP32. backward: D scaled by 1 - p;
            dV from the dropped P; dS = P * (dP - D) with dP zeroed where dropped; dV_acc * rp and
            dQ_acc, dK_acc * (scale * rp) before rounding.
  `reference` forward as `fa2`, with O = round(round(acc / l) * rp); backward as autograd through
            O = (Z * P * rp) V in low-precision tensors: dV from round(Z * P * rp), dP zeroed where dropped and
            times rp, dS = P * (dP - D).

Options: the safe-softmax fix (per tile, forward only), `hp_delta` (D from an FP32 O: the FA2
accumulator before rounding, or for `reference` an FP32 recomputation), `hp_pv` (Pbar @ V and the O
accumulator in FP32, Pbar not rounded first).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from replay.errors import UsageError
from replay.kernels import numerics
from replay.kernels.baseline import attended, baseline_attention, causal_mask
from replay.kernels.dropout import fp32_scales, keep_mask
from replay.kernels.dtypes import DTYPES
from replay.kernels.options import AttentionOptions, SafeSoftmaxFix

LOG2E = math.log2(math.e)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts: AttentionOptions = AttentionOptions(),
                    causal: bool = True, scale: float | None = None, mask: torch.Tensor | None = None,
                    site: tuple[int, list[int]] | None = None, dropout: float = 0.0,
                    watch: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> torch.Tensor:
    """q: [..., N, d], k and v: [..., M, d]; `mask` (bool, True = attend) broadcasts to [..., N, M].
    `site`: (layer, heads) of a GPT-2's [B, H, N, d] inputs, reported to an active numerics probe.
    `dropout`: attention dropout's probability (see the module docstring). `watch`: given S and P as the
    backward recomputes them (kernels/internals.py)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kept = keep_mask((*q.shape[:-1], k.shape[-2]), dropout, q.device) if dropout else None
    return _FlashEmulation.apply(q, k, v, opts, causal, scale, mask, site, dropout, kept, watch)


class _FlashEmulation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, opts: AttentionOptions, causal: bool, scale: float, mask, site, dropout: float, kept,
                watch):
        in_dtype, lead = q.dtype, q.shape[:-2]
        lp = DTYPES[opts.dtype] if opts.dtype else in_dtype
        q3, k3, v3 = (t.to(lp).reshape(-1, *t.shape[-2:]) for t in (q, k, v))
        n, m = q.shape[-2], k.shape[-2]
        mask3 = None if mask is None else mask.expand(*lead, n, m).reshape(-1, n, m)
        kept3 = None if kept is None else kept.reshape(-1, n, m)
        forward = _fa2_forward if opts.placement == "fa2" else _reference_forward
        out, lse, o_hp = forward(q3, k3, v3, opts, causal, scale, mask3, dropout, kept3)
        probe = numerics.active() if site is not None else None
        o_fp32 = None
        if (opts.hp_delta and o_hp is None) or probe:   # O in FP32 from the same low-precision inputs
            o_fp32 = baseline_attention(q3.float(), k3.float(), v3.float(), torch.float32, causal, scale, mask3,
                                        dropout, kept3)
            o_hp = o_fp32 if opts.hp_delta and o_hp is None else o_hp
        ctx.save_for_backward(q3, k3, v3, out, lse, o_hp, mask3, kept3)
        ctx.opts, ctx.causal, ctx.scale, ctx.in_dtype, ctx.shapes = opts, causal, scale, in_dtype, (q.shape, k.shape)
        ctx.dropout, ctx.watch = dropout, watch
        ctx.probe = None
        if probe:
            keep = attended(q3.shape[1], k3.shape[1], causal, mask3, q.device)
            s = (q3.float() @ k3.float().transpose(1, 2) if opts.placement == "fa2"
                 else (q3 @ k3.transpose(1, 2)) * scale)
            ctx.probe, ctx.site, ctx.lead, ctx.keep = probe, site, lead, keep
            ctx.tied, ctx.o_fp32 = probe.tied_rows(site[0], s, keep), o_fp32
        return out.reshape(q.shape).to(in_dtype)

    @staticmethod
    def backward(ctx, dout):
        q3, k3, v3, out, lse, o_hp, mask3, kept3 = ctx.saved_tensors
        do3 = dout.to(q3.dtype).reshape(out.shape)
        backward = _fa2_backward if ctx.opts.placement == "fa2" else _reference_backward
        whole = None
        if ctx.watch is not None:   # S and P as the tiles recompute them; a tile the backward skips is masked
            held = torch.float32 if ctx.opts.placement == "fa2" else q3.dtype
            shape = (*out.shape[:2], k3.shape[1])
            whole = (torch.full(shape, float("-inf"), dtype=held, device=q3.device),
                     torch.zeros(shape, dtype=held, device=q3.device))
        dq, dk, dv, delta = backward(q3, k3, v3, out, lse, o_hp, do3, ctx.opts, ctx.causal, ctx.scale, mask3,
                                     ctx.dropout, kept3, whole)
        if whole is not None:
            lead = ctx.shapes[0][:-2]
            ctx.watch(*(t.reshape(*lead, *t.shape[1:]) for t in whole))
        if ctx.probe:
            delta_hp = (do3.float() * ctx.o_fp32).sum(-1)
            ctx.probe.delta_error(*ctx.site, ctx.lead, q3, k3, ctx.keep, ctx.scale, delta, delta_hp, ctx.tied)
        q_shape, k_shape = ctx.shapes
        return (dq.reshape(q_shape).to(ctx.in_dtype), dk.reshape(k_shape).to(ctx.in_dtype),
                dv.reshape(k_shape).to(ctx.in_dtype), None, None, None, None, None, None, None, None)


# -- shared tile helpers ---------------------------------------------------------------------------

def _tile_keep(r0, r1, c0, c1, n, m, causal, mask, device) -> torch.Tensor | None:
    """Which scores of tile (rows r0:r1, columns c0:c1) are attended to; None when all are."""
    keep = None
    if causal and c1 - 1 > r0 + (m - n):   # some column lies right of the diagonal
        keep = causal_mask(n, m, device)[r0:r1, c0:c1]
    if mask is not None:
        tile = mask[:, r0:r1, c0:c1]
        keep = tile if keep is None else keep & tile
    return keep


def _mask_tile(s, r0, r1, c0, c1, n, m, causal, mask) -> torch.Tensor:
    keep = _tile_keep(r0, r1, c0, c1, n, m, causal, mask, s.device)
    return s if keep is None else s.masked_fill(~keep, float("-inf"))


def _drop(x: torch.Tensor, kept: torch.Tensor | None, r0, r1, c0, c1) -> torch.Tensor:
    """`x`, one tile (rows r0:r1, columns c0:c1), with the entries dropout drops zeroed (exact)."""
    return x if kept is None else x.masked_fill(~kept[:, r0:r1, c0:c1], 0.0)


def _running_offset(s: torch.Tensor, m: torch.Tensor, fix: SafeSoftmaxFix | None, scale: float) -> torch.Tensor:
    """The offset the tile's scores are exponentiated against: the running max (or, with the fix, the
    running safe offset), 0 for rows that have attended to nothing yet."""
    tile_max = s.amax(-1)
    if fix:
        tile_max = _safe_offset(s, tile_max, fix, scale)
    m_new = torch.maximum(m, tile_max)
    return torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)


def _row_blocks(n, m, block_r, c0, causal):
    """Row tiles that can see column c0 or later (under causal, rows above the diagonal see nothing)."""
    first = 0 if not causal else max(0, c0 - (m - n))
    return range(first - first % block_r, n, block_r)


def _check_underflow(row_sum: torch.Tensor, attended: torch.Tensor, fix: SafeSoftmaxFix | None) -> None:
    """A row that attends to something but whose probabilities all underflowed (to 0, or to subnormals
    whose reciprocal overflows to inf and makes the output NaN): a beta too large."""
    if fix is not None and bool(((row_sum.float() < torch.finfo(torch.float32).tiny) & attended).any()):
        raise UsageError(f"safe-softmax beta={fix.beta:g} underflows: exp(-(beta - 1) * max score) is 0 for some "
                         "rows, which would silently zero their output; use a smaller beta (the paper uses 2-8)")


def _safe_offset(s: torch.Tensor, row_max: torch.Tensor, fix: SafeSoftmaxFix, scale: float) -> torch.Tensor:
    """The offset to subtract per row of one tile: the row max, or with ties beta * max (max > 0) or 0
    (max < 0). Computed in the dtype of `s`, so a low-precision beta * max rounds as the kernel's would."""
    finite = torch.isfinite(s)
    if fix.tie_tol:
        tied = finite & ((row_max[..., None] - s) * scale <= fix.tie_tol)
    else:
        tied = finite & (s == row_max[..., None])
    several = tied.sum(-1) > 1
    offset = torch.where(several & (row_max > 0), row_max * fix.beta, row_max)
    return torch.where(several & (row_max < 0), torch.zeros_like(row_max), offset)


# -- the fa2 placement -----------------------------------------------------------------------------

def _fa2_forward(q, k, v, opts: AttentionOptions, causal, scale, mask, dropout=0.0, kept=None):
    lp = q.dtype
    G, N, d = q.shape
    M = k.shape[1]
    c = torch.tensor(scale * LOG2E, dtype=torch.float32).item()   # the kernel's FP32 scale * log2(e)
    out = torch.empty_like(q)
    lse2 = torch.empty(G, N, dtype=torch.float32, device=q.device)   # log2-sum-exp2, in units of S * c
    o_hp = torch.empty(G, N, d, dtype=torch.float32, device=q.device) if opts.hp_delta else None
    kf, vf = k.float(), v.float()
    for r0 in range(0, N, opts.block_r):
        r1 = min(N, r0 + opts.block_r)
        qi = q[:, r0:r1].float()
        m = torch.full((G, r1 - r0), float("-inf"), device=q.device)
        row_sum = torch.zeros(G, r1 - r0, device=q.device)
        acc = torch.zeros(G, r1 - r0, d, device=q.device)
        attended = torch.zeros(G, r1 - r0, dtype=torch.bool, device=q.device)
        last_col = M if not causal else min(M, r1 + (M - N))
        for c0 in _key_tiles(last_col, opts):
            c1 = min(M, c0 + opts.block_c)
            s = qi @ kf[:, c0:c1].transpose(1, 2)
            s = _mask_tile(s, r0, r1, c0, c1, N, M, causal, mask)
            attended |= torch.isfinite(s.amax(-1))
            m_use = _running_offset(s, m, opts.fix, scale)
            p = torch.exp2(s * c - (m_use * c)[..., None])
            alpha = torch.exp2(m * c - m_use * c)
            row_sum = alpha * row_sum + p.sum(-1)
            pv = _drop(p if opts.hp_pv else p.to(lp).float(), kept, r0, r1, c0, c1)
            acc = alpha[..., None] * acc + pv @ vf[:, c0:c1]
            m = torch.where(attended, m_use, m)   # as CUDA FA2: -inf until the row sees a key
        _check_underflow(row_sum, attended, opts.fix)
        inv = 1.0 / row_sum if kept is None else (1.0 / row_sum) * fp32_scales(dropout, scale)[1]
        o = torch.where(row_sum[..., None] > 0, acc * inv[..., None], torch.zeros_like(acc))   # as CUDA FA2
        out[:, r0:r1] = o.to(lp)
        lse2[:, r0:r1] = torch.where(row_sum > 0, m * c + torch.log2(row_sum), torch.full_like(row_sum, float("inf")))
        if o_hp is not None:
            o_hp[:, r0:r1] = o
    return out, lse2, o_hp


def _key_tiles(last_col: int, opts: AttentionOptions) -> range:
    """First columns of the key tiles a row tile visits, in the forward's order."""
    tiles = range(0, last_col, opts.block_c)
    return tiles[::-1] if opts.key_order == "decreasing" else tiles


def _fa2_backward(q, k, v, out, lse2, o_hp, dout, opts: AttentionOptions, causal, scale, mask, dropout=0.0, kept=None,
                  whole=None):
    lp = q.dtype
    G, N, d = q.shape
    M = k.shape[1]
    c = torch.tensor(scale * LOG2E, dtype=torch.float32).item()
    qf, dof = q.float(), dout.float()
    D = (dof * (o_hp if opts.hp_delta else out.float())).sum(-1)
    keep, rp, scale_rp = fp32_scales(dropout, scale)
    D_used = D if kept is None else D * keep   # as CUDA FA2: D * (1 - p), and rp folded into the final scalings
    grad_scale = scale if kept is None else scale_rp
    dq_acc = torch.zeros(G, N, d, device=q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    for c0 in range(0, M, opts.block_c):
        c1 = min(M, c0 + opts.block_c)
        kj, vj = k[:, c0:c1].float(), v[:, c0:c1].float()
        dk_acc = torch.zeros(G, c1 - c0, d, device=q.device)
        dv_acc = torch.zeros(G, c1 - c0, d, device=q.device)
        for r0 in _row_blocks(N, M, opts.block_r, c0, causal):
            r1 = min(N, r0 + opts.block_r)
            s = qf[:, r0:r1] @ kj.transpose(1, 2)
            s = _mask_tile(s, r0, r1, c0, c1, N, M, causal, mask)
            p = torch.exp2(s * c - lse2[:, r0:r1, None])
            if whole is not None:   # S in the units of the other backends: the FP32 product times the scale
                whole[0][:, r0:r1, c0:c1], whole[1][:, r0:r1, c0:c1] = s * scale, p
            dv_acc += _drop(p, kept, r0, r1, c0, c1).to(lp).float().transpose(1, 2) @ dof[:, r0:r1]
            dp = _drop(dof[:, r0:r1] @ vj.transpose(1, 2), kept, r0, r1, c0, c1)
            ds = (p * (dp - D_used[:, r0:r1, None])).to(lp).float()
            dq_acc[:, r0:r1] += ds @ kj
            dk_acc += ds.transpose(1, 2) @ qf[:, r0:r1]
        dk[:, c0:c1] = (dk_acc * grad_scale).to(lp)
        dv[:, c0:c1] = (dv_acc if kept is None else dv_acc * rp).to(lp)
    return (dq_acc * grad_scale).to(lp), dk, dv, D


# -- the reference placement -----------------------------------------------------------------------

def _reference_forward(q, k, v, opts: AttentionOptions, causal, scale, mask, dropout=0.0, kept=None):
    lp = q.dtype
    G, N, d = q.shape
    M = k.shape[1]
    acc_dtype = torch.float32 if opts.hp_pv else lp
    out = torch.empty_like(q)
    lse = torch.empty(G, N, dtype=lp, device=q.device)
    for r0 in range(0, N, opts.block_r):
        r1 = min(N, r0 + opts.block_r)
        qi = q[:, r0:r1]
        m = torch.full((G, r1 - r0), float("-inf"), dtype=lp, device=q.device)
        row_sum = torch.zeros(G, r1 - r0, dtype=lp, device=q.device)
        acc = torch.zeros(G, r1 - r0, d, dtype=acc_dtype, device=q.device)
        attended = torch.zeros(G, r1 - r0, dtype=torch.bool, device=q.device)
        last_col = M if not causal else min(M, r1 + (M - N))
        for c0 in range(0, last_col, opts.block_c):
            c1 = min(M, c0 + opts.block_c)
            s = (qi @ k[:, c0:c1].transpose(1, 2)) * scale
            s = _mask_tile(s, r0, r1, c0, c1, N, M, causal, mask)
            attended |= torch.isfinite(s.amax(-1))
            m_use = _running_offset(s, m, opts.fix, scale=1.0)   # s is already scaled
            p = torch.exp(s - m_use[..., None])
            alpha = torch.exp(m - m_use)
            row_sum = alpha * row_sum + p.sum(-1)
            p = _drop(p, kept, r0, r1, c0, c1)
            pv = p.float() @ v[:, c0:c1].float() if opts.hp_pv else p @ v[:, c0:c1]
            acc = alpha[..., None].to(acc_dtype) * acc + pv
            m = m_use
        _check_underflow(row_sum, attended, opts.fix)
        o = torch.where(row_sum[..., None] > 0, acc / row_sum[..., None].to(acc_dtype), torch.zeros_like(acc))
        if kept is not None:
            o = o * (1.0 / (1.0 - dropout))
        out[:, r0:r1] = o.to(lp)
        lse[:, r0:r1] = torch.where(row_sum > 0, m + torch.log(row_sum), torch.full_like(row_sum, float("inf")))
    return out, lse, None


def _reference_backward(q, k, v, out, lse, o_hp, dout, opts: AttentionOptions, causal, scale, mask,
                        dropout=0.0, kept=None, whole=None):
    G, N, d = q.shape
    M = k.shape[1]
    D = (dout.float() * o_hp).sum(-1) if opts.hp_delta else (dout * out).sum(-1)
    dq = torch.zeros_like(q)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    for c0 in range(0, M, opts.block_c):
        c1 = min(M, c0 + opts.block_c)
        kj, vj = k[:, c0:c1], v[:, c0:c1]
        dk_j, dv_j = torch.zeros_like(kj), torch.zeros_like(vj)
        for r0 in _row_blocks(N, M, opts.block_r, c0, causal):
            r1 = min(N, r0 + opts.block_r)
            s = (q[:, r0:r1] @ kj.transpose(1, 2)) * scale
            s = _mask_tile(s, r0, r1, c0, c1, N, M, causal, mask)
            p = torch.exp(s - lse[:, r0:r1, None])
            if whole is not None:
                whole[0][:, r0:r1, c0:c1], whole[1][:, r0:r1, c0:c1] = s, p
            dv_j = dv_j + _dropped_scaled(p, kept, r0, r1, c0, c1, dropout).transpose(1, 2) @ dout[:, r0:r1]
            dp = _dropped_scaled(dout[:, r0:r1] @ vj.transpose(1, 2), kept, r0, r1, c0, c1, dropout)
            ds = (p * (dp - D[:, r0:r1, None])).to(q.dtype)
            dq[:, r0:r1] = dq[:, r0:r1] + (ds @ kj) * scale
            dk_j = dk_j + (ds.transpose(1, 2) @ q[:, r0:r1]) * scale
        dk[:, c0:c1], dv[:, c0:c1] = dk_j, dv_j
    return dq, dk, dv, D


def _dropped_scaled(x: torch.Tensor, kept: torch.Tensor | None, r0, r1, c0, c1, dropout: float) -> torch.Tensor:
    """A tile with dropout applied as its autograd would: dropped entries zeroed, kept ones times 1 / (1 - p)."""
    return x if kept is None else _drop(x * (1.0 / (1.0 - dropout)), kept, r0, r1, c0, c1)
