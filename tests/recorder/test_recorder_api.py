"""The recorder's Python API driven by a training loop written here, as a user with their own loop would."""

import json

import numpy as np
import pytest
import torch

from replay.config import RunConfig
from replay.recorder import Recorder, RecorderConfig, SpikeEvent, create_run_store, resume_run_store
from replay.recorder.state import TorchTrainState
from replay.store import RunStore
from tests.conftest import error_line, replay_cli, tree_snapshot


def _loop_parts(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    return model, opt, sched


def _train(rec, model, opt, sched, start, stop, data, spike_at=None, seen=None):
    for step in range(start, stop):
        ids = np.array([[2 * step % 64, (2 * step + 1) % 64]])
        x, y = data[0][ids[0]], data[1][ids[0]]
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        reported = loss.item() * (1000 if step == spike_at else 1)   # the user reports a loss blow-up
        rec.record_step(step, sample_ids=ids, loss=reported, grad_norm=norm.item(), lr=lr, tokens=2)
        if seen is not None:
            seen[step + 1] = {k: v.clone() for k, v in model.state_dict().items()}


def test_own_loop_records_steps_checkpoints_and_flushes_the_snapshot_ring(tmp_path):
    path = str(tmp_path / "run")
    create_run_store(path, RunConfig(steps=30), description="random regression data")
    gen = torch.Generator().manual_seed(1)
    data = (torch.randn(64, 16, generator=gen), torch.randn(64, 1, generator=gen))
    model, opt, sched = _loop_parts()
    cfg = RecorderConfig(total_steps=30, checkpoint_every=10, snapshot_every=2, snapshot_ring=3)
    rec = Recorder(path, TorchTrainState(model, opt, sched), cfg)
    assert rec.start() == 0
    weights_after = {}
    _train(rec, model, opt, sched, 0, 30, data, spike_at=25, seen=weights_after)
    rec.close()

    store = RunStore.open(path)
    steps = store.read_steps()
    assert store.n_steps == 30 and steps["sample_ids"].shape == (30, 1, 1, 2)
    assert steps["sample_ids"][7, 0, 0].tolist() == [14, 15]
    assert steps["lr"][9] == 1e-2 and steps["lr"][10] == 5e-3
    assert [e["step"] for e in store.spikes] == [25] and isinstance(rec.spikes[0], SpikeEvent)
    kinds = {c.step: c.kind for c in store.checkpoints()}
    # regular every 10; the ring held the snapshots after 20 (22, 24, 26) and was written when step 25 spiked
    assert kinds == {0: "regular", 10: "regular", 20: "regular", 22: "snapshot", 24: "snapshot",
                     26: "snapshot", 30: "regular"}
    for step in (10, 22, 26, 30):   # each is the state right after that many steps, not a later one
        stored = store.read_shard(step, 0)["state"]["replicated"]["model"]
        assert all(torch.equal(stored[k], weights_after[step][k]) for k in stored), step


def test_own_loop_resumes_from_the_last_committed_checkpoint(tmp_path):
    path = str(tmp_path / "run")
    create_run_store(path, RunConfig(steps=20))
    gen = torch.Generator().manual_seed(2)
    data = (torch.randn(64, 16, generator=gen), torch.randn(64, 1, generator=gen))
    cfg = RecorderConfig(total_steps=20, checkpoint_every=5)

    model, opt, sched = _loop_parts()
    rec = Recorder(path, TorchTrainState(model, opt, sched), cfg)
    rec.start()
    _train(rec, model, opt, sched, 0, 12, data)   # "crashes" after step 11: checkpoints 0, 5, 10
    rec.flush()

    model2, opt2, sched2 = _loop_parts(seed=99)   # a fresh process would build these anew
    assert resume_run_store(path, world_size=1) == 10   # once, before the ranks start
    rec2 = Recorder(path, TorchTrainState(model2, opt2, sched2), cfg, resume=True)
    assert rec2.start() == 10
    assert sched2.last_epoch == 10
    _train(rec2, model2, opt2, sched2, 10, 20, data)
    rec2.close()

    model3, opt3, sched3 = _loop_parts()           # the same 20 steps without interruption
    ref_path = str(tmp_path / "ref")
    create_run_store(ref_path, RunConfig(steps=20))
    rec3 = Recorder(ref_path, TorchTrainState(model3, opt3, sched3), cfg)
    rec3.start()
    _train(rec3, model3, opt3, sched3, 0, 20, data)
    rec3.close()
    a, b = RunStore.open(path).read_steps(), RunStore.open(ref_path).read_steps()
    assert np.array_equal(a["loss"], b["loss"]) and np.array_equal(a["grad_norm"], b["grad_norm"])
    assert all(torch.equal(p, q) for p, q in zip(model2.parameters(), model3.parameters(), strict=True))


def test_bad_recorder_settings_are_value_errors():
    for bad in ({"checkpoint_every": 0}, {"total_steps": 0}, {"snapshot_every": -1}, {"snapshot_ring": 0}):
        with pytest.raises(ValueError, match=f"RecorderConfig.{next(iter(bad))}=-?[0-9]+: a whole number >="):
            RecorderConfig(**{"total_steps": 10, **bad})


def test_a_store_of_an_own_loop_is_read_but_never_rebuilt(tmp_path):
    """`replay run` and `bisect` start a run's command again, which the bare Recorder does not keep, and
    `analyze` needs a weight layout: on such a store they refuse in one line and write nothing; `info` and
    `batch` read it."""
    path = tmp_path / "run"
    create_run_store(str(path), RunConfig(steps=6))
    gen = torch.Generator().manual_seed(3)
    data = (torch.randn(64, 16, generator=gen), torch.randn(64, 1, generator=gen))
    model, opt, sched = _loop_parts()
    rec = Recorder(str(path), TorchTrainState(model, opt, sched), RecorderConfig(total_steps=6, checkpoint_every=3))
    rec.start()
    _train(rec, model, opt, sched, 0, 6, data)
    rec.close()
    before = tree_snapshot(path)
    for command in (["run", str(path), "--from", "3", "--to", "4"], ["bisect", str(path)]):
        line = error_line(replay_cli(*command))
        assert "was recorded by the Recorder API without its command" in line and f"`replay {command[0]}`" in line
    assert "named no weight layout" in error_line(replay_cli("analyze", str(path)))
    assert tree_snapshot(path) == before
    rows = json.loads(replay_cli("batch", str(path), "--step", "4", "--json").stdout)
    assert [r["sample_id"] for r in rows] == [8, 9] and "not in the store" in rows[0]["text"]
