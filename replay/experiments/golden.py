"""Golden et al., "Is Flash Attention Stable?": the deviation sweep (`replay microbench --mode sweep`).

Sweep (`run_sweep`, Golden et al., "Is Flash Attention Stable?")
  Inputs: q, k, v and the upstream gradient dO, [batch, heads, N, d], drawn i.i.d. standard normal in
  FP64 from one seed per (N, d) (every tile and precision sees the same draw), then rounded to the
  precision under test (round-to-nearest-even).
  Golden value: baseline attention in FP64 on those rounded inputs upcast to FP64 (an exact upcast),
  and its gradients dQ, dK, dV by FP64 autograd with the rounded dO.
  Metric: |kernel - golden| elementwise over the whole tensor, for O, dQ, dK, dV; its max, mean and
  (population) std.
  Points: the sequence lengths at one tile and the tiles at one length, as the paper sweeps them (or the
  full grid), each at every head dim and precision. Baseline attention does not tile: it is measured once
  per (precision, N, d).
  Also recorded: max and mean |golden| per tensor (the scale to read deviations against) and each
  kernel's forward + backward wall time.
  Writes sweep.csv (one row per configuration, tensor and statistic), sweep.zarr (one array per
  statistic, dims kernel x precision x seq_len x tile x head_dim x tensor, opens in xarray.open_zarr) and
  four PNGs (max and mean deviation vs sequence length and vs tile shape, one line per kernel).
  Under causal attention the max is set by the first rows (few keys, large outputs), which no tiling
  changes; tile effects show in the mean.
"""

from __future__ import annotations

import csv
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch
import zarr
from matplotlib.figure import Figure

from replay.errors import UsageError
from replay.experiments.common import (
    KERNELS,
    PLACEMENT_OF,
    Tile,
    check_sizes,
    check_tile,
    tile_name,
    torch_threads,
)
from replay.kernels.baseline import baseline_attention
from replay.kernels.dtypes import DTYPES
from replay.kernels.flash_emu import flash_attention
from replay.kernels.options import AttentionOptions, check_precision

TENSORS = ("O", "dQ", "dK", "dV")
STATS = ("max", "mean", "std")


# == the sweep =====================================================================================

@dataclass(frozen=True)
class SweepConfig:
    precisions: tuple[str, ...] = ("bf16", "fp16", "fp32")
    seq_lens: tuple[int, ...] = (128, 256, 512, 1024, 2048)
    tiles: tuple[Tile, ...] = ((32, 32), (64, 64), (128, 128), (64, 128), (128, 64))
    head_dims: tuple[int, ...] = (64, 128)
    seq_tile: Tile = (128, 128)        # the tile of the sequence-length sweep
    tile_seq_len: int = 512            # the sequence length of the tile sweep
    full_grid: bool = False            # every length at every tile instead
    batch: int = 1
    heads: int = 4
    causal: bool = True
    seed: int = 0
    threads: int = 1                   # torch intra-op threads while running (restored after)

    def __post_init__(self):
        if not self.precisions:
            raise UsageError("no precisions given")
        def set_(name, value):   # frozen dataclass
            object.__setattr__(self, name, value)
        set_("precisions", tuple(dict.fromkeys(check_precision(p) for p in self.precisions)))
        set_("seq_lens", check_sizes("sequence lengths", self.seq_lens))
        set_("head_dims", check_sizes("head dims", self.head_dims))
        if not self.tiles:
            raise UsageError("no tiles given")
        set_("tiles", tuple(dict.fromkeys(check_tile(t) for t in self.tiles)))
        set_("seq_tile", check_tile(self.seq_tile))
        set_("tile_seq_len", check_sizes("the tile sweep's sequence length", [self.tile_seq_len])[0])
        check_sizes("batch, heads and threads", [self.batch, self.heads, self.threads])

    def points(self) -> list[tuple[int, Tile]]:
        """The (sequence length, tile) pairs measured, ordered by length."""
        if self.full_grid:
            pairs = [(n, t) for n in self.seq_lens for t in self.tiles]
        else:
            pairs = [(n, self.seq_tile) for n in self.seq_lens] + [(self.tile_seq_len, t) for t in self.tiles]
        return sorted(dict.fromkeys(pairs), key=lambda p: p[0])

    def all_seq_lens(self) -> list[int]:
        return sorted({n for n, _ in self.points()})

    def all_tiles(self) -> list[Tile]:
        measured = {t for _, t in self.points()}
        return [t for t in dict.fromkeys([*self.tiles, self.seq_tile]) if t in measured]


@dataclass
class Measurement:
    dev: dict[str, tuple[float, float, float]]    # tensor -> (max, mean, std) of |kernel - golden|
    seconds: float                                # forward + backward of the kernel


Key = tuple[str, str, int, "Tile | None", int]    # kernel, precision, seq_len, tile (None: baseline), head_dim


@dataclass
class SweepResult:
    config: SweepConfig
    measurements: dict[Key, Measurement]
    # (precision, N, d) -> tensor -> (max, mean) of |golden|
    golden_scale: dict[tuple[str, int, int], dict[str, tuple[float, float]]]
    seconds: float
    csv_path: Path
    zarr_path: Path
    plot_paths: list[Path]

    def deviation(self, kernel: str, precision: str, seq_len: int, head_dim: int, tile: Tile | None = None,
                  tensor: str = "O", stat: str = "max") -> float:
        """One measured number; baseline ignores `tile`. KeyError when that point was not measured."""
        key = (kernel, precision, seq_len, None if kernel == "baseline" or tile is None else (tile[0], tile[1]),
               head_dim)
        return self.measurements[key].dev[tensor][STATS.index(stat)]

    @property
    def paths(self) -> list[Path]:
        return [self.csv_path, self.zarr_path, *self.plot_paths]

    def summary_lines(self) -> list[str]:
        return _sweep_summary(self)


def run_sweep(cfg: SweepConfig, out_dir: Path, progress: Callable[[str], None] = print) -> SweepResult:
    with torch_threads(cfg.threads):
        return _run_sweep(cfg, Path(out_dir), progress)


def _run_sweep(cfg: SweepConfig, out_dir: Path, progress: Callable[[str], None]) -> SweepResult:
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    plots = {(x, stat): out_dir / f"sweep_{stat}_vs_{x}.png" for x in ("seq_len", "tile") for stat in ("max", "mean")}
    result = SweepResult(cfg, {}, {}, 0.0, out_dir / "sweep.csv", out_dir / "sweep.zarr", list(plots.values()))
    tiles_at: dict[int, list[Tile]] = {}
    for n, tile in cfg.points():
        tiles_at.setdefault(n, []).append(tile)
    for d in cfg.head_dims:
        for n, tiles in tiles_at.items():
            inputs = _random_inputs(cfg.seed, cfg.batch, cfg.heads, n, d)
            for precision in cfg.precisions:
                t0 = time.perf_counter()
                lp = [x.to(DTYPES[precision]) for x in inputs]
                golden = _run(partial(baseline_attention, dtype=torch.float64, causal=cfg.causal),
                              [x.double() for x in lp])
                result.golden_scale[(precision, n, d)] = {t: (g.abs().max().item(), g.abs().mean().item())
                                                          for t, g in zip(TENSORS, golden, strict=True)}
                result.measurements[("baseline", precision, n, None, d)] = _measure(
                    partial(baseline_attention, dtype=DTYPES[precision], causal=cfg.causal), lp, golden)
                for tile in tiles:
                    for kernel, placement in PLACEMENT_OF.items():
                        opts = AttentionOptions(placement=placement, block_r=tile[0], block_c=tile[1])
                        result.measurements[(kernel, precision, n, tile, d)] = _measure(
                            partial(flash_attention, opts=opts, causal=cfg.causal), lp, golden)
                progress(f"sweep: {precision} N={n} d={d} tiles {', '.join(map(tile_name, tiles))}: "
                         f"{time.perf_counter() - t0:.1f} s")
    _write_sweep_csv(result)
    _write_sweep_zarr(result)
    for (x, stat), path in plots.items():
        (_plot_vs_seq_len if x == "seq_len" else _plot_vs_tile)(result, path, stat)
    result.seconds = time.perf_counter() - start
    return result


def _random_inputs(seed: int, batch: int, heads: int, n: int, d: int) -> list[torch.Tensor]:
    """q, k, v, dO in FP64, i.i.d. N(0, 1), from a seed derived from (seed, N, d)."""
    gen = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, n, d]).generate_state(1)[0]))
    return [torch.randn(batch, heads, n, d, generator=gen, dtype=torch.float64) for _ in range(4)]


def _run(attention, inputs) -> list[torch.Tensor]:
    """O, dQ, dK, dV of `attention` on (q, k, v, dO); gradients by autograd in the inputs' dtype."""
    q, k, v, d_out = inputs
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = attention(q, k, v)
    out.backward(d_out)
    return [out.detach(), q.grad, k.grad, v.grad]


def _measure(attention, inputs, golden) -> Measurement:
    t0 = time.perf_counter()
    outputs = _run(attention, inputs)
    seconds = time.perf_counter() - t0
    dev = {}
    for name, x, g in zip(TENSORS, outputs, golden, strict=True):
        diff = (x.double() - g).abs()
        dev[name] = (diff.max().item(), diff.mean().item(), diff.std(correction=0).item())
    return Measurement(dev, seconds)


def _write_sweep_csv(result: SweepResult) -> None:
    cfg = result.config
    with open(result.csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["kernel", "precision", "seq_len", "block_r", "block_c", "head_dim", "batch", "heads",
                    "causal", "tensor", "stat", "abs_dev", "golden_max_abs", "golden_mean_abs", "seconds"])
        for (kernel, precision, n, tile, d), m in result.measurements.items():
            b_r, b_c = tile if tile else ("", "")
            for tensor in TENSORS:
                golden_max, golden_mean = result.golden_scale[(precision, n, d)][tensor]
                for stat, value in zip(STATS, m.dev[tensor], strict=True):
                    w.writerow([kernel, precision, n, b_r, b_c, d, cfg.batch, cfg.heads, int(cfg.causal), tensor, stat,
                                f"{value:.9e}", f"{golden_max:.9e}", f"{golden_mean:.9e}", f"{m.seconds:.4f}"])


def _write_sweep_zarr(result: SweepResult) -> None:
    cfg = result.config
    seq_lens, tiles = cfg.all_seq_lens(), cfg.all_tiles()
    shape = (len(KERNELS), len(cfg.precisions), len(seq_lens), len(tiles), len(cfg.head_dims))
    dev = np.full((*shape, len(TENSORS), len(STATS)), np.nan)
    seconds = np.full(shape, np.nan)
    scale = np.full((len(cfg.precisions), len(seq_lens), len(cfg.head_dims), len(TENSORS), 2), np.nan)
    for (kernel, precision, n, tile, d), m in result.measurements.items():
        at = (KERNELS.index(kernel), cfg.precisions.index(precision), seq_lens.index(n))
        # baseline does not tile: repeat its value at every tile measured at that length
        tile_ids = [tiles.index(tile)] if tile else [tiles.index(t) for t in tiles if (n, t) in cfg.points()]
        for ti in tile_ids:
            dev[(*at, ti, cfg.head_dims.index(d))] = [m.dev[t] for t in TENSORS]
            seconds[(*at, ti, cfg.head_dims.index(d))] = m.seconds
    for (precision, n, d), by_tensor in result.golden_scale.items():
        at = (cfg.precisions.index(precision), seq_lens.index(n), cfg.head_dims.index(d))
        scale[at] = [by_tensor[t] for t in TENSORS]
    root = zarr.open_group(str(result.zarr_path), mode="w", attributes={
        "description": "max/mean/std of |kernel - golden| elementwise over each tensor; golden = baseline "
                       "attention in FP64 on the same low-precision inputs upcast; gradients with the same random dO",
        "inputs": f"q, k, v, dO i.i.d. standard normal drawn in FP64 (seed {cfg.seed}, one draw per "
                  "(seq_len, head_dim)), rounded to the precision",
        "causal": cfg.causal, "batch": cfg.batch, "heads": cfg.heads, "seed": cfg.seed,
        "baseline_tiles": "baseline attention does not tile; its value is repeated at every measured tile",
        "torch_version": torch.__version__})

    def array(name, data, dims, attrs=None):
        a = root.create_array(name, shape=data.shape, dtype=data.dtype, chunks=data.shape, dimension_names=dims,
                              fill_value=np.nan if data.dtype.kind == "f" else None, attributes=attrs or {})
        a[...] = data

    def strings(values):
        return np.array(values, dtype=np.dtypes.StringDType())
    array("kernel", strings(KERNELS), ("kernel",))
    array("precision", strings(cfg.precisions), ("precision",))
    array("seq_len", np.array(seq_lens, dtype=np.int64), ("seq_len",))
    array("tile", strings([tile_name(t) for t in tiles]), ("tile",), {"description": "B_r x B_c"})
    array("block_r", np.array([t[0] for t in tiles], dtype=np.int64), ("tile",))
    array("block_c", np.array([t[1] for t in tiles], dtype=np.int64), ("tile",))
    array("head_dim", np.array(cfg.head_dims, dtype=np.int64), ("head_dim",))
    array("tensor", strings(TENSORS), ("tensor",))
    dims = ("kernel", "precision", "seq_len", "tile", "head_dim", "tensor")
    for si, stat in enumerate(STATS):
        array(f"{stat}_abs_dev", dev[..., si], dims,
              {"coordinates": "block_r block_c", "description": f"{stat} of |kernel - golden|; NaN: not measured"})
    array("seconds", seconds, dims[:-1], {"coordinates": "block_r block_c",
                                          "description": "forward + backward time of the kernel (wall clock)"})
    for i, stat in enumerate(("max", "mean")):
        array(f"golden_{stat}_abs", scale[..., i], ("precision", "seq_len", "head_dim", "tensor"),
              {"description": f"{stat} |golden| of the tensor: the scale the deviations compare with"})
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Consolidated metadata")
        zarr.consolidate_metadata(str(result.zarr_path))


_STYLE = {"baseline": {"color": "0.3", "marker": "s"}, "fa2-emu": {"color": "tab:blue", "marker": "o"},
          "reference-emu": {"color": "tab:red", "marker": "^"}}
_DASH = ["-", "--", ":", "-."]


def _sweep_figure(result: SweepResult, stat: str, title: str, xs: list, positions: list, point_of, style_x,
                  path: Path) -> None:
    """One panel per (tensor, precision): `stat` of |kernel - golden| at each x (plotted at its position;
    point_of(x) = (N, tile)), one line per kernel and head dim; style_x(ax) sets up the x axis."""
    cfg = result.config
    fig = Figure(figsize=(4.2 * len(cfg.precisions), 2.9 * len(TENSORS)), layout="constrained")
    axes = fig.subplots(len(TENSORS), len(cfg.precisions), squeeze=False)
    fig.suptitle(f"{title}\n({'causal' if cfg.causal else 'non-causal'}, inputs i.i.d. N(0,1), golden: FP64 baseline)",
                 fontsize=10)
    for row, tensor in enumerate(TENSORS):
        for col, precision in enumerate(cfg.precisions):
            ax = axes[row][col]
            for kernel in KERNELS:
                for di, d in enumerate(cfg.head_dims):
                    ys = [result.deviation(kernel, precision, point_of(x)[0], d, point_of(x)[1], tensor, stat)
                          for x in xs]
                    ax.plot(positions, ys, linestyle=_DASH[di % 4], label=f"{kernel} d={d}", **_STYLE[kernel])
            ax.set_yscale("log")
            ax.set_title(f"{precision}: {stat} |{tensor} - golden|", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            style_x(ax)
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="outside lower center", ncols=len(KERNELS), fontsize=8)
    fig.savefig(path, dpi=90)


def _plot_vs_seq_len(result: SweepResult, path: Path, stat: str) -> None:
    cfg = result.config
    tile = _seq_sweep_tile(cfg)
    lens = [n for n in cfg.all_seq_lens() if (n, tile) in cfg.points()]

    def style_x(ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(lens, [str(n) for n in lens], fontsize=8)
        ax.set_xticks([], minor=True)
        ax.set_xlabel("sequence length N")

    _sweep_figure(result, stat, f"{stat} deviation vs sequence length, tile {tile_name(tile)}", lens, lens,
                  lambda n: (n, tile), style_x, path)


def _plot_vs_tile(result: SweepResult, path: Path, stat: str) -> None:
    cfg = result.config
    n = _tile_sweep_len(cfg)
    tiles = [t for t in cfg.tiles if (n, t) in cfg.points()]

    def style_x(ax):
        ax.set_xticks(range(len(tiles)), [tile_name(t) for t in tiles], fontsize=8)
        ax.set_xlabel("tile B_r x B_c")

    _sweep_figure(result, stat, f"{stat} deviation vs tile B_r x B_c at N={n}", tiles, list(range(len(tiles))),
                  lambda t: (n, t), style_x, path)


def _seq_sweep_tile(cfg: SweepConfig) -> Tile:
    return cfg.seq_tile if not cfg.full_grid else cfg.tiles[0]


def _tile_sweep_len(cfg: SweepConfig) -> int:
    return cfg.tile_seq_len if not cfg.full_grid else cfg.seq_lens[-1]


def _trend(values: list[float]) -> str:
    """How a series moves from first to last: 'grows'/'shrinks' when every step goes that way (by >= 5%
    overall) or when it moves >= 20% with most steps that way; otherwise 'no clear trend'."""
    steps = list(pairwise(values))
    ups, downs = sum(b > a for a, b in steps), sum(b < a for a, b in steps)
    ratio = values[-1] / values[0] if values[0] > 0 else math.inf
    if (ups == len(steps) and ratio >= 1.05) or (ratio >= 1.2 and ups > downs):
        return f"grows {ratio:.2f}x"
    if (downs == len(steps) and ratio <= 1 / 1.05) or (ratio <= 1 / 1.2 and downs > ups):
        return f"shrinks {1 / ratio:.2f}x"
    return f"no clear trend ({ratio:.2f}x)"


def _sweep_summary(result: SweepResult) -> list[str]:
    cfg = result.config
    header = (f"sweep: {len(result.measurements)} kernel runs (forward + backward) in {result.seconds:.1f} s; "
              f"inputs q, k, v, dO i.i.d. N(0,1) (seed {cfg.seed}), batch x heads {cfg.batch}x{cfg.heads}, "
              f"{'causal' if cfg.causal else 'non-causal'}; golden = baseline attention in FP64 on the same "
              "rounded inputs; deviation = |kernel - golden| over each whole tensor")
    lines = [header, "wrote " + ", ".join(str(p) for p in result.paths)]
    lp = next((p for p in ("bf16", "fp16") if p in cfg.precisions), cfg.precisions[0])
    LP = lp.upper()
    tile, n_t = _seq_sweep_tile(cfg), _tile_sweep_len(cfg)
    lens = [n for n in cfg.all_seq_lens() if (n, tile) in cfg.points()]
    tiles = [t for t in cfg.tiles if (n_t, t) in cfg.points()]

    def dev(kernel, n, d, t=tile, stat="max", tensor="O"):
        return result.deviation(kernel, lp, n, d, t, tensor, stat)

    for d in cfg.head_dims:
        lines.append(f"{LP} |O - golden| at tile {tile_name(tile)}, d={d}: max (mean) "
                     "[Flash/Baseline ratio of max (of mean)]")
        for n in lens:
            parts = [f"baseline {dev('baseline', n, d):.2e} ({dev('baseline', n, d, stat='mean'):.1e})"]
            for k in PLACEMENT_OF:
                ratios = [dev(k, n, d, stat=s) / dev("baseline", n, d, stat=s) for s in ("max", "mean")]
                parts.append(f"{k} {dev(k, n, d):.2e} ({dev(k, n, d, stat='mean'):.1e}) "
                             f"[{ratios[0]:.2f}x ({ratios[1]:.2f}x)]")
            lines.append(f"  N={n:>5}: " + ", ".join(parts))
    for d in cfg.head_dims:
        lines.append(f"{LP} |O - golden| by tile B_r x B_c at N={n_t}, d={d}: max (mean)")
        for k in KERNELS[1:]:
            values = [f"{tile_name(t)} {dev(k, n_t, d, t):.2e} ({dev(k, n_t, d, t, 'mean'):.2e})" for t in tiles]
            lines.append(f"  {k}: " + ", ".join(values))

    points = [(n, t, d) for n, t in cfg.points() for d in cfg.head_dims]
    for k in PLACEMENT_OF:
        parts = []
        for tensor in TENSORS:
            ratios = [dev(k, n, d, t, tensor=tensor) / dev("baseline", n, d, t, tensor=tensor) for n, t, d in points]
            more = sum(r > 1 for r in ratios)
            word = "MORE" if more == len(ratios) else "LESS" if more == 0 else f"more at {more}/{len(ratios)} points"
            parts.append(f"{tensor} {word} (median {np.median(ratios):.2f}x)")
        lines.append(f"Verdict, Flash vs Baseline ({LP}, max deviation, {len(points)} points): Flash ({k}) deviates "
                     + ", ".join(parts) + " than Baseline")
    if len(lens) > 1:
        for k in KERNELS:
            parts = []
            for d in cfg.head_dims:
                maxes = [dev(k, n, d) for n in lens]
                means = [dev(k, n, d, stat="mean") for n in lens]
                rel = [mean / result.golden_scale[(lp, n, d)]["O"][1] for mean, n in zip(means, lens, strict=True)]
                parts.append(f"d={d}: max {_trend(maxes)}, mean {_trend(means)}, mean/mean|golden O| {_trend(rel)}")
            lines.append(f"Verdict, sequence length N={lens[0]}..{lens[-1]} ({LP}, O, tile {tile_name(tile)}), {k}: "
                         + "; ".join(parts))
    square = sorted((t for t in tiles if t[0] == t[1]), key=lambda t: t[0])
    swapped = [(a, b) for a, b in tiles if a < b and (b, a) in tiles]
    if len(square) > 1 or swapped:
        for k in PLACEMENT_OF:
            parts = []
            for d in cfg.head_dims:
                part = f"d={d}:"
                if len(square) > 1:
                    trends = [_trend([dev(k, n_t, d, t, s) for t in square]) for s in ("max", "mean")]
                    part += f" {tile_name(square[0])} -> {tile_name(square[-1])} max {trends[0]}, mean {trends[1]}"
                for a, b in swapped:
                    ratios = [dev(k, n_t, d, (b, a), s) / dev(k, n_t, d, (a, b), s) for s in ("max", "mean")]
                    part += f"; {b}x{a} vs {a}x{b}: max {ratios[0]:.2f}x, mean {ratios[1]:.2f}x"
                if len({dev(k, n_t, d, t) for t in tiles}) == 1:
                    part += " (the max is the same at every tile: outputs no tiling changes set it)"
                parts.append(part)
            lines.append(f"Verdict, larger tiles ({LP}, O, N={n_t}), {k}: " + "; ".join(parts))
    worst = {p: max(m.dev[t][0] for (_, prec, *_), m in result.measurements.items() if prec == p for t in TENSORS)
             for p in cfg.precisions}
    lines.append("Largest max deviation over all kernels, tensors and points: "
                 + ", ".join(f"{p.upper()} {w:.2e}" for p, w in worst.items()))
    return lines


