"""The loop's mode, decided once (recorder/modes.py), and both modes in process: a recording, then a replay
of its window run through `Loop(lease=...)` as a launcher runs one (recorder/replaying.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replay.config import RunConfig
from replay.errors import ReplayError
from replay.recorder import Loop
from replay.recorder.command import RESUME_ENV, STORE_ENV
from replay.recorder.modes import Start, decide
from replay.replayer.replays import ReplayRequest, prepare, replay_id
from replay.store import RunStore
from replay.store.holder import ENV as LEASE_ENV
from replay.store.lease import writing
from replay.store.lifecycle import create_run, no_data
from replay.store.location import Location
from replay.store.manifest import Manifest, ReplaySpec
from replay.store.overrides import Overrides


def test_the_script_run_as_it_is_records_and_prepares_its_store(tmp_path):
    run = Location.parse(tmp_path / "run")
    assert decide(tmp_path / "run", None, False, environ={}) == Start("record", run, None, False, by_replay_run=False)
    assert decide(tmp_path / "run", None, True, environ={}).resume


def test_replay_runs_environment_makes_a_replay_whatever_the_script_passes(tmp_path):
    env = {STORE_ENV: "/runs/a/replays/w", LEASE_ENV: "spec", RESUME_ENV: "1"}
    replay = Location.parse("/runs/a/replays/w")
    assert decide(tmp_path / "run", None, False, environ=env) == Start("replay", replay, "spec", True,
                                                                      by_replay_run=True)
    assert not decide(tmp_path / "run", None, True, environ={**env, RESUME_ENV: "0"}).resume


def test_a_launchers_lease_records_or_replays_as_the_prepared_stores_kind_says(tmp_path):
    cfg = RunConfig(steps=4)
    create_run(tmp_path / "run", cfg, world_size=1, launcher="local", data=no_data("test"))
    RunStore.create(tmp_path / "replay", Manifest(kind="replay", config=cfg, world_size=1, launcher="local",
                                                  data=no_data("test"), created=0.0,
                                                  replay=ReplaySpec("../..", 1, 2, 0, "regular", 0, Overrides())))
    run = Location.parse(tmp_path / "run")
    assert decide(tmp_path / "run", "spec", False, environ={}) == Start("record", run, "spec", False,
                                                                       by_replay_run=False)
    assert decide(tmp_path / "replay", "spec", True, environ={}).mode == "replay"


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 4), torch.nn.Dropout(0.2), torch.nn.Linear(4, 16))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _run(loop: Loop, model, optimizer, draw=lambda: torch.randint(0, 16, (3,))) -> dict[int, float]:
    """A script's loop: the loader draws from torch's RNG, dropout too; returns each step's loss."""
    losses = {}
    with loop:
        for step in loop.steps():
            ix = loop.sample_ids(draw())
            loss = torch.nn.functional.cross_entropy(model(ix), ix)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            loop.log(loss=loss)
            losses[step] = loss.item()
    return losses


def _replay_path(run, req: ReplayRequest):
    return run / "replays" / replay_id(req)


def test_a_replay_restores_the_checkpoint_before_its_window_and_trains_the_recorded_steps(tmp_path):
    model, optimizer = _model()
    recorded = _run(Loop(tmp_path / "run", model, optimizer, total_steps=8, checkpoint_every=3), model, optimizer)
    req = ReplayRequest(start=4, stop=6, overrides=Overrides(skip=[5]))
    path = _replay_path(tmp_path / "run", req)
    with writing(path, "a test's replay") as lease:   # as `replay run` prepares the replay's store
        prepare(RunStore.open(tmp_path / "run"), req)
        model, optimizer = _model()   # the same model, untrained: the checkpoint restores it
        loop = Loop(path, model, optimizer, total_steps=8, lease=lease.spec)
        assert (loop.replaying, loop.window.start, loop.window.stop) == (True, 4, 6)
        replayed = _run(loop, model, optimizer)
    assert sorted(replayed) == [3, 4, 6]   # from checkpoint 3; step 5 skipped, not yielded
    assert [replayed[s] for s in (3, 4)] == [recorded[s] for s in (3, 4)]   # bit for bit up to the skip
    log = RunStore.open(path).read_steps(["loss", "sample_ids"])
    assert np.isnan(log["loss"][2]) and (log["sample_ids"][2] == -1).all()   # step 5's row: skipped
    assert RunStore.open(path).manifest.status == "complete"


def test_a_replay_refuses_a_loader_that_draws_other_samples(tmp_path):
    model, optimizer = _model()
    _run(Loop(tmp_path / "run", model, optimizer, total_steps=4, checkpoint_every=2), model, optimizer)
    req = ReplayRequest(start=2, stop=3)
    with writing(_replay_path(tmp_path / "run", req), "a test's replay") as lease:
        prepare(RunStore.open(tmp_path / "run"), req)
        model, optimizer = _model()
        with pytest.raises(ReplayError, match="step 2, rank 0: the loader drew samples"):
            _run(Loop(_replay_path(tmp_path / "run", req), model, optimizer, total_steps=4, lease=lease.spec),
                 model, optimizer, draw=lambda: torch.tensor([15, 15, 15]))
