"""`loop.loader(dataloader)` in process (recorder/loader.py): the indices each step trained on, epoch after epoch;
the stream continued by a replay and a resumed run from a checkpoint in the middle of an epoch. Worker
processes: tests/recorder/test_loader_integration.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, WeightedRandomSampler

from replay.errors import ReplayError, UsageError
from replay.recorder import Loop
from replay.recorder.environment import cpu_rng_state
from replay.recorder.loader import RecordedLoader
from replay.replayer.replays import ReplayRequest, prepare, replay_id
from replay.store import RunStore
from replay.store.lease import writing
from replay.store.overrides import Overrides
from replay.store.run_store import micro_batches
from replay.views import step_batch

N, BATCH, ACCUM = 10, 3, 2   # an epoch: batches of 3, 3, 3 and 1


class Numbers(Dataset):
    """Sample i is (i, a random augmentation): a batch says which samples it holds, whatever the store says."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.tensor([float(i), float(torch.rand(()))])


def _parts():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def _loader(sampler=None):
    data = Numbers()
    return DataLoader(data, batch_size=BATCH, sampler=sampler if sampler is not None else RandomSampler(data))


def _train(loop, model, optimizer, dl, stop_after=None, ahead=False, accum=ACCUM):
    """Steps as a script runs them; returns per step the samples and augmentations it trained on, and its loss."""
    seen, batches = {}, iter(loop.loader(dl))
    pending = next(batches) if ahead else None   # a prefetch: the first batch taken before the first step
    for step in loop.steps():
        pending, seen[step] = _step(batches, pending, model, optimizer, ahead, accum)
        loop.log(loss=seen[step][2])
        if step == stop_after:
            break
    loop.close()
    return seen


def _plain(model, optimizer, dl, steps, ahead=False):
    """`_train`'s loop without replay: the DataLoader iterated epoch after epoch, told its epoch as the loader
    tells it."""
    def forever():
        for epoch in range(steps * ACCUM + 1):
            if hasattr(dl.sampler, "set_epoch"):
                dl.sampler.set_epoch(epoch)
            yield from dl

    seen, batches = {}, forever()
    pending = next(batches) if ahead else None
    for step in range(steps):
        pending, seen[step] = _step(batches, pending, model, optimizer, ahead, ACCUM)
    return seen


def _step(batches, pending, model, optimizer, ahead: bool, accum: int):
    """One optimizer step over `accum` batches (the one `pending` from a prefetch first); returns the batch it
    took ahead and the step's samples, augmentations and loss."""
    micro, total = [], 0.0
    for _ in range(accum):
        x = next(batches) if pending is None else pending
        pending = next(batches) if ahead else None
        loss = model(x / N).pow(2).mean() / accum
        loss.backward()
        total += loss.item()
        micro.append(x)
    optimizer.step()
    optimizer.zero_grad()
    return pending, ([x[:, 0].long().tolist() for x in micro], torch.cat(micro)[:, 1].tolist(), total)


def _stored(path) -> list[list[list[int]]]:
    return [[b.tolist() for b in micro_batches(step[0])] for step in RunStore.open(path).read_steps()["sample_ids"]]


def test_each_step_holds_the_indices_it_trained_on_epoch_after_epoch(tmp_path):
    model, optimizer = _parts()
    seen = _train(Loop(tmp_path / "run", model, optimizer, total_steps=8, checkpoint_every=3), model, optimizer,
                  _loader())
    assert _stored(tmp_path / "run") == [seen[s][0] for s in range(8)]
    batches = [b for s in range(8) for b in seen[s][0]]
    assert [len(b) for b in batches] == [3, 3, 3, 1] * 4   # the epoch's last batch is smaller, as the loader's
    epochs = [sorted(sum(batches[e * 4:(e + 1) * 4], [])) for e in range(4)]
    assert all(e == list(range(N)) for e in epochs)   # every sample once an epoch
    orders = {tuple(sum(batches[e * 4:(e + 1) * 4], [])) for e in range(4)}
    assert len(orders) == 4   # reshuffled every epoch
    assert RunStore.open(tmp_path / "run").read_steps()["sample_ids"].shape[1:] == (1, ACCUM, BATCH)


def test_a_distributed_sampler_is_told_the_epoch_by_the_loader(tmp_path):
    model, optimizer = _parts()
    sampler = DistributedSampler(Numbers(), num_replicas=2, rank=1, shuffle=True, seed=5)   # rank 1 of 2, no group
    _train(Loop(tmp_path / "run", model, optimizer, total_steps=6, checkpoint_every=3), model, optimizer,
           _loader(sampler))
    expected = []   # 5 samples a rank: an epoch is a batch of 3 and one of 2
    for epoch in range(6):
        mine = DistributedSampler(range(N), num_replicas=2, rank=1, shuffle=True, seed=5)
        mine.set_epoch(epoch)
        order = list(mine)
        expected += [order[i:i + BATCH] for i in range(0, len(order), BATCH)]
    stored = [b for step in _stored(tmp_path / "run") for b in step]
    assert stored == expected


def _replay(run, req, dl_sampler=None, draw_ahead=False, accum=ACCUM):
    path = run / "replays" / replay_id(req)
    with writing(path, "a test's replay") as lease:   # as `replay run` prepares the replay's store
        prepare(RunStore.open(run), req)
        model, optimizer = _parts()   # untrained: the checkpoint restores it
        loop = Loop(path, model, optimizer, total_steps=8, lease=lease.spec)
        return _train(loop, model, optimizer, _loader(dl_sampler), ahead=draw_ahead, accum=accum), path


@pytest.mark.parametrize("ahead", [False, True], ids=["in-step", "prefetched"])
def test_a_replay_continues_the_stream_from_a_checkpoint_inside_an_epoch(tmp_path, ahead):
    model, optimizer = _parts()
    recorded = _train(Loop(tmp_path / "run", model, optimizer, total_steps=8, checkpoint_every=3), model,
                      optimizer, _loader(), ahead=ahead)
    replayed, _ = _replay(tmp_path / "run", ReplayRequest(start=4, stop=7), draw_ahead=ahead)
    assert sorted(replayed) == [3, 4, 5, 6, 7]   # from checkpoint 3: the middle of the second epoch
    assert all(replayed[s] == recorded[s] for s in replayed)   # samples, augmentations, losses: bit for bit


@pytest.mark.parametrize("accum", [ACCUM, 3], ids=["within-an-epoch", "across-an-epochs-end"])
def test_a_replay_that_skips_a_step_trains_the_next_one_on_its_own_batches(tmp_path, accum):
    model, optimizer = _parts()
    # with accum 3, step 4 takes an epoch's last batch and the next epoch's first
    recorded = _train(Loop(tmp_path / "run", model, optimizer, total_steps=8, checkpoint_every=3), model,
                      optimizer, _loader(), accum=accum)
    replayed, path = _replay(tmp_path / "run", ReplayRequest(start=3, stop=7, overrides=Overrides(skip=[4])),
                             accum=accum)
    assert sorted(replayed) == [3, 5, 6, 7]
    assert all(replayed[s][0] == recorded[s][0] for s in replayed)   # each step's own samples
    # the augmentations drawn before the skipped step are the record's; after it, without step 4's draws, the
    # replay's own (as dropout's)
    assert replayed[3][1] == recorded[3][1] and replayed[5][1] != recorded[5][1]
    assert replayed[5][2] != recorded[5][2]   # trained without step 4's update
    assert (RunStore.open(path).read_steps()["sample_ids"][1] == -1).all()


def test_a_replay_whose_sampler_draws_other_batches_is_refused(tmp_path):
    model, optimizer = _parts()
    _train(Loop(tmp_path / "run", model, optimizer, total_steps=8, checkpoint_every=3), model, optimizer, _loader())
    other = RandomSampler(Numbers(), generator=torch.Generator().manual_seed(123))   # a generator of its own
    with pytest.raises(ReplayError, match="micro-batch 0: the loader's sampler yields samples"):
        _replay(tmp_path / "run", ReplayRequest(start=4, stop=7), dl_sampler=other)


SAMPLERS = {
    "random": lambda: RandomSampler(Numbers()),
    "with-replacement": lambda: RandomSampler(Numbers(), replacement=True, num_samples=7),   # minGPT's kind
    "weighted": lambda: WeightedRandomSampler(torch.linspace(0.1, 1.0, N), num_samples=N),
    "distributed": lambda: DistributedSampler(Numbers(), num_replicas=2, rank=0, shuffle=True, seed=1),
    "own-generator": lambda: RandomSampler(Numbers(), generator=torch.Generator().manual_seed(7)),   # accelerate's
    "accelerate-seedable": lambda: _seedable(),   # reseeded from its epoch (use_seedable_sampler=True)
}


def _seedable():
    from accelerate.data_loader import SeedableRandomSampler

    return SeedableRandomSampler(data_source=Numbers(), data_seed=11)


@pytest.mark.parametrize("kind", SAMPLERS)
def test_a_resumed_run_continues_the_stream_as_the_uninterrupted_run_did(tmp_path, kind):
    model, optimizer = _parts()
    whole = _train(Loop(tmp_path / "whole", model, optimizer, total_steps=8, checkpoint_every=3), model, optimizer,
                   _loader(SAMPLERS[kind]()))
    model, optimizer = _parts()
    _train(Loop(tmp_path / "cut", model, optimizer, total_steps=8, checkpoint_every=3), model, optimizer,
           _loader(SAMPLERS[kind]()), stop_after=4)   # stopped after step 4: its last checkpoint is 3, mid-epoch
    model, optimizer = _parts()
    resumed = _train(Loop(tmp_path / "cut", model, optimizer, total_steps=8, checkpoint_every=3, resume=True),
                     model, optimizer, _loader(SAMPLERS[kind]()))
    assert sorted(resumed) == [3, 4, 5, 6, 7]
    assert all(resumed[s] == whole[s] for s in resumed)
    a, b = (RunStore.open(tmp_path / p).read_steps() for p in ("whole", "cut"))
    assert np.array_equal(a["sample_ids"], b["sample_ids"]) and np.array_equal(a["loss"], b["loss"])


@pytest.mark.parametrize("kind", SAMPLERS)
def test_a_recording_draws_what_the_loop_without_replay_draws(tmp_path, kind):
    """Without worker processes: the sampler's order (a RandomSampler's seed drawn from torch's generator each
    epoch), the DataLoader's base seed, the augmentation drawn in `__getitem__` and the dropout are the loop's
    without replay, bit for bit, over four epochs, its first batch taken ahead of the first step."""
    model, optimizer = _parts()
    plain = _plain(model, optimizer, _loader(SAMPLERS[kind]()), steps=8, ahead=True)
    model, optimizer = _parts()
    recorded = _train(Loop(tmp_path / "run", model, optimizer, total_steps=8, checkpoint_every=3), model, optimizer,
                      _loader(SAMPLERS[kind]()), ahead=True)
    assert recorded == plain


@pytest.mark.parametrize("misuse, message", [
    (lambda loop, dl: (loop.loader(dl), loop.loader(dl)), "loop.loader\\(...\\) is called once"),
    (lambda loop, dl: loop.loader([1, 2, 3]), "takes a torch.utils.data.DataLoader, not a list"),
    (lambda loop, dl: (iter(dl), loop.loader(dl)), "has not been iterated yet"),
])
def test_a_loader_misused_is_refused_in_one_line(tmp_path, misuse, message):
    model, optimizer = _parts()
    dl = DataLoader(Numbers(), batch_size=BATCH, num_workers=0, persistent_workers=False)
    if "iterated" in message:   # a DataLoader keeps its iterator only with persistent workers: note one by hand
        dl._iterator = object()
    with Loop(tmp_path / "run", model, optimizer, total_steps=2) as loop, pytest.raises(UsageError, match=message):
        misuse(loop, dl)


def test_a_checkpoint_whose_loader_drew_from_generators_of_its_own_is_refused_in_one_line():
    """What an earlier replay kept: the loader's own generator states at the epoch's start, no format."""
    stream = RecordedLoader(_loader(), take=lambda batch: None, seed=0)
    old = {"seed": 0, "pass": 1, "position": 2, "number": 6, "pass_start": cpu_rng_state()}
    with pytest.raises(UsageError, match="recorded by an earlier version of replay"):
        stream.restore(old, [])


def test_replay_batch_shows_an_epochs_smaller_last_batch_without_its_padding(tmp_path):
    model, optimizer = _parts()
    seen = _train(Loop(tmp_path / "run", model, optimizer, total_steps=2, checkpoint_every=3), model, optimizer,
                  _loader())
    rows = step_batch(str(tmp_path / "run"), 1)   # batches of 3 and 1: the epoch's last
    assert [[r["sample_id"] for r in rows if r["micro"] == m] for m in (0, 1)] == seen[1][0]


def test_a_replay_stopped_and_resumed_continues_from_its_own_checkpoint(tmp_path):
    model, optimizer = _parts()
    recorded = _train(Loop(tmp_path / "run", model, optimizer, total_steps=8, checkpoint_every=3), model,
                      optimizer, _loader())
    replays = {}
    for name, stop_after in (("whole", None), ("cut", 3)):
        req = ReplayRequest(start=3, stop=7, checkpoint_every=2, name=name, overrides=Overrides(skip=[4]))
        with writing(tmp_path / "run" / "replays" / name, "a test's replay") as lease:
            prepare(RunStore.open(tmp_path / "run"), req)
            model, optimizer = _parts()
            replays[name] = _train(Loop(tmp_path / "run" / "replays" / name, model, optimizer, total_steps=8,
                                        lease=lease.spec), model, optimizer, _loader(), stop_after=stop_after)
    assert sorted(replays["cut"]) == [3]   # stopped after step 3, whose checkpoint 4 is its last
    req = ReplayRequest(start=3, stop=7, checkpoint_every=2, name="cut", overrides=Overrides(skip=[4]), resume=True)
    with writing(tmp_path / "run" / "replays" / "cut", "a test's replay") as lease:
        prepare(RunStore.open(tmp_path / "run"), req)
        model, optimizer = _parts()
        resumed = _train(Loop(tmp_path / "run" / "replays" / "cut", model, optimizer, total_steps=8,
                              lease=lease.spec, resume=True), model, optimizer, _loader())
    assert sorted(resumed) == [5, 6, 7] and all(resumed[s] == replays["whole"][s] for s in resumed)
    assert all(resumed[s][0] == recorded[s][0] for s in resumed)   # each step's own samples


@pytest.mark.parametrize(("samples", "batch", "drop_last", "per", "uneven"), [
    (10, 4, False, 2, False),   # batches 4, 4, 2: dispatches of 8 and 2 samples, shared by 2 ranks
    (9, 4, False, 2, True),     # 4, 4, 1: the last dispatch's 1 sample cannot be shared
    (9, 4, True, 2, False),     # 4, 4: one dispatch of 8
    (20, 4, False, 2, False),   # 5 batches: the last dispatch is one batch of 4
    (15, 4, False, 2, True),    # 4, 4, 4, 3: the last dispatch 4 + 3
    (18, 4, False, 2, False),   # 4, 4, 4, 4, 2: the last dispatch the batch of 2
    (10, 4, False, 1, False),   # split_batches: the last batch of 2, split in two
    (9, 4, False, 1, True),     # ... of 1
])
def test_a_dispatchers_uneven_last_dispatch_is_found_from_the_sampler(samples, batch, drop_last, per, uneven):
    """accelerate pads an epoch's last dispatch from the epoch's first when the ranks cannot share it evenly;
    whether it will, from the batch sampler's lengths, is what `loop.loader` refuses a dispatcher on."""
    from torch.utils.data import BatchSampler, SequentialSampler

    from replay.recorder.loader import _Dispatch, _uneven_end

    sampler = BatchSampler(SequentialSampler(range(samples)), batch, drop_last)
    dispatches = [list(range(len(sampler)))[i:i + per] for i in range(0, len(sampler), per)]
    sizes = [len(b) for b in sampler]
    last = sum(sizes[i] for i in dispatches[-1])   # counted from the batches themselves
    assert (last % 2 != 0) == uneven, last
    dispatch = _Dispatch(per, 0, 2, torch.device("cpu"), drop_last)
    assert _uneven_end(sampler, dispatch) == uneven
    assert _uneven_end([[0, 1], [2]], dispatch) is None   # a batch sampler of one's own, saying neither: unknown
