"""A served rank's failure (recorder/serving.py): replay's own error goes to the launcher, which says it in its one
line, so the rank says nothing more; where the launcher cannot be told, the rank says it itself."""

from __future__ import annotations

import os

from replay.errors import UsageError
from replay.recorder.serving import Answer, Serving


def _failing(answers: int) -> tuple[list[BaseException], object]:
    jobs, _ = os.pipe()
    seen: list[BaseException] = []
    return seen, Serving(jobs, answers).failing(lambda kind, value, tb: seen.append(value), rank=1)


def test_an_error_the_launcher_was_told_is_not_said_again_by_the_rank():
    read, write = os.pipe()
    seen, hook = _failing(write)
    error = UsageError("layer 0 calls flex attention with score_mod")
    hook(UsageError, error, None)
    told = Answer.parse(os.read(read, 4096).splitlines()[0])
    assert told.failed == "rank 1: layer 0 calls flex attention with score_mod"
    assert seen == [error] and error.said_by_launcher   # the rank's one_line_errors stays silent


def test_where_the_launcher_is_gone_the_rank_says_it_itself():
    read, write = os.pipe()
    os.close(read)   # the launcher gone: writing fails
    seen, hook = _failing(write)
    error = UsageError("no launcher to tell")
    hook(UsageError, error, None)
    assert seen == [error] and not error.said_by_launcher
