"""Analysis fixtures: a replayed store and its analysed copy."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import made_once, replay_cli

# A replay that leaves the record (learning rate doubled from step 10) and ends with a checkpoint at
# step 20, where the run has one too: its weight distances against the run are non-zero there.
DIVERGING_REPLAY = ["--from", "10", "--to", "19", "--lr-scale", "2", "--name", "lr2"]


@pytest.fixture(scope="session")
def replayed_store(two_rank_store, tmp_path_factory, request) -> Path:
    """The 2-rank recording plus one diverging replay (not analysed)."""
    def replay(folder: Path) -> Path:
        shutil.copytree(two_rank_store, folder / "run")
        result = replay_cli("run", str(folder / "run"), *DIVERGING_REPLAY, ranks=request.getfixturevalue("rank_pool"))
        assert result.returncode == 0, result.stderr
        return folder / "run"

    return made_once(tmp_path_factory, "replayed", replay)


@pytest.fixture(scope="session")
def analysed_store(replayed_store, tmp_path_factory, request) -> Path:
    from replay.analysis.jobs import analyze

    def analysed(folder: Path) -> Path:
        request.getfixturevalue("ray_local")   # started only by the worker making this
        shutil.copytree(replayed_store, folder / "run")
        analyze(folder / "run")
        return folder / "run"

    return made_once(tmp_path_factory, "analysed", analysed)


@pytest.fixture
def replayed_copy(replayed_store, tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(replayed_store, dst)
    return dst
