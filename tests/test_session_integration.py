"""`replay session` of a built-in run: the replays of its lines on ranks forked from one fork server, each
verified as its own `replay run` would be. (A script's session: tests/examples/test_nanogpt_integration.py.)"""

from __future__ import annotations

from replay.store import RunStore
from tests.conftest import replay_cli


def test_a_built_in_runs_session_replays_each_line_and_says_what_it_did(store_copy):
    lines = "--from 12 --to 14 --verify\n--from 21 --to 23 --lr-scale 0.5 --verify --name halved\n"
    result = replay_cli("session", str(store_copy), input=lines)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("$ replay run ") == 2 and "session: 2 replays" in result.stderr
    assert "the script" not in result.stderr   # nothing to keep up but the fork server
    plain = RunStore.open(store_copy / "replays" / "steps-12-14").manifest.replay_spec.verification
    halved = RunStore.open(store_copy / "replays" / "halved").manifest.replay_spec.verification
    assert (plain.bitwise, plain.level, plain.steps) == (True, "state", [10, 14])
    assert not halved.bitwise and halved.divergence.step == 21
    assert "every replayed step equals the record bit for bit" in result.stdout
