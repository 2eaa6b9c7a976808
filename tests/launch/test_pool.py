"""Which pool of warm ranks a run in this process uses (launch/pool.py), without starting any."""

from __future__ import annotations

from replay.launch.pool import RankPool, active_pool


def test_a_kept_pool_is_active_only_inside_its_block_and_the_innermost_wins():
    outer, inner = RankPool(2), RankPool(2)
    assert active_pool(2) is None
    with outer.activated():
        assert active_pool(2) is outer and active_pool(1) is None
        with inner.activated():
            assert active_pool(2) is inner
        assert active_pool(2) is outer
    assert active_pool(2) is None
    assert not outer.alive and not inner.alive   # nothing was started
