"""What the experiments share: the kernels they compare, argument checks, the thread setting.

Kernels (names as in `replay.kernels.plan`): `fa2-emu` and `reference-emu`, the FA2 emulation of
`flash_emu` with CUDA FA2's and with Qiu & Yao's reference-code rounding placement, tile B_r x B_c; and
`baseline`, materialised attention computed in the precision under test.

Both run with one torch intra-op thread by default (`threads`), restored afterwards.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from replay.errors import UsageError

KERNELS = ("baseline", "fa2-emu", "reference-emu")
PLACEMENT_OF = {"fa2-emu": "fa2", "reference-emu": "reference"}
Tile = tuple[int, int]


def check_sizes(what: str, values, minimum: int = 1) -> tuple[int, ...]:
    values = tuple(int(v) for v in values)
    if not values:
        raise UsageError(f"no {what} given")
    bad = [v for v in values if v < minimum]
    if bad:
        raise UsageError(f"{what} must be >= {minimum}, got {bad[0]}")
    return tuple(dict.fromkeys(values))


def check_tile(tile) -> Tile:
    try:
        b_r, b_c = (int(x) for x in tile)
    except (TypeError, ValueError):
        raise UsageError(f"a tile is two sizes B_r, B_c, got {tile!r}") from None
    if b_r < 1 or b_c < 1:
        raise UsageError(f"tile sizes must be >= 1, got B_r={b_r}, B_c={b_c}")
    return b_r, b_c


@contextmanager
def torch_threads(n: int):
    """The emulation is thousands of small tensor ops: a second OpenMP thread gains little on them and, on a
    loaded machine, loses several-fold (threads wait at every op for a descheduled sibling)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tile_name(tile: Tile) -> str:
    return f"{tile[0]}x{tile[1]}"


