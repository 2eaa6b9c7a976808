"""A run store's life (store/lifecycle.py) on a real local store: created, resumed, told where it ran,
completed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replay.config import RunConfig
from replay.errors import StoreError
from replay.store import RunStore
from replay.store.lifecycle import (
    complete_run,
    continue_command,
    create_run,
    no_data,
    note_environment,
    resume_run,
)
from replay.store.location import Location
from replay.store.manifest import ReplaySpec
from replay.store.overrides import Overrides
from tests.conftest import new_store


def _rows(start: int, k: int) -> dict[str, np.ndarray]:
    return {"loss": np.arange(start, start + k, dtype=float), "rank_loss": np.ones((k, 1)), "grad_norm": np.ones(k),
            "lr": np.ones(k), "tokens": np.ones(k), "step_time": np.ones(k),
            "sample_ids": np.arange(start, start + k).reshape(k, 1, 1, 1)}


def _checkpoint(store: RunStore, step: int, commit: bool = True) -> None:
    store.write_shard(step, 0, {"w": torch.full((2,), float(step))})
    if commit:
        store.commit_checkpoint(step, "regular", world_size=1)


def test_a_new_run_is_running_with_what_it_was_given(tmp_path):
    store = create_run(tmp_path / "run", RunConfig(steps=9), world_size=2, launcher="custom",
                       data=no_data("my own loader"), layout={"q": "x"})
    m = RunStore.open(tmp_path / "run").manifest
    assert (m.kind, m.status, m.world_size, m.launcher, m.config.steps, m.layout) == ("run", "running", 2, "custom",
                                                                                   9, {"q": "x"})
    assert (m.data.embedded, m.data.path, m.data.method, m.data.source) == (False, None, "none", "my own loader")
    assert store.location == Location.parse(tmp_path / "run")


def test_a_used_path_is_refused_untouched(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "x").write_text("keep me")
    with pytest.raises(StoreError, match="not empty"):
        create_run(tmp_path / "run", RunConfig(), world_size=1, launcher="local", data=no_data("-"))
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["x"]


def test_a_resume_cuts_back_to_the_last_committed_checkpoint_and_is_noted(tmp_path):
    store = create_run(tmp_path / "run", RunConfig(steps=9), world_size=1, launcher="local", data=no_data("-"))
    store.append_steps(0, _rows(0, 7))
    _checkpoint(store, 0)
    _checkpoint(store, 4)
    _checkpoint(store, 6, commit=False)   # killed before its commit: not a checkpoint
    assert resume_run(RunStore.open(tmp_path / "run", mode="a"), world_size=1) == 4
    store = RunStore.open(tmp_path / "run")
    assert [c.step for c in store.checkpoints()] == [0, 4] and store.uncommitted_checkpoints() == []
    assert store.end_step == 4
    assert [r.from_step for r in store.manifest.resumes] == [4] and store.manifest.status == "running"


def test_a_run_stopped_before_its_first_commit_resumes_from_nothing(tmp_path):
    create_run(tmp_path / "run", RunConfig(), world_size=1, launcher="local", data=no_data("-"))
    store = RunStore.open(tmp_path / "run", mode="a")
    assert resume_run(store, world_size=1) is None
    assert [r.from_step for r in store.manifest.resumes] == [0]


def test_the_environment_is_the_runs_or_its_last_resumes_and_completion_counts_the_steps(tmp_path):
    store = create_run(tmp_path / "run", RunConfig(steps=3), world_size=1, launcher="local", data=no_data("-"))
    note_environment(store, {"host": "a"}, resumed=False)
    store.append_steps(0, _rows(0, 1))
    _checkpoint(store, 1)
    resume_run(store, world_size=1)
    note_environment(store, {"host": "b"}, resumed=True)
    store.append_steps(1, _rows(1, 2))
    complete_run(store)
    m = RunStore.open(tmp_path / "run").manifest
    assert m.environment == {"host": "a"} and [r.environment for r in m.resumes] == [{"host": "b"}]
    assert (m.status, m.steps_recorded) == ("complete", 3)


def test_a_run_is_not_created_inside_another_store(tmp_path):
    create_run(tmp_path / "run", RunConfig(), world_size=1, launcher="local", data=no_data("-"))
    with pytest.raises(StoreError, match="lies inside the run store"):
        create_run(tmp_path / "run" / "replays" / "mine", RunConfig(), world_size=1, launcher="local",
                   data=no_data("-"))
    assert not (tmp_path / "run" / "replays").exists()


def test_the_command_that_continues_a_run_or_a_replay_is_the_one_for_its_kind(tmp_path):
    run = create_run(tmp_path / "my run", RunConfig(), world_size=2, launcher="local", data=no_data("-"))
    assert continue_command(run) == f"replay record --store '{tmp_path / 'my run'}' --resume"
    own = create_run(tmp_path / "own", RunConfig(), world_size=1, launcher="custom", data=no_data("-"))
    assert continue_command(own) is None   # a script of the user's own: run it again with Loop(..., resume=True)
    spec = ReplaySpec(parent="../..", start=12, stop=18, start_checkpoint=10, start_checkpoint_kind="regular",
                      checkpoint_every=2, overrides=Overrides(lr_scale=0.1 + 0.2, layers=[0, 1]), processes=1)
    replay = new_store(tmp_path / "my run" / "replays" / "x", replay=spec, first_step=10)
    assert continue_command(replay) == (f"replay run '{tmp_path / 'my run'}' --from 12 --to 18 --name x --layers 0-1 "
                                        "--lr-scale 0.30000000000000004 --checkpoint-every 2 --ranks 1 --resume")
