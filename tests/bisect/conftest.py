"""Recordings with a planted cause, made once per session through the real CLI."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bisect.planted import BATCH, RECORD_ARGS, STEPS, periodic_tokens, plant_degenerate_samples
from tests.conftest import made_once, replay_cli

DATA_SPIKE_STEP, DATA_POSITIONS = 37, [1, 6]   # positions 1 and 6 of the batch: one sample on each rank
DEFECT = {"REPLAY_PLUGINS": "tests.bisect.planted"}   # registers the broken backend `defect`
DEFECT_PLAN = "eager;1.0=defect"                # head 0 of layer 1 breaks once its logits pass 1.5


@pytest.fixture(scope="session")
def planted_data(tmp_path_factory, request) -> tuple[Path, list[int]]:
    """Two samples of random tokens at step 37 of a run that has learnt a periodic text: a real spike."""
    def plant(root: Path) -> tuple[Path, list[int]]:
        ids = plant_degenerate_samples(root / "train.bin", DATA_SPIKE_STEP, DATA_POSITIONS)
        result = replay_cli("record", "--store", str(root / "run"), "--data", str(root / "train.bin"), *RECORD_ARGS,
                            ranks=request.getfixturevalue("rank_pool"))
        assert result.returncode == 0, result.stderr
        return root / "run", ids

    return made_once(tmp_path_factory, "planted_data", plant)


@pytest.fixture(scope="session")
def planted_layer(tmp_path_factory, request) -> Path:
    """A run whose head 1.0 uses a deliberately broken kernel (a test double for a kernel bug, which we
    cannot cause for real): exact attention until its logits grow past 1.5, then inf."""
    def plant(root: Path) -> Path:
        periodic_tokens(STEPS * BATCH).tofile(root / "train.bin")
        result = replay_cli("record", "--store", str(root / "run"), "--data", str(root / "train.bin"),
                            *RECORD_ARGS, "--attention", DEFECT_PLAN, env=DEFECT,
                            ranks=request.getfixturevalue("rank_pool"))
        assert result.returncode == 0, result.stderr
        return root / "run"

    return made_once(tmp_path_factory, "planted_layer", plant)
