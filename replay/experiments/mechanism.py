"""Qiu & Yao, "Why Low-Precision Transformer Training Fails": the biased rounding at tied maxima
(`replay microbench --mode mechanism`).

Mechanism (`run_mechanism`, Qiu & Yao, "Why Low-Precision Transformer Training Fails")
  Each trial is one independent query row over `n_keys` keys, all trials in one batched call: the row
  has `n` keys tied exactly at its maximum scaled score r ~ U(top_score), the other keys' scores r - g,
  g ~ U(gap), all exact BF16 values (q = e_0 and softmax scale 1, so the score of key j is exactly its
  first component; the tied keys are identical vectors), the tied keys in the first tile. V ~ N(v_mean,
  v_std) (mostly negative by default), dO ~ N(do_mean, do_std) (one sign, so a bias of O becomes a bias
  of delta). Golden: FP64 attention on the same low-precision inputs.
  Measured per (kernel, fix, n): the signed error of O and of delta = rowsum(dO * O) (the kernel's O,
  the row sum done exactly) against the golden, as the mean over rows of the row's mean error with a 95%
  confidence interval (1.96 std / sqrt(rows)), and the same for the relative error (error / |golden|,
  elementwise, then averaged). Also rows zeroed, NaN rows, rows off by more than 5%, and whether the
  kernel refused the case or warned. Writes mechanism.csv and mechanism.png (bars with the CIs).
"""

from __future__ import annotations

import csv
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure

from replay.errors import UsageError
from replay.experiments.common import (
    PLACEMENT_OF,
    check_sizes,
    torch_threads,
)
from replay.kernels.baseline import baseline_attention
from replay.kernels.dtypes import DTYPES
from replay.kernels.flash_emu import flash_attention
from replay.kernels.options import AttentionOptions, SafeSoftmaxFix, check_precision

# == the mechanism =================================================================================

@dataclass(frozen=True)
class MechanismConfig:
    trials: int = 20_000                     # independent query rows, one batched call per case
    n_keys: int = 64
    head_dim: int = 32
    n_tied: tuple[int, ...] = (1, 2, 3, 4)   # keys tied exactly at the row max
    betas: tuple[float, ...] = (2.0, 7.0, 1.0001, 25.0, 1000.0)   # safe-softmax fix; outside [2, 8]: edge cases
    top_score: tuple[float, float] = (0.5, 4.0)   # the tied maximum r (scaled logit) ~ U(lo, hi)
    gap: tuple[float, float] = (12.0, 24.0)       # other keys at r - U(lo, hi)
    v_mean: float = -1.0
    v_std: float = 0.5
    do_mean: float = 1.0
    do_std: float = 0.5
    block: int = 128                         # B_r = B_c
    precision: str = "bf16"
    seed: int = 0
    threads: int = 1                         # torch intra-op threads while running (restored after)

    def __post_init__(self):
        def set_(name, value):   # frozen dataclass
            object.__setattr__(self, name, value)
        check_precision(self.precision)
        check_sizes("trials", [self.trials], minimum=2)
        check_sizes("n_keys, head_dim, block and threads", [self.n_keys, self.head_dim, self.block, self.threads])
        set_("n_tied", check_sizes("tied maxima", self.n_tied))
        if max(self.n_tied) > min(self.n_keys, self.block):
            raise UsageError(f"{max(self.n_tied)} tied keys do not fit in the {min(self.n_keys, self.block)} keys "
                             "of one tile")
        set_("betas", tuple(dict.fromkeys(float(b) for b in self.betas)))
        if any(not b > 1 for b in self.betas):
            raise UsageError(f"safe-softmax beta must be > 1, got {min(self.betas)}")
        for name in ("top_score", "gap"):
            lo, hi = (float(x) for x in getattr(self, name))
            if not lo <= hi:
                raise UsageError(f"{name} range must be lo <= hi, got ({lo}, {hi})")
            set_(name, (lo, hi))
        if self.gap[0] <= 0:
            raise UsageError(f"the other keys must score below the tied maximum: gap must be > 0, got {self.gap[0]}")


@dataclass
class MechanismRow:
    kernel: str
    beta: float | None                     # None: no fix
    n_tied: int
    status: str = "ok"                     # ok | refused
    note: str = ""                         # the kernel's warning or refusal, or what happened
    o_err: tuple[float, float] = (math.nan, math.nan)       # (mean, 95% CI half-width) of the row mean error
    o_rel: tuple[float, float] = (math.nan, math.nan)
    delta_err: tuple[float, float] = (math.nan, math.nan)
    delta_rel: tuple[float, float] = (math.nan, math.nan)
    zero_rows: float = math.nan            # fraction of rows whose O is all zero
    nan_rows: float = math.nan
    off_rows: float = math.nan             # fraction of rows with some |relative error| > 5%
    same_as_no_fix: bool | None = None     # O bitwise equal to the same kernel without the fix


@dataclass
class MechanismResult:
    config: MechanismConfig
    rows: list[MechanismRow]
    underflow: dict[float, tuple[float, float]]   # beta -> rows whose exp(-(beta-1) r) is 0 / subnormal in FP32
    seconds: float
    csv_path: Path
    plot_path: Path

    def row(self, kernel: str, n_tied: int, beta: float | None = None) -> MechanismRow:
        return next(r for r in self.rows if r.kernel == kernel and r.n_tied == n_tied and r.beta == beta)

    @property
    def paths(self) -> list[Path]:
        return [self.csv_path, self.plot_path]

    def summary_lines(self) -> list[str]:
        return _mechanism_summary(self)


def run_mechanism(cfg: MechanismConfig, out_dir: Path, progress: Callable[[str], None] = print) -> MechanismResult:
    with torch_threads(cfg.threads):
        return _run_mechanism(cfg, Path(out_dir), progress)


def _run_mechanism(cfg: MechanismConfig, out_dir: Path, progress: Callable[[str], None]) -> MechanismResult:
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    rows: list[MechanismRow] = []
    tops = []
    for n in cfg.n_tied:
        t0 = time.perf_counter()
        q, k, v, d_out, top = _tied_rows(cfg, n)
        tops.append(top)
        golden = baseline_attention(q.double(), k.double(), v.double(), torch.float64, causal=False, scale=1.0)
        golden = golden[:, 0]
        base = baseline_attention(q, k, v, DTYPES[cfg.precision], causal=False, scale=1.0)
        rows.append(_bias_row("baseline", None, n, base[:, 0], golden, d_out))
        for kernel, placement in PLACEMENT_OF.items():
            no_fix = None
            for beta in (None, *cfg.betas):
                row = MechanismRow(kernel, beta, n)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    try:
                        fix = SafeSoftmaxFix(beta) if beta else None
                        opts = AttentionOptions(placement=placement, block_r=cfg.block, block_c=cfg.block, fix=fix)
                        out = flash_attention(q, k, v, opts, causal=False, scale=1.0)[:, 0]
                    except UsageError as e:
                        row.status, row.note = "refused", str(e)
                        out = None
                if out is not None:
                    row = _bias_row(kernel, beta, n, out, golden, d_out)
                    row.note = "; ".join(dict.fromkeys(str(w.message) for w in caught))
                    if beta is None:
                        no_fix = out
                    else:
                        row.same_as_no_fix = bool(torch.equal(out, no_fix)) if no_fix is not None else None
                rows.append(row)
        progress(f"mechanism: n={n} tied maxima, {cfg.trials} rows, {len(cfg.betas) + 1} fix settings x 2 "
                 f"placements + baseline: {time.perf_counter() - t0:.1f} s")
    underflow = {}
    r = torch.cat(tops).float()
    for beta in cfg.betas:
        p = torch.exp(-(beta - 1) * r)
        underflow[beta] = ((p == 0).float().mean().item(),
                           ((p > 0) & (p < torch.finfo(torch.float32).tiny)).float().mean().item())
    result = MechanismResult(cfg, rows, underflow, 0.0, out_dir / "mechanism.csv", out_dir / "mechanism.png")
    _write_mechanism_csv(result)
    _plot_mechanism(result)
    result.seconds = time.perf_counter() - start
    return result


def _tied_rows(cfg: MechanismConfig, n: int):
    """q [T, 1, d], k, v [T, N, d], dO [T, d] in the precision, and the row maxima r [T] (see module doc)."""
    lp = DTYPES[cfg.precision]
    gen = torch.Generator().manual_seed(int(np.random.SeedSequence([cfg.seed, n]).generate_state(1)[0]))
    T, N, d = cfg.trials, cfg.n_keys, cfg.head_dim

    def uniform(lo_hi, *shape):
        return torch.rand(*shape, generator=gen, dtype=torch.float64) * (lo_hi[1] - lo_hi[0]) + lo_hi[0]

    top = uniform(cfg.top_score, T).to(lp).double()
    scores = (top[:, None] - uniform(cfg.gap, T, N)).to(lp).double()
    tied = torch.rand(T, min(N, cfg.block), generator=gen).argsort(-1)[:, :n]   # n distinct keys of the first tile
    k = torch.randn(T, N, d, generator=gen, dtype=torch.float64)
    k[..., 0] = scores
    shared = torch.cat([top[:, None, None], k[:, :1, 1:]], -1)   # one key vector per row, copied to the tied slots
    k.scatter_(1, tied[..., None].expand(T, n, d), shared.expand(T, n, d))
    k = k.to(lp)
    ties = (k[..., 0].double() == top[:, None]).sum(-1)
    if not bool((ties == n).all()):
        raise UsageError(f"the gap {cfg.gap} is too small: other scores round to the tied maximum at {cfg.precision}")
    q = torch.zeros(T, 1, d, dtype=lp)
    q[..., 0] = 1
    v = (torch.randn(T, N, d, generator=gen, dtype=torch.float64) * cfg.v_std + cfg.v_mean).to(lp)
    d_out = (torch.randn(T, d, generator=gen, dtype=torch.float64) * cfg.do_std + cfg.do_mean).to(lp)
    return q, k, v, d_out, top


def _mean_ci(x: torch.Tensor) -> tuple[float, float]:
    x = x[torch.isfinite(x)]
    if x.numel() < 2:
        return math.nan, math.nan
    return x.mean().item(), 1.96 * x.std().item() / math.sqrt(x.numel())


def _bias_row(kernel, beta, n, out, golden, d_out) -> MechanismRow:
    out, d_out = out.double(), d_out.double()
    err = out - golden
    delta_err = (d_out * err).sum(-1)
    delta_golden = (d_out * golden).sum(-1)
    rel = err / golden.abs()
    return MechanismRow(
        kernel, beta, n,
        o_err=_mean_ci(err.mean(-1)), o_rel=_mean_ci(rel.mean(-1)),
        delta_err=_mean_ci(delta_err), delta_rel=_mean_ci(delta_err / delta_golden.abs()),
        zero_rows=(out == 0).all(-1).double().mean().item(), nan_rows=out.isnan().any(-1).double().mean().item(),
        off_rows=(rel.abs() > 0.05).any(-1).double().mean().item())


def _fix_name(beta: float | None) -> str:
    return "no fix" if beta is None else f"beta={beta:g}"


def _write_mechanism_csv(result: MechanismResult) -> None:
    cfg = result.config
    with open(result.csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["kernel", "fix_beta", "n_tied", "trials", "precision", "status", "o_err_mean", "o_err_ci95",
                    "o_rel_mean", "o_rel_ci95", "delta_err_mean", "delta_err_ci95", "delta_rel_mean",
                    "delta_rel_ci95", "zero_rows", "nan_rows", "rows_off_5pct", "same_as_no_fix", "note"])
        for r in result.rows:
            nums = [*r.o_err, *r.o_rel, *r.delta_err, *r.delta_rel, r.zero_rows, r.nan_rows, r.off_rows]
            same = "" if r.same_as_no_fix is None else int(r.same_as_no_fix)
            w.writerow([r.kernel, "" if r.beta is None else f"{r.beta:g}", r.n_tied, cfg.trials, cfg.precision,
                        r.status, *(f"{x:.6e}" for x in nums), same, r.note])


def _plot_mechanism(result: MechanismResult) -> None:
    cfg = result.config
    fig = Figure(figsize=(12, 7), layout="constrained")
    axes = fig.subplots(2, 2, squeeze=False)
    fig.suptitle(f"{cfg.precision.upper()} signed relative error (mean, 95% CI) with n tied row maxima; "
                 f"{cfg.trials} rows each; V ~ N({cfg.v_mean:g}, {cfg.v_std:g}); left out: cases the kernel refused or "
                 "that gave zero or NaN rows", fontsize=10)
    plotted = [r for r in result.rows if r.status == "ok" and not (r.zero_rows > 0 or r.nan_rows > 0)]
    fixes = [None, *cfg.betas]
    colors = dict(zip(fixes, ["tab:red", "tab:blue", "tab:green", "tab:orange", "tab:purple", "tab:brown",
                              "tab:pink", "tab:olive", "tab:cyan"] * 3, strict=False))
    for col, kernel in enumerate(PLACEMENT_OF):
        for row_i, (attr, label) in enumerate([("o_rel", "O"), ("delta_rel", "delta = rowsum(dO * O)")]):
            ax = axes[row_i][col]
            series = [("baseline", None, "0.5", "baseline")] + [(kernel, b, colors[b], _fix_name(b)) for b in fixes]
            width = 0.8 / len(series)
            for si, (kern, beta, color, name) in enumerate(series):
                xs, ys, cis = [], [], []
                for ni, n in enumerate(cfg.n_tied):
                    match = [r for r in plotted if r.kernel == kern and r.beta == beta and r.n_tied == n]
                    if match:
                        xs.append(ni + (si - (len(series) - 1) / 2) * width)
                        ys.append(getattr(match[0], attr)[0])
                        cis.append(getattr(match[0], attr)[1])
                if xs:
                    ax.bar(xs, ys, width, yerr=cis, color=color, label=name, capsize=2)
            ax.axhline(0, color="k", linewidth=0.6)
            ax.set_xticks(range(len(cfg.n_tied)), [f"n={n}" for n in cfg.n_tied])
            ax.set_title(f"{kernel}: relative error of {label}", fontsize=9)
            ax.grid(True, axis="y", alpha=0.3)
    for ax in axes[0]:
        ax.legend(fontsize=7)
    fig.savefig(result.plot_path, dpi=90)


def _change(before: float, after: float) -> str:
    if before == 0 or after == 0 or math.isnan(before) or math.isnan(after):
        return f"|bias| {before:.1e} -> {after:.1e}"
    return f"|bias| /{before / after:.1f}" if after <= before else f"|bias| x{after / before:.1f}"


def _excludes_zero(stat: tuple[float, float]) -> bool:
    return abs(stat[0]) > stat[1]


def _mechanism_summary(result: MechanismResult) -> list[str]:
    cfg = result.config
    P = cfg.precision.upper()
    header = (f"mechanism: {cfg.trials} independent {P} rows per case in {result.seconds:.1f} s; each row: one query "
              f"over {cfg.n_keys} keys (tile {cfg.block}), d={cfg.head_dim}; n keys tied exactly at the row max r ~ "
              f"U{cfg.top_score} (scaled logit), the others r - U{cfg.gap}; V ~ N({cfg.v_mean:g}, {cfg.v_std:g}), "
              f"dO ~ N({cfg.do_mean:g}, {cfg.do_std:g}); golden = FP64 attention on the same inputs; "
              "numbers: mean signed relative error (error/|golden|) +- 95% CI")
    lines = [header, "wrote " + ", ".join(str(p) for p in result.paths)]
    regular = [b for b in cfg.betas if 2 <= b <= 8]
    def fmt(s):
        return f"{s[0]:+.2e}+-{s[1]:.0e}"

    def cell(r: MechanismRow, attr: str) -> str:
        if r.status != "ok":
            return f"{_fix_name(r.beta)} refused"
        extra = (f" [{r.zero_rows:.1%} rows zero]" if r.zero_rows > 0 else "") + (
            f" [{r.nan_rows:.1%} rows NaN]" if r.nan_rows > 0 else "")
        return f"{_fix_name(r.beta)} {fmt(getattr(r, attr))}{extra}"

    for attr, label in [("o_rel", "O"), ("delta_rel", "delta")]:
        for n in cfg.n_tied:
            parts = [f"baseline {fmt(getattr(result.row('baseline', n), attr))}"]
            for kernel in PLACEMENT_OF:
                parts.append(f"{kernel}: " + ", ".join(cell(result.row(kernel, n, b), attr) for b in (None, *regular)))
            lines.append(f"{label} n={n}: " + " | ".join(parts))
    tied = [n for n in cfg.n_tied if n > 1]
    if tied:
        base = [result.row("baseline", n).o_rel for n in tied]
        lines.append(f"baseline ({P} materialised attention), n={','.join(map(str, tied))}: O bias "
                     + ", ".join(f"{b[0]:+.2e}" + ("" if _excludes_zero(b) else " (CI includes 0)") for b in base))
    for kernel in PLACEMENT_OF:
        for n in tied:
            none = result.row(kernel, n, None).o_rel
            sign = "negative" if none[0] < 0 else "positive"
            line = (f"{kernel}, n={n}, no fix: {sign} O bias {none[0]:+.2e} "
                    f"({'95% CI excludes 0' if _excludes_zero(none) else '95% CI includes 0'})")
            for b in regular:
                fixed = result.row(kernel, n, b).o_rel
                if math.isnan(fixed[0]):
                    continue
                if not _excludes_zero(fixed):
                    effect = "CI includes 0"
                elif fixed[0] * none[0] < 0:
                    effect = f"sign flips to {fixed[0]:+.2e}"
                else:
                    effect = f"{fixed[0]:+.2e}"
                line += f"; beta={b:g}: {_change(abs(none[0]), abs(fixed[0]))} ({effect})"
            lines.append(line)
    for b in (b for b in cfg.betas if b not in regular):
        zero, sub = result.underflow[b]
        parts = []
        for kernel in PLACEMENT_OF:
            rs = [result.row(kernel, n, b) for n in cfg.n_tied]
            refused = [r for r in rs if r.status == "refused"]
            if refused:
                parts.append(f"{kernel} refused at n={','.join(str(r.n_tied) for r in refused)} ({refused[0].note})")
                rs = [r for r in rs if r.status == "ok" and r.n_tied > 1]   # at n = 1 the fix never triggers
                if not rs:
                    continue
            worst = max(rs, key=lambda r: abs(r.o_rel[0]))
            desc = (f"{kernel} bias (finite rows) up to {worst.o_rel[0]:+.2e} (n={worst.n_tied}), zero rows up to "
                    f"{max(r.zero_rows for r in rs):.1%}, NaN rows {max(r.nan_rows for r in rs):.1%}, "
                    f"rows off by >5% up to {max(r.off_rows for r in rs):.1%}")
            if all(r.same_as_no_fix for r in rs):
                desc += ", outputs bitwise identical to no fix"
            parts.append(desc)
        notes = {r.note for r in result.rows if r.beta == b and r.status == "ok" and r.note}
        lines.append(f"edge beta={b:g}: exp(-(beta-1) r) is 0 in FP32 for {zero:.1%} of rows, subnormal for {sub:.1%}; "
                     + "; ".join(parts) + (f"; kernel warned: {' / '.join(notes)}" if notes else ""))
    return lines
