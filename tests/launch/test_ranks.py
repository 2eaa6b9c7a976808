"""Waiting for local ranks (launch/ranks.py) with real processes: a rank that dies ends the wait even while
a peer hangs (as one stuck in a collective with the dead rank can), and no rank outlives the wait."""

from __future__ import annotations

import subprocess
import sys

import pytest

from replay.launch.ranks import wait_for_ranks

pytestmark = pytest.mark.integration


def _python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def test_a_dead_rank_ends_the_wait_while_its_peer_hangs():
    hanging, dying = _python("import time; time.sleep(120)"), _python("import sys; sys.exit(3)")
    failures = wait_for_ranks([hanging, dying], grace=0.5)
    assert hanging.returncode == -9, "the hanging rank is killed after the grace, not waited for"
    assert failures == "rank 1 exited with code 3, then rank 0 was killed by signal 9 (SIGKILL)"


def test_ranks_that_finish_are_no_failure():
    assert wait_for_ranks([_python("pass"), _python("import time; time.sleep(0.3)")]) is None
