"""Waiting for local ranks (launch/local.py) with real processes: a rank that dies ends the wait even while
a peer hangs (as one stuck in a collective with the dead rank can), and no rank outlives the wait; the same
wait on answers (as the warm ranks of launch/pool.py give them) kills only the ranks that never answered."""

from __future__ import annotations

import subprocess
import sys
import time

from replay.launch.local import wait_for_outcomes, wait_for_ranks


def _python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def test_a_dead_rank_ends_the_wait_while_its_peer_hangs():
    hanging, dying = _python("import time; time.sleep(120)"), _python("import sys; sys.exit(3)")
    failures = wait_for_ranks([hanging, dying], grace=0.5)
    assert hanging.returncode == -9, "the hanging rank is killed after the grace, not waited for"
    assert failures == "rank 1 exited with code 3, then rank 0 was killed by signal 9 (SIGKILL)"


def test_ranks_that_finish_are_no_failure():
    assert wait_for_ranks([_python("pass"), _python("import time; time.sleep(0.3)")]) is None


def test_after_a_failed_answer_only_the_ranks_that_never_answered_are_killed():
    procs = [_python("import time; time.sleep(120)") for _ in range(3)]
    answers = [[(0, None), (2, "rank 2: it broke")]]   # rank 1 never answers, as one stuck in a collective

    def outcomes(timeout: float) -> list[tuple[int, str | None]]:
        if answers:
            return answers.pop()
        time.sleep(timeout)
        return []

    try:
        start = time.monotonic()
        failures, killed = wait_for_outcomes(procs, outcomes, grace=0.5)
        assert 0.5 <= time.monotonic() - start < 5, "the grace, then the end of the wait"
        assert failures == ["rank 2: it broke"] and killed == [1]
        assert procs[1].returncode == -9
        assert procs[0].poll() is None and procs[2].poll() is None, "ranks that answered are the caller's"
    finally:
        for p in procs:
            p.kill()
            p.wait()
