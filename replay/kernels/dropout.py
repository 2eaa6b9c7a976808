"""Attention dropout in replay's own backends (baseline, the flash emulation, the Triton kernels).

Inverted dropout on the attention probabilities: each is kept with probability 1 - p and the kept ones
are scaled by 1 / (1 - p), so the expected output is the undropped one. The randomness comes from torch's
global generator of the tensors' device, so the same RNG state gives the same mask:

- baseline and the emulation draw one bool mask over the whole [..., N, M] per call (`keep_mask`): it
  depends on the RNG state and the shape only, not on the tiles, and the two backends draw the same one;
- the Triton kernels draw one seed per call (`draw_seed`) and hash (seed, slice, row, column) with
  Philox inside the kernels, so the mask does not depend on the tiles either, and the backward
  regenerates the forward's.

Neither mask is PyTorch SDPA's: swapping backends under dropout changes the mask as well as the rounding.
"""

from __future__ import annotations

import torch

from replay.errors import UsageError


def check(p: float) -> float:
    if not 0.0 <= p < 1.0:
        raise UsageError(f"attention dropout must be in [0, 1), got {p}")
    return p


def keep_mask(shape: tuple[int, ...], p: float, device: torch.device) -> torch.Tensor:
    """Which attention probabilities survive (bool, True = kept, each with probability 1 - p): one draw of
    `shape` from torch's global generator of `device`."""
    return torch.rand(shape, device=device) >= check(p)


def draw_seed(device: torch.device) -> torch.Tensor:
    """One Philox seed for the Triton kernels, drawn from torch's global generator of `device` and left
    there (an int64 tensor of one element), so the host never waits for the GPU."""
    return torch.randint(2 ** 62, (1,), dtype=torch.int64, device=device)


def fp32_scales(p: float, scale: float) -> tuple[float, float, float]:
    """What CUDA FA2 scales by under dropout, each an FP32 value: the keep probability 1 - p, rp = 1 / (1 - p)
    and the softmax scale times rp."""
    keep = torch.tensor(1.0 - check(p), dtype=torch.float32)
    rp = 1.0 / keep
    return keep.item(), rp.item(), (torch.tensor(scale, dtype=torch.float32) * rp).item()
