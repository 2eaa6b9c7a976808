"""`replay session` of a built-in run: the replays of its lines on ranks forked from one fork server, each
verified as its own `replay run` would be. (A script's session: tests/examples/test_nanogpt_integration.py.)"""

from __future__ import annotations

from replay.store import RunStore
from tests.conftest import replay_cli


def test_a_built_in_runs_session_replays_each_line_and_says_what_it_did(store_copy):
    """Two lines, a plain window and a halved learning rate: each replayed and verified as its `replay run`,
    both on ranks forked from the session's one fork server."""
    lines = "--from 12 --to 14 --verify\n--from 21 --to 23 --lr-scale 0.5 --verify --name halved\n"
    result = replay_cli("session", str(store_copy), input=lines)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("$ replay run ") == 2
    assert "session: 2 replays; the ranks were forked from one fork server" in result.stderr
    plain = RunStore.open(store_copy / "replays" / "steps-12-14").manifest.replay_spec.verification
    halved = RunStore.open(store_copy / "replays" / "halved").manifest.replay_spec.verification
    assert (plain.bitwise, plain.level, plain.steps) == (True, "state", [10, 14])
    assert not halved.bitwise and halved.divergence.step == 21
    assert "every replayed step equals the record bit for bit" in result.stdout


def test_a_line_that_cannot_be_read_fails_alone_and_the_session_goes_on(store_copy):
    lines = "--from 12 --to 14 --name 'unclosed\n--help\n--from 12 --to 14 --name read\n"
    result = replay_cli("session", str(store_copy), input=lines)
    assert result.returncode == 2, result.stderr
    assert "error: line 1 of the input: No closing quotation" in result.stderr
    assert "Usage:" in result.stdout   # --help, as `replay run --help` prints it
    assert "session: 3 replays, 1 failed (line 1 of the input)" in result.stderr
    assert RunStore.open(store_copy / "replays" / "read").manifest.replay_spec.verification.bitwise
