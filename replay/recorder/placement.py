"""The nodes a run's ranks run on, gathered from every rank when its loop starts: the manifest's Placement."""

from __future__ import annotations

import torch.distributed as dist

from replay.recorder.host import this_node
from replay.store.manifest import Placement


def gather_placement(world: int) -> Placement:
    """Every rank's node (a collective: every rank calls it)."""
    mine = this_node()
    everyone = [mine]
    if world > 1 and dist.is_initialized():
        gathered: list[tuple[int, str] | None] = [None] * world
        dist.all_gather_object(gathered, mine)
        everyone = [tuple(g) for g in gathered if g is not None]   # type: ignore[misc]
        assert len(everyone) == world, "all_gather_object fills every rank's entry"
    nodes = sorted(set(everyone))
    return Placement(nodes=[name for _, name in nodes], rank_nodes=[nodes.index(n) for n in everyone])
