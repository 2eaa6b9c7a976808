"""`replay microbench --mode flash`: its measures on the CPU, the check itself on a CUDA GPU."""

from __future__ import annotations

import pytest
import torch

from replay.errors import UsageError
from replay.experiments.flash_check import FlashCheckConfig, boundary_distance, run_flash_check, ulp_distance
from tests.conftest import error_line, replay_cli


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ulp_distance_counts_representable_steps(dtype):
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0)).to(dtype)
    bits = x.view(torch.int16)
    for steps in (1, 2, 5):   # away from zero: the magnitude's bits count the steps, within a binade or across
        further = (bits + torch.where(bits < 0, -steps, steps).short()).view(dtype)   # same sign, `steps` values larger
        distance = ulp_distance(x, further)
        assert ((distance >= steps // 2) & (distance <= steps)).all() and (distance == steps).double().mean() > 0.9
    assert (ulp_distance(x, x) == 0).all()
    zeros = torch.tensor([0.0, -0.0], dtype=dtype)
    assert (ulp_distance(zeros, zeros.flip(0)) == 0).all()
    one = torch.tensor([1.0], dtype=dtype)
    eps = torch.finfo(dtype).eps
    assert ulp_distance(one, one + eps).item() == 1 and ulp_distance(one, -one).item() == round(2 / eps)


def test_boundary_distance_is_zero_on_a_rounding_midpoint():
    bf16_mid = torch.tensor([0x3F808000, 0x3F808001, 0x3F807FF0, 0x3F800000], dtype=torch.int32).view(torch.float32)
    assert boundary_distance(bf16_mid, torch.bfloat16).tolist() == [0, 1, 16, 0x8000]
    fp16_mid = torch.tensor([0x3F801000, 0x3F800FFF], dtype=torch.int32).view(torch.float32)
    assert boundary_distance(fp16_mid, torch.float16).tolist() == [0, 1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_without_a_gpu_the_flash_mode_says_so_in_one_line():
    result = replay_cli("microbench", "--mode", "flash")
    assert result.returncode == 2 and "needs a CUDA GPU" in error_line(result)
    with pytest.raises(UsageError, match="bf16 or fp16"):
        FlashCheckConfig(precisions=("fp32",))


@pytest.mark.integration
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
