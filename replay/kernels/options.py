"""What an attention backend computes, and where it rounds: one small config shared by every backend."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

from replay.errors import UsageError

COMPUTE_DTYPES = ("fp64", "fp32", "bf16", "fp16")   # what a backend can compute in (torch dtypes: kernels/dtypes.py)
PLACEMENTS = ("fa2", "reference")
KEY_ORDERS = ("increasing", "decreasing")


def check_precision(name: str, where: str = "") -> str:
    """`name` if a backend can compute in it, else one line naming the choices."""
    if name not in COMPUTE_DTYPES:
        raise UsageError(f"unknown precision {name!r}{where}; choose one of {', '.join(COMPUTE_DTYPES)}")
    return name


@dataclass(frozen=True)
class SafeSoftmaxFix:
    """Qiu & Yao's adjustment, per tile and forward only: with r the tile's row max and n the number
    of scores tied with it, subtract beta * r instead of r when n > 1 and r > 0, and 0 when n > 1 and
    r < 0, so that no exp(S - offset) is exactly 1. Exact in real arithmetic (softmax is invariant to
    the offset). `tie_tol` 0 counts exact ties; the released code counts scores within 1e-3."""

    beta: float = 7.0
    tie_tol: float = 0.0

    def __post_init__(self):
        if not self.beta > 1:
            raise UsageError(f"safe-softmax beta must be > 1 (the paper uses 2-8), got {self.beta}")
        if self.tie_tol < 0:
            raise UsageError(f"safe-softmax tie tolerance must be >= 0, got {self.tie_tol}")
        if self.beta < 1 + 2 ** -7:   # beta * r rounds back to r in BF16 (8 significant bits)
            warnings.warn(f"safe-softmax beta={self.beta:g} rounds back to 1 in BF16: ties still give exactly 1 "
                          "there, so the fix does nothing at BF16 (the paper uses 2-8)", stacklevel=2)


@dataclass(frozen=True)
class AttentionOptions:
    """How one backend computes attention: rounding placement, tiles, and the Qiu & Yao options."""

    placement: str = "fa2"          # fa2: CUDA FA2's rounding points; reference: Qiu & Yao's PyTorch code
    block_r: int = 128              # B_r: query rows per tile (FA2 forward, head dim 64)
    block_c: int = 128              # B_c: key columns per tile
    fix: SafeSoftmaxFix | None = None
    hp_delta: bool = False          # backward D = rowsum(dO * O) from an FP32 O instead of the stored one
    hp_pv: bool = False             # Pbar @ V (and the O accumulator) in FP32: Pbar is not rounded first
    dtype: str | None = None        # compute precision; None: the inputs' dtype
    key_order: str = "increasing"   # forward order of the key tiles; "decreasing" as CUDA FA2's loop runs

    def __post_init__(self):
        if self.placement not in PLACEMENTS:
            raise UsageError(f"unknown rounding placement {self.placement!r}; choose one of {', '.join(PLACEMENTS)}")
        if self.block_r < 1 or self.block_c < 1:
            raise UsageError(f"tile sizes must be >= 1, got B_r={self.block_r}, B_c={self.block_c}")
        if self.key_order not in KEY_ORDERS:
            raise UsageError(f"unknown key order {self.key_order!r}; choose one of {', '.join(KEY_ORDERS)}")
        if self.key_order != "increasing" and self.placement != "fa2":
            raise UsageError("the decreasing key order is CUDA FA2's loop, an option of the fa2 placement only")
        if self.dtype is not None:
            check_precision(self.dtype)

    def with_(self, **changes) -> AttentionOptions:
        return replace(self, **changes)
