"""Analysis fixtures: one real local Ray cluster for the session, and one analysed store."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import replay_cli

# A replay that leaves the record (learning rate doubled from step 10) and ends with a checkpoint at
# step 20, where the run has one too: its weight distances against the run are non-zero there.
DIVERGING_REPLAY = ["--from", "10", "--to", "19", "--lr-scale", "2", "--name", "lr2"]


@pytest.fixture(scope="session")
def ray_local():
    """A real local Ray cluster, started once (about 3 s) and shared by the in-process analysis tests."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    yield
    ray.shutdown()


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
