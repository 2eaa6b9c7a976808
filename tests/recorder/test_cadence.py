"""The loop's checkpoint cadence, in process with a fake train state (tests/recorder/fakes.py): which steps
get a checkpoint, that a step's checkpoint is taken when the next step begins (so it holds what the script
did after `log`), the snapshot ring a spike writes, and that only committed checkpoints count."""

from __future__ import annotations

import pytest
import torch

from replay.config import SpikeConfig
from replay.recorder import Loop
from replay.store import RunStore
from tests.recorder.fakes import Counter, checkpointed, parts


def _train(loop: Loop, counter: Counter, losses=None, stop_after: int | None = None) -> None:
    for step in loop.steps():
        loop.sample_ids(torch.tensor([step]))
        loop.log(loss=losses[step] if losses else 1.0)
        counter.value = step + 1   # after log, as a scheduler step is: part of the state after `step`
        if step == stop_after:
            break


def test_checkpoints_on_the_cadence_and_at_the_end_hold_what_ran_after_log(tmp_path):
    model, optimizer = parts()
    counter = Counter()
    with Loop(tmp_path / "run", model, optimizer, total_steps=7, checkpoint_every=3, state=counter) as loop:
        _train(loop, counter)
    store = RunStore.open(tmp_path / "run")
    # checkpoint k is the state after steps 0..k-1, and step k-1 set the counter to k after its log
    assert checkpointed(store) == {0: ("regular", 0), 3: ("regular", 3), 6: ("regular", 6), 7: ("regular", 7)}
    assert store.manifest.status == "complete" and store.n_steps == 7


def test_a_loop_left_after_a_log_still_takes_that_steps_checkpoint_at_close(tmp_path):
    model, optimizer = parts()
    counter = Counter()
    with Loop(tmp_path / "run", model, optimizer, total_steps=10, checkpoint_every=2, state=counter) as loop:
        _train(loop, counter, stop_after=3)
        assert 4 not in checkpointed(loop.store)   # due, not taken: the script may still change the state
    store = RunStore.open(tmp_path / "run")
    assert checkpointed(store) == {0: ("regular", 0), 2: ("regular", 2), 4: ("regular", 4)}
    assert store.manifest.status == "running"   # the run did not reach its end


def test_a_spike_writes_the_snapshot_ring_before_it(tmp_path):
    model, optimizer = parts()
    counter = Counter()
    losses = [1.0 + 0.01 * (s % 3) for s in range(12)]
    losses[9] = 50.0
    spike = SpikeConfig(window=8, warmup=4)
    with Loop(tmp_path / "run", model, optimizer, total_steps=12, checkpoint_every=100, snapshot_every=1,
              snapshot_ring=3, spike=spike, state=counter) as loop:
        _train(loop, counter, losses)
    store = RunStore.open(tmp_path / "run")
    assert [s["step"] for s in store.spikes] == [9]
    # the ring holds the last 3 snapshots when step 9's checkpoint is due: the states after steps 7, 8, 9
    assert checkpointed(store) == {0: ("regular", 0), 8: ("snapshot", 8), 9: ("snapshot", 9),
                                   10: ("snapshot", 10), 12: ("regular", 12)}


def test_without_a_spike_no_snapshot_is_written(tmp_path):
    model, optimizer = parts()
    counter = Counter()
    with Loop(tmp_path / "run", model, optimizer, total_steps=6, checkpoint_every=4, snapshot_every=1,
              state=counter) as loop:
        _train(loop, counter)
    assert checkpointed(RunStore.open(tmp_path / "run")) == {0: ("regular", 0), 4: ("regular", 4), 6: ("regular", 6)}


def test_a_resumed_loop_restores_the_last_committed_checkpoint(tmp_path):
    model, optimizer = parts()
    counter = Counter()
    with Loop(tmp_path / "run", model, optimizer, total_steps=8, checkpoint_every=3, state=counter) as loop:
        _train(loop, counter, stop_after=4)   # checkpoints 0 and 3; steps 3 and 4 logged past the last one
    counter.value = -1
    seen = []
    with Loop(tmp_path / "run", model, optimizer, total_steps=8, checkpoint_every=3, state=counter,
              resume=True) as loop:
        for step in loop.steps():
            seen.append((step, counter.value))
            loop.sample_ids(torch.tensor([step]))
            loop.log(loss=1.0)
            counter.value = step + 1
    assert seen[0] == (3, 3)   # from checkpoint 3, its state restored
    store = RunStore.open(tmp_path / "run")
    assert [r.from_step for r in store.manifest.resumes] == [3]
    assert store.read_steps(["sample_ids"])["sample_ids"][:, 0, 0, 0].tolist() == list(range(8))
    assert checkpointed(store) == {0: ("regular", 0), 3: ("regular", 3), 6: ("regular", 6), 8: ("regular", 8)}


def test_one_cadence_rule_for_the_config_the_loop_and_the_recorder():
    """The checkpoint cadence is one value (config.Cadence): what is kept after each step, and what each of the
    three places that take it refuses, by the same rule."""
    from replay.config import Cadence, RunConfig
    from replay.errors import UsageError
    from replay.recorder import RecorderConfig
    from replay.recorder.run_options import RunOptions

    cadence = Cadence(checkpoint_every=4, snapshot_every=2)
    assert [cadence.due(n, 10) for n in range(1, 11)] == [None, "snapshot", None, "checkpoint", None, "snapshot",
                                                          None, "checkpoint", None, "checkpoint"]
    assert RunConfig(checkpoint_every=4, snapshot_every=2).cadence == cadence
    for bad in ({"checkpoint_every": 0}, {"snapshot_every": -1}, {"snapshot_ring": 0}):
        key = next(iter(bad))
        with pytest.raises(UsageError, match=rf"^Loop\({key}=-?\d\): a whole number >="):
            RunOptions(total_steps=10, **bad)
        with pytest.raises(UsageError, match=rf"^RecorderConfig\.{key}=-?\d: a whole number >="):
            RecorderConfig(total_steps=10, **bad)
        with pytest.raises(UsageError, match=rf"^{key} must be >= {Cadence.LEAST[key]}"):
            RunConfig(**bad).validate()
    for not_whole in (2.0, True, "3"):
        with pytest.raises(UsageError, match="a whole number"):
            RunOptions(total_steps=10, checkpoint_every=not_whole)
