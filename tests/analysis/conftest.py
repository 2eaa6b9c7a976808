"""Analysis fixtures: a replayed store and its analysed copy."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import replay_cli

# A replay that leaves the record (learning rate doubled from step 10) and ends with a checkpoint at
# step 20, where the run has one too: its weight distances against the run are non-zero there.
DIVERGING_REPLAY = ["--from", "10", "--to", "19", "--lr-scale", "2", "--name", "lr2"]


@pytest.fixture(scope="session")
def replayed_store(two_rank_store, tmp_path_factory) -> Path:
    """The 2-rank recording plus one diverging replay (not analysed)."""
    store = tmp_path_factory.mktemp("analysis") / "run"
    shutil.copytree(two_rank_store, store)
    result = replay_cli("run", str(store), *DIVERGING_REPLAY)
    assert result.returncode == 0, result.stderr
    return store


@pytest.fixture(scope="session")
def analysed_store(replayed_store, ray_local, tmp_path_factory) -> Path:
    from replay.analysis.jobs import analyze

    store = tmp_path_factory.mktemp("analysed") / "run"
    shutil.copytree(replayed_store, store)
    analyze(store)
    return store


@pytest.fixture
def replayed_copy(replayed_store, tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(replayed_store, dst)
    return dst
