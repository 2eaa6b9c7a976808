"""Golden et al.'s deviation sweep, reduced: its files, and the physics it must show (FP32 << BF16, smaller
key tiles deviate more in the reference placement)."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import xarray as xr

from replay.errors import UsageError
from replay.experiments.golden import TENSORS, SweepConfig, run_sweep
from replay.experiments.mechanism import MechanismConfig
from tests.experiments.conftest import assert_png

SMALL_SWEEP = SweepConfig(precisions=("bf16", "fp32"), seq_lens=(64, 256), head_dims=(32,), heads=2,
                          tiles=((16, 16), (128, 128), (16, 128), (128, 16)), seq_tile=(64, 64), tile_seq_len=256)

@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    return run_sweep(SMALL_SWEEP, tmp_path_factory.mktemp("sweep"), progress=lambda line: None)


def test_sweep_writes_csv_zarr_and_plots(sweep):
    with open(sweep.csv_path) as f:
        rows = list(csv.DictReader(f))
    # 2 precisions x (2 lengths at the seq tile + 4 tiles at N=256) x 2 placements, + 2 x 2 baseline runs
    assert len(sweep.measurements) == 2 * 6 * 2 + 2 * 2
    assert len(rows) == len(sweep.measurements) * len(TENSORS) * 3
    row = next(r for r in rows if r["kernel"] == "reference-emu" and r["block_c"] == "16" and r["block_r"] == "128"
               and r["precision"] == "bf16" and r["tensor"] == "dK" and r["stat"] == "max")
    assert float(row["abs_dev"]) == pytest.approx(sweep.deviation("reference-emu", "bf16", 256, 32, (128, 16), "dK"))
    assert {r["block_r"] for r in rows if r["kernel"] == "baseline"} == {""}   # baseline does not tile
    assert len(sweep.plot_paths) == 4
    for path in sweep.plot_paths:
        assert_png(path)


def test_zarr_opens_in_xarray_with_named_dimensions(sweep):
    ds = xr.open_zarr(sweep.zarr_path)
    dims = ("kernel", "precision", "seq_len", "tile", "head_dim", "tensor")
    for stat in ("max", "mean", "std"):
        assert ds[f"{stat}_abs_dev"].dims == dims
    assert list(ds.kernel.values) == ["baseline", "fa2-emu", "reference-emu"]
    assert list(ds.seq_len.values) == [64, 256]
    assert list(ds.tile.values) == ["16x16", "128x128", "16x128", "128x16", "64x64"]
    assert list(ds.block_c.values) == [16, 128, 128, 16, 64]
    value = ds.mean_abs_dev.sel(kernel="reference-emu", precision="bf16", seq_len=256, tile="16x16",
                                head_dim=32, tensor="dQ").item()
    assert value == pytest.approx(sweep.deviation("reference-emu", "bf16", 256, 32, (16, 16), "dQ", "mean"))
    # baseline is measured once per length and repeated over that length's tiles; unmeasured cells are NaN
    base = ds.max_abs_dev.sel(kernel="baseline", precision="bf16", seq_len=256, head_dim=32, tensor="O")
    assert np.unique(base.values).size == 1 and not np.isnan(base.values).any()
    assert np.isnan(ds.max_abs_dev.sel(kernel="fa2-emu", seq_len=64, tile="16x16").values).all()
    assert ds.golden_mean_abs.dims == ("precision", "seq_len", "head_dim", "tensor")


def test_fp32_deviates_orders_of_magnitude_less_than_bf16(sweep):
    for (kernel, precision, n, tile, d), m in sweep.measurements.items():
        if precision != "fp32":
            continue
        for tensor in TENSORS:
            fp32 = m.dev[tensor][0]
            bf16 = sweep.deviation(kernel, "bf16", n, d, tile, tensor)
            assert fp32 < 1e-5 and bf16 > 1e-4, (kernel, n, tile, tensor, fp32, bf16)
            assert bf16 > 100 * fp32


def test_reference_placement_deviates_more_with_smaller_key_tiles(sweep):
    # The reference placement rounds its BF16 O accumulator once per key tile, so 16 key tiles (B_c = 16) at
    # N = 256 accumulate more rounding than 2 (B_c = 128). The max is set by a few large outputs of the first
    # (causal) rows and barely moves with the tile, so the robust measure is the mean deviation.
    def mean(tile):
        return sweep.deviation("reference-emu", "bf16", 256, 32, tile, "O", "mean")
    assert mean((16, 16)) > 1.1 * mean((128, 128))
    assert mean((128, 16)) > 1.1 * mean((16, 128))   # it is B_c, the key tile, that counts in the forward


def test_sweep_summary_reports_ratios_per_length(sweep):
    lines = sweep.summary_lines()
    for n in (64, 256):
        assert any(line.strip().startswith(f"N={n:>5}:") and "reference-emu" in line and "x" in line for line in lines)
    assert any("Flash (reference-emu) deviates" in line for line in lines)


@pytest.mark.parametrize("make", [
    lambda: SweepConfig(precisions=("fp8",)),
    lambda: SweepConfig(tiles=((0, 64),)),
    lambda: SweepConfig(seq_tile=(64, -1)),
    lambda: SweepConfig(seq_lens=(128, 0)),
    lambda: SweepConfig(head_dims=()),
    lambda: MechanismConfig(precision="int8"),
    lambda: MechanismConfig(n_tied=(0,)),
    lambda: MechanismConfig(n_tied=(5,), n_keys=4),
    lambda: MechanismConfig(trials=1),
    lambda: MechanismConfig(gap=(0.0, 1.0)),
    lambda: MechanismConfig(betas=(0.5,)),
])
def test_bad_input_is_a_one_line_usage_error(make):
    with pytest.raises(UsageError) as info:
        make()
    assert "\n" not in str(info.value) and str(info.value)


