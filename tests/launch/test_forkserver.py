"""Which scripts a script fork server can start as `python ARGV` would (launch/forkserver.py)."""

from __future__ import annotations

import pytest

from replay.launch.forkserver import script_argv_forkable


@pytest.mark.parametrize("argv, forkable", [
    (["train.py", "--lr=1"], True),
    (["-u", "train.py"], True),
    (["-m", "pkg.train", "--x"], True),
    (["-u", "-m", "pkg.train"], True),
    (["-O", "train.py"], False),        # an interpreter option it does not apply: a fresh process
    (["-c", "print(1)"], False),
    (["-m"], False),
    ([], False),
])
def test_a_script_forks_when_it_was_started_as_a_script_or_a_module(argv, forkable):
    assert script_argv_forkable(argv) is forkable
