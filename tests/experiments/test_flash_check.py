"""`replay microbench --mode flash`: its measures on the CPU (the check itself, on a CUDA GPU:
test_flash_check_integration.py)."""

from __future__ import annotations

import pytest
import torch

from replay.errors import UsageError
from replay.experiments.flash_check import FlashCheckConfig, boundary_distance, ulp_distance
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

