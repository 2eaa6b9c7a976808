"""The nodes a run's ranks run on, gathered from every rank when its loop starts: the manifest's Placement."""

from __future__ import annotations

import torch.distributed as dist

from replay.recorder.host import this_node
from replay.store.manifest import Placement


def gather_placement(played: int = 1) -> Placement:
    """Every rank's node (a collective: every process calls it). `played`: the consecutive recorded ranks each
    process stands for (a replay on fewer processes, train/fewer_ranks.py)."""
    mine = this_node()
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[tuple[int, str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        everyone = [(int(g[0]), str(g[1])) for g in gathered if g is not None]
        assert len(everyone) == dist.get_world_size(), "all_gather_object fills every process's entry"
    ranks = [node for node in everyone for _ in range(played)]
    nodes = sorted(set(everyone))
    return Placement(nodes=[name for _, name in nodes], rank_nodes=[nodes.index(n) for n in ranks])
