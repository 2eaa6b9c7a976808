"""A store written before checksums covered every byte (schema 1, tests/data: test_schema1.py) replays a
window bit for bit, the replay itself in the current format."""

from __future__ import annotations

from replay.store import RunStore
from tests.conftest import replay_cli


def test_a_window_replays_bit_for_bit(schema1):
    result = replay_cli("run", str(schema1), "--from", "2", "--to", "3", "--verify")
    assert result.returncode == 0 and "bit for bit" in result.stdout, result.stderr
    assert RunStore.open(schema1 / "replays/steps-2-3").schema == 2   # the replay itself: the current format
