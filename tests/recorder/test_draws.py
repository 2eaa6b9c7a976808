"""Which step a draw through `loop.sample_ids` belongs to (recorder/loop.py): ids drawn ahead of the step that
trains on them (nanoGPT's prefetch), evaluation draws, and a resumed run or a replay that restores the draws
ahead of its first step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replay.errors import UsageError
from replay.recorder import Loop
from replay.replayer.replays import ReplayRequest, prepare, replay_id
from replay.store import RunStore
from replay.store.lease import writing
from replay.store.overrides import Overrides
from replay.store.run_store import micro_batches
from tests.recorder.models import OneBlock

DATA = torch.arange(64, dtype=torch.float32)


def _parts():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _prefetching(loop, model, optimizer, accum=2, stop_after=None, evaluate=None):
    """nanoGPT's loop: the first batch drawn before the loop, each next one right after a micro-batch's forward;
    returns per step the ids its forwards trained on (as the script sees them) and its loss."""
    def get_batch():
        return loop.sample_ids(torch.randint(len(DATA), (4,)))

    trained, x = {}, get_batch()
    for step in loop.steps():
        if evaluate is not None:
            evaluate(step, get_batch)
        ids, total = [], 0.0
        for _ in range(accum):
            loss = model(DATA[x].unsqueeze(-1) / 64).pow(2).mean() / accum
            ids.append(x.tolist())
            x = get_batch()   # the prefetch: the next step's first micro-batch after the last one
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        loop.log(loss=total)
        trained[step] = (ids, total)
        if step == stop_after:
            break
    loop.close()
    return trained


def _stored(path):
    return [[b.tolist() for b in micro_batches(s[0])] for s in RunStore.open(path).read_steps()["sample_ids"]]


def test_ids_drawn_ahead_belong_to_the_step_that_trains_on_them(tmp_path):
    model, optimizer = _parts()
    trained = _prefetching(Loop(tmp_path / "run", model, optimizer, total_steps=6, checkpoint_every=2), model,
                           optimizer)
    assert _stored(tmp_path / "run") == [trained[s][0] for s in range(6)]


def test_a_replay_and_a_resumed_run_restore_the_ids_drawn_ahead_of_their_first_step(tmp_path):
    model, optimizer = _parts()
    whole = _prefetching(Loop(tmp_path / "run", model, optimizer, total_steps=6, checkpoint_every=2), model,
                         optimizer)
    path = tmp_path / "run" / "replays" / replay_id(ReplayRequest(start=3, stop=5))
    with writing(path, "a test's replay") as lease:
        prepare(RunStore.open(tmp_path / "run"), ReplayRequest(start=3, stop=5))
        model, optimizer = _parts()
        torch.manual_seed(99)   # the draw before the first step comes from other RNG states than the record's
        replayed = _prefetching(Loop(path, model, optimizer, total_steps=6, lease=lease.spec), model, optimizer)
    assert sorted(replayed) == [2, 3, 4, 5] and all(replayed[s] == whole[s] for s in replayed)

    model, optimizer = _parts()
    _prefetching(Loop(tmp_path / "cut", model, optimizer, total_steps=6, checkpoint_every=2), model, optimizer,
                 stop_after=2)
    model, optimizer = _parts()
    torch.manual_seed(7)
    resumed = _prefetching(Loop(tmp_path / "cut", model, optimizer, total_steps=6, checkpoint_every=2, resume=True),
                           model, optimizer)
    assert sorted(resumed) == [2, 3, 4, 5] and all(resumed[s] == whole[s] for s in resumed)
    a, b = (RunStore.open(tmp_path / p).read_steps() for p in ("run", "cut"))
    assert np.array_equal(a["sample_ids"], b["sample_ids"]) and np.array_equal(a["loss"], b["loss"])


def test_a_replay_that_skips_a_step_hands_its_prefetched_successor_the_successors_ids(tmp_path):
    model, optimizer = _parts()
    whole = _prefetching(Loop(tmp_path / "run", model, optimizer, total_steps=6, checkpoint_every=2), model,
                         optimizer)
    req = ReplayRequest(start=2, stop=5, overrides=Overrides(skip=[3]))
    path = tmp_path / "run" / "replays" / replay_id(req)
    with writing(path, "a test's replay") as lease:
        prepare(RunStore.open(tmp_path / "run"), req)
        model, optimizer = _parts()
        replayed = _prefetching(Loop(path, model, optimizer, total_steps=6, lease=lease.spec), model, optimizer)
    assert sorted(replayed) == [2, 4, 5]   # step 2's prefetch was drawn for step 3: step 4 trains on its own ids
    assert [replayed[s][0] for s in (2, 4, 5)] == [whole[s][0] for s in (2, 4, 5)]


@pytest.mark.parametrize("how", ["eval-mode", "no-grad", "evaluating"])
def test_evaluation_draws_are_neither_recorded_nor_replaced(tmp_path, how):
    model, optimizer = _parts()
    loop = Loop(tmp_path / "run", model, optimizer, total_steps=4, checkpoint_every=2)
    evaluated = []

    def evaluate(step, get_batch):
        if step % 2:
            return
        if how == "eval-mode":
            model.eval()
            evaluated.append(get_batch().tolist())
            model.train()
        elif how == "no-grad":
            with torch.no_grad():
                evaluated.append(get_batch().tolist())
        else:
            with loop.evaluating():
                evaluated.append(get_batch().tolist())

    trained = _prefetching(loop, model, optimizer, evaluate=evaluate)
    assert len(evaluated) == 2
    assert _stored(tmp_path / "run") == [trained[s][0] for s in range(4)]   # the evaluation's ids in no step


def test_a_resumed_script_that_draws_ahead_differently_is_refused(tmp_path):
    model, optimizer = _parts()
    _prefetching(Loop(tmp_path / "run", model, optimizer, total_steps=6, checkpoint_every=2), model, optimizer,
                 stop_after=2)
    model, optimizer = _parts()
    loop = Loop(tmp_path / "run", model, optimizer, total_steps=6, checkpoint_every=2, resume=True)
    with pytest.raises(UsageError, match="drew 0 batch\\(es\\) before the first step; the checkpoint it starts "
                                         "from has 1 drawn ahead"):
        next(loop.steps())
    loop.close()


def _attention_run(loop, model, optimizer):
    """A prefetching loop whose data draws come from torch's global generator, as its dropout masks do."""
    trained, x = {}, loop.sample_ids(torch.randint(64, (2, 8)))
    for step in loop.steps():
        loss = torch.nn.functional.cross_entropy(model(x).view(-1, 64), x.view(-1))
        ids, x = x.tolist(), loop.sample_ids(torch.randint(64, (2, 8)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loop.log(loss=loss)
        trained[step] = (ids, loss.item())
    loop.close()
    return trained


def test_an_attention_counterfactual_under_dropout_trains_the_recorded_ids_and_runs_the_same_twice(tmp_path):
    def parts():
        torch.manual_seed(0)
        model = OneBlock(64, dropout=0.3)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    model, optimizer = parts()
    whole = _attention_run(Loop(tmp_path / "run", model, optimizer, total_steps=6, checkpoint_every=2), model,
                           optimizer)
    runs = []
    for name in ("a", "b"):
        req = ReplayRequest(start=3, stop=5, overrides=Overrides(attention="reference-emu:dtype=bf16"), name=name)
        path = tmp_path / "run" / "replays" / replay_id(req)
        with writing(path, "a test's replay") as lease:
            prepare(RunStore.open(tmp_path / "run"), req)
            model, optimizer = parts()
            runs.append(_attention_run(Loop(path, model, optimizer, total_steps=6, lease=lease.spec), model,
                                       optimizer))
    assert runs[0] == runs[1]   # the emulation's dropout masks come from the restored RNG states
    assert sorted(runs[0]) == [2, 3, 4, 5] and all(runs[0][s][0] == whole[s][0] for s in runs[0])   # the record's ids
    assert runs[0][2][1] == whole[2][1] and all(runs[0][s][1] != whole[s][1] for s in (3, 4, 5))   # from --from on
