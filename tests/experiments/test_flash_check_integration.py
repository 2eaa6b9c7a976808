"""`replay microbench --mode flash`'s check on a CUDA GPU: the emulation against PyTorch's flash kernel."""

from __future__ import annotations

import pytest
import torch

from replay.experiments.flash_check import FlashCheckConfig, run_flash_check


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: PyTorch's flash kernel runs on one")
def test_the_emulation_in_flash_order_reproduces_the_flash_kernel(tmp_path):
    """The finding of docs/gpu.md, kept true: with CUDA FA2's tile (128 x 128 at head dim 64) and its
    decreasing key order, the emulation gives the flash backend's O on at least 99% of elements, far more
    than in increasing order, and the Triton kernels the emulation's."""
    cfg = FlashCheckConfig(precisions=("bf16",), seq_lens=(1024,), head_dims=(64,), tiles=((128, 128),))
    result = run_flash_check(cfg, tmp_path, progress=lambda _: None)
    decreasing = result.agreement[("fa2-emu 128x128 decreasing", "bf16", 1024, 64)]["O"]
    increasing = result.agreement[("fa2-emu 128x128 increasing", "bf16", 1024, 64)]["O"]
    assert decreasing.equal >= 0.99 and decreasing.equal > increasing.equal + 0.1
    triton = result.triton[("default", "bf16", 1024, 64)]
    assert all(triton[t].equal >= 0.97 for t in triton)
    flash_max = result.deviation[("sdpa-flash", "bf16", 1024, 64)]["O"][0]
    assert flash_max <= 2 * result.deviation[("baseline", "bf16", 1024, 64)]["O"][0]
    assert (tmp_path / "flash.csv").read_text().count("\n") > 50
