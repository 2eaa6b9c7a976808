"""The real flash kernel on a CUDA GPU (`replay microbench --mode flash`): does the CPU emulation stand in for it?

For each precision, sequence length N and head dim d (the sweep's, with the sweep's seeded inputs), on the
GPU, causal, [batch, heads, N, d]:

1. Deviation from the FP64 golden value (baseline attention in FP64 on the same rounded inputs, and its
   gradients): max and mean |kernel - golden| of O, dQ, dK, dV for PyTorch SDPA's flash, memory-efficient
   and math backends, the Triton FA2 kernels, the `fa2` emulation (run on the GPU) and BF16/FP16 baseline
   attention: the sweep's table for the GPU's own kernels.
2. Bit for bit against SDPA's flash backend: the fraction of elements of each output that are bitwise
   equal and the fraction within one unit in the last place (ulp), for the `fa2` emulation at each tile
   in `tiles`, with the key tiles visited in increasing order (the emulation's default) and in decreasing
   order (`keys=decreasing`, as CUDA FA2's forward loop runs), on the GPU (and, up to N = 512, on the CPU
   at the first tile), and for the Triton kernels.
3. Where they differ: for the elements of O that differ from flash under the closest emulation, how far the
   emulation's FP32 O (before its one rounding) lies from the nearest rounding boundary of the low
   precision, in units of 2^-24 P|V| (the size of an FP32 rounding error in a sum of its terms), against
   the same for all elements. Differences crowded at boundaries come from FP32-level differences
   (summation order, exp2's last bit, fused multiply-adds), not from a rounding at another place.
4. The Triton kernels against the emulation with the same options (default, the fix, hp-delta,
   keys=decreasing), bitwise fractions; and whether the flash backward repeats bit for bit.

The default batch 4 x 16 heads is a training-sized load; FlashAttention has other code paths for small
loads (split-KV), which this check has not measured.
"""

from __future__ import annotations

import csv
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from replay.errors import UsageError
from replay.experiments.common import Tile, check_sizes, check_tile, tile_name
from replay.experiments.golden import TENSORS, _random_inputs, _run
from replay.kernels import flash_emu
from replay.kernels.baseline import baseline_attention
from replay.kernels.dtypes import DTYPES
from replay.kernels.flash_emu import flash_attention
from replay.kernels.options import KEY_ORDERS, AttentionOptions, SafeSoftmaxFix, check_precision
from replay.kernels.triton_fa2 import triton_flash_attention

TRITON_OPTIONS: dict[str, dict[str, Any]] = {
    "default": {}, "fix=safe-softmax": dict(fix=SafeSoftmaxFix(7.0)), "hp-delta": dict(hp_delta=True),
    "keys=decreasing": dict(key_order="decreasing")}
CPU_MAX_SEQ_LEN = 512
DROPPED_BITS = {torch.bfloat16: 16, torch.float16: 13}   # FP32 mantissa bits a rounding to it drops


@dataclass(frozen=True)
class FlashCheckConfig:
    precisions: tuple[str, ...] = ("bf16", "fp16")
    seq_lens: tuple[int, ...] = (128, 256, 512, 1024, 2048)
    head_dims: tuple[int, ...] = (64, 128)
    tiles: tuple[Tile, ...] = ((128, 128), (128, 64), (64, 128), (64, 64))
    batch: int = 4
    heads: int = 16
    seed: int = 0
    causal: bool = True

    def __post_init__(self):
        def set_(name, value):   # frozen dataclass
            object.__setattr__(self, name, value)
        set_("precisions", tuple(dict.fromkeys(check_precision(p) for p in self.precisions)))
        bad = [p for p in self.precisions if DTYPES[p] not in DROPPED_BITS]
        if bad:
            raise UsageError(f"the flash check compares low-precision kernels: bf16 or fp16, not {bad[0]}")
        set_("seq_lens", check_sizes("sequence lengths", self.seq_lens))
        set_("head_dims", check_sizes("head dims", self.head_dims))
        set_("tiles", tuple(dict.fromkeys(check_tile(t) for t in self.tiles)))
        if not self.tiles:
            raise UsageError("no tiles given")
        check_sizes("batch and heads", [self.batch, self.heads])


@dataclass
class Agreement:
    """How one kernel's output compares with the flash backend's, element by element."""

    equal: float          # fraction bitwise equal
    within_ulp: float     # fraction at most one ulp apart
    max_ulps: int

    @classmethod
    def of(cls, got: torch.Tensor, want: torch.Tensor) -> Agreement:
        distance = ulp_distance(got, want)
        return cls(float((distance == 0).double().mean()), float((distance <= 1).double().mean()),
                   int(distance.max()))


@dataclass
class FlashCheckResult:
    config: FlashCheckConfig
    device: str
    # (kernel, precision, N, d) -> tensor -> (max, mean) of |kernel - golden|
    deviation: dict[tuple[str, str, int, int], dict[str, tuple[float, float]]] = field(default_factory=dict)
    # (variant, precision, N, d) -> tensor -> agreement with the flash backend
    agreement: dict[tuple[str, str, int, int], dict[str, Agreement]] = field(default_factory=dict)
    # (option label, precision, N, d) -> tensor -> agreement of the Triton kernels with the emulation
    triton: dict[tuple[str, str, int, int], dict[str, Agreement]] = field(default_factory=dict)
    # (precision, N, d) -> (variant, boundary distances of differing O elements, of all elements): see _where
    where: dict[tuple[str, int, int], tuple[str, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    deterministic: dict[str, bool] = field(default_factory=dict)   # the flash backward run twice, bitwise
    seconds: float = 0.0

    def summary_lines(self) -> list[str]:
        return _summary(self)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units in the last place of the larger of |a|, |b| in their BF16/FP16 format, elementwise:
    0 when bitwise equal (or +0 and -0), 1 for neighbours; two values either side of 0 count their
    distance in the ulp of the larger, not every representable value between them."""
    assert a.dtype == b.dtype and a.dtype in DROPPED_BITS, (a.dtype, b.dtype)
    info = torch.finfo(a.dtype)
    a, b = a.double(), b.double()
    larger = torch.maximum(a.abs(), b.abs())
    exponent = torch.frexp(larger).exponent   # larger in [2^(exponent-1), 2^exponent)
    ulp = torch.ldexp(torch.full_like(larger, info.eps / 2), exponent)
    return ((a - b).abs() / ulp.clamp(min=info.smallest_normal * info.eps)).ceil().long()


def boundary_distance(x: torch.Tensor, lp: torch.dtype) -> torch.Tensor:
    """FP32 ulps from each FP32 value to the nearest rounding boundary (midpoint) of `lp` in its binade."""
    dropped = DROPPED_BITS[lp]
    low = x.float().contiguous().view(torch.int32) & ((1 << dropped) - 1)
    return (low - (1 << (dropped - 1))).abs()


def check_cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise UsageError("the flash check runs PyTorch's CUDA flash kernel: it needs a CUDA GPU, and this machine "
                         "has none (the sweep and mechanism modes run on the CPU)")
    return torch.device("cuda")


def run_flash_check(cfg: FlashCheckConfig, out_dir: Path, progress: Callable[[str], None] = print) -> FlashCheckResult:
    device = check_cuda()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    result = FlashCheckResult(cfg, torch.cuda.get_device_name(device))
    for d in cfg.head_dims:
        for n in cfg.seq_lens:
            inputs = _random_inputs(cfg.seed, cfg.batch, cfg.heads, n, d)
            for precision in cfg.precisions:
                t0 = time.perf_counter()
                _check_point(cfg, result, precision, n, d, inputs, device)
                progress(f"flash check: {precision} N={n} d={d}: {time.perf_counter() - t0:.1f} s")
    result.deterministic = _flash_backward_determinism(device)
    result.seconds = time.perf_counter() - start
    _write_csv(result, out_dir / "flash.csv")
    return result


def sdpa(backend_name: str, causal: bool, q, k, v) -> torch.Tensor:
    with sdpa_kernel(getattr(SDPBackend, backend_name)):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _triton(opts: AttentionOptions, causal: bool, q, k, v) -> torch.Tensor:
    return triton_flash_attention(q, k, v, opts, causal=causal)


def _check_point(cfg: FlashCheckConfig, result: FlashCheckResult, precision: str, n: int, d: int, inputs,
                 device: torch.device) -> None:
    lp_dtype = DTYPES[precision]
    lp = [x.to(lp_dtype).to(device) for x in inputs]
    golden = _run(partial(baseline_attention, dtype=torch.float64, causal=cfg.causal), [x.double() for x in lp])
    first = AttentionOptions(block_r=cfg.tiles[0][0], block_c=cfg.tiles[0][1])
    kernels = {
        "sdpa-flash": partial(sdpa, "FLASH_ATTENTION", cfg.causal),
        "sdpa-efficient": partial(sdpa, "EFFICIENT_ATTENTION", cfg.causal),
        "sdpa-math": partial(sdpa, "MATH", cfg.causal),
        "triton-fa2": partial(_triton, first, cfg.causal),
        "fa2-emu": partial(flash_attention, opts=first, causal=cfg.causal),
        "baseline": partial(baseline_attention, dtype=lp_dtype, causal=cfg.causal),
    }
    outputs = {}
    for name, kernel in kernels.items():
        outputs[name] = _run(kernel, lp)
        result.deviation[(name, precision, n, d)] = {
            t: (float((x.double() - g).abs().max()), float((x.double() - g).abs().mean()))
            for t, x, g in zip(TENSORS, outputs[name], golden, strict=True)}
    flash = outputs["sdpa-flash"]
    variants = {"triton-fa2": outputs["triton-fa2"]}
    for tile in cfg.tiles:
        for order in KEY_ORDERS:
            opts = AttentionOptions(block_r=tile[0], block_c=tile[1], key_order=order)
            variants[_variant(opts)] = _run(partial(flash_attention, opts=opts, causal=cfg.causal), lp)
    if n <= CPU_MAX_SEQ_LEN:   # the emulation on the CPU, as the CPU results ran it
        variants[f"{_variant(first)}, CPU"] = [
            t.to(device) for t in _run(partial(flash_attention, opts=first, causal=cfg.causal), [x.cpu() for x in lp])]
    for variant, outs in variants.items():
        result.agreement[(variant, precision, n, d)] = _agreement(outs, flash)
    best = max((v for v in variants if v.startswith("fa2-emu") and not v.endswith("CPU")),
               key=lambda v: result.agreement[(v, precision, n, d)]["O"].equal)
    best_opts = next(AttentionOptions(block_r=t[0], block_c=t[1], key_order=o) for t in cfg.tiles for o in KEY_ORDERS
                     if _variant(AttentionOptions(block_r=t[0], block_c=t[1], key_order=o)) == best)
    result.where[(precision, n, d)] = (best, *_where(cfg, best_opts, lp, flash[0], lp_dtype))
    for label, change in TRITON_OPTIONS.items():   # the Triton kernels against the emulation, same options
        opts = first.with_(**change)
        ours = outputs["triton-fa2"] if not change else _run(partial(_triton, opts, cfg.causal), lp)
        emulated = (outputs["fa2-emu"] if not change
                    else _run(partial(flash_attention, opts=opts, causal=cfg.causal), lp))
        result.triton[(label, precision, n, d)] = _agreement(ours, emulated)


def _variant(opts: AttentionOptions) -> str:
    return f"fa2-emu {tile_name((opts.block_r, opts.block_c))} {opts.key_order}"


def _agreement(outputs, reference) -> dict[str, Agreement]:
    return {t: Agreement.of(x, r) for t, x, r in zip(TENSORS, outputs, reference, strict=True)}


def _where(cfg: FlashCheckConfig, opts: AttentionOptions, lp, flash_out: torch.Tensor, lp_dtype: torch.dtype):
    """Where the emulation's O differs from flash's: the distance of the emulation's FP32 O (before its one
    rounding; hp_delta keeps it) from the nearest rounding boundary, in units of u32 * (P|V|), the size
    of FP32 rounding errors in a sum of its terms; for the differing elements and for all."""
    q, k, v = (x.reshape(-1, *x.shape[-2:]) for x in lp[:3])
    scale = q.shape[-1] ** -0.5
    out, _, o_fp32 = flash_emu._fa2_forward(q, k, v, opts.with_(hp_delta=True), cfg.causal, scale, None)
    terms = baseline_attention(q.float(), k.float(), v.float().abs(), torch.float32, cfg.causal, scale)
    midpoint_gap = boundary_distance(o_fp32, lp_dtype).double() * torch.ldexp(
        torch.ones_like(o_fp32, dtype=torch.float64), torch.frexp(o_fp32.double()).exponent - 24)
    distance = midpoint_gap / (2.0 ** -24 * terms.double()).clamp(min=torch.finfo(torch.float32).tiny)
    differs = ulp_distance(out, flash_out.reshape(out.shape)) > 0
    return distance[differs].cpu(), distance.flatten().cpu()


def _flash_backward_determinism(device: torch.device) -> dict[str, bool]:
    """Whether the flash backend's gradients repeat bit for bit, with and without deterministic algorithms
    (strict, as `replay record` sets them: PyTorch then picks FA2's deterministic backward)."""
    g = torch.Generator(device=device).manual_seed(1)
    q, k, v, do = (torch.randn(4, 16, 2048, 64, device=device, generator=g, dtype=torch.bfloat16) for _ in range(4))
    was = torch.are_deterministic_algorithms_enabled()
    answers = {}
    try:
        for deterministic in (False, True):
            torch.use_deterministic_algorithms(deterministic)
            runs = [_run(partial(sdpa, "FLASH_ATTENTION", True), [q, k, v, do]) for _ in range(3)]
            answers[f"deterministic algorithms {'on' if deterministic else 'off'}"] = all(
                torch.equal(a.view(torch.int16), b.view(torch.int16))
                for run in runs[1:] for a, b in zip(runs[0], run, strict=True))
    finally:
        torch.use_deterministic_algorithms(was)
    return answers


def _write_csv(result: FlashCheckResult, path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["table", "kernel", "precision", "seq_len", "head_dim", "tensor", "stat", "value"])
        for (kernel, p, n, d), per_tensor in result.deviation.items():
            for t, (mx, mean) in per_tensor.items():
                w.writerow(["deviation", kernel, p, n, d, t, "max", f"{mx:.6e}"])
                w.writerow(["deviation", kernel, p, n, d, t, "mean", f"{mean:.6e}"])
        for table, rows in (("vs-flash", result.agreement), ("triton-vs-emulation", result.triton)):
            for (variant, p, n, d), agreements in rows.items():
                for t, a in agreements.items():
                    w.writerow([table, variant, p, n, d, t, "equal", f"{a.equal:.6f}"])
                    w.writerow([table, variant, p, n, d, t, "within_ulp", f"{a.within_ulp:.6f}"])
                    w.writerow([table, variant, p, n, d, t, "max_ulps", a.max_ulps])


def _near(distances: torch.Tensor, limit: float) -> float:
    return float((distances <= limit).double().mean()) if distances.numel() else math.nan


def _agreement_table(rows: dict, points, title: str) -> list[str]:
    variants = list(dict.fromkeys(v for v, *_ in rows))
    lines = ["", title, "", "| precision | N | d | " + " | ".join(variants) + " |",
             "|---|---|---|" + "---|" * len(variants)]
    for p, n, d in points:
        cells = []
        for v in variants:
            a = rows.get((v, p, n, d))
            if a is None:
                cells.append("-")
                continue
            cells.append(" / ".join(f"{a[t].equal:.4f}" for t in TENSORS)
                         + f" ({min(a[t].within_ulp for t in TENSORS):.4f})")
        lines.append(f"| {p} | {n} | {d} | " + " | ".join(cells) + " |")
    return lines


def _summary(result: FlashCheckResult) -> list[str]:
    cfg = result.config
    lines = [f"flash check on {result.device}: causal, batch {cfg.batch} x {cfg.heads} heads, "
             f"{result.seconds:.0f} s", "", "Deviation from FP64, max (mean) of |kernel - golden| on O:", ""]
    kernels = list(dict.fromkeys(k for k, *_ in result.deviation))
    lines += ["| precision | N | d | " + " | ".join(kernels) + " |", "|---|---|---|" + "---|" * len(kernels)]
    points = list(dict.fromkeys((p, n, d) for _, p, n, d in result.deviation))
    for p, n, d in points:
        cells = [f"{result.deviation[(k, p, n, d)]['O'][0]:.1e} ({result.deviation[(k, p, n, d)]['O'][1]:.1e})"
                 for k in kernels]
        lines.append(f"| {p} | {n} | {d} | " + " | ".join(cells) + " |")
    lines += _agreement_table(result.agreement, points, "Bitwise equal to SDPA flash: fraction of elements of "
                              "O / dQ / dK / dV (the smallest fraction within one ulp):")
    lines += ["", "Where O differs from flash (the closest emulation): distance of the emulation's FP32 O from the "
              "nearest rounding boundary, in FP32 rounding errors of a sum of its terms (2^-24 P|V|):", "",
              "| precision | N | d | closest emulation | differing | within 1 | within 16 | all: within 1 "
              "| within 16 |",
              "|---|---|---|---|---|---|---|---|---|"]
    for (p, n, d), (variant, differing, every) in result.where.items():
        lines.append(f"| {p} | {n} | {d} | {variant} | {differing.numel()} | {_near(differing, 1):.3f} | "
                     f"{_near(differing, 16):.3f} | {_near(every, 1):.4f} | {_near(every, 16):.4f} |")
    lines += _agreement_table(result.triton, points, "The Triton kernels against the emulation with the same "
                              f"options (tile {tile_name(cfg.tiles[0])}), bitwise: O / dQ / dK / dV (within one ulp):")
    lines += ["", "Flash backward run three times, bitwise equal: " + ", ".join(
        f"{k}: {'yes' if v else 'no'}" for k, v in result.deterministic.items())]
    return lines
