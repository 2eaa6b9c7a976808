"""recorder/stream.py in this process: each sample's digest, and a stream continued from a position it gave,
through torch's DataLoader (drawn again from its pass's start) and torchdata's StatefulDataLoader (its state)."""

from __future__ import annotations

import google_crc32c
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from replay.errors import ReplayError, UsageError
from replay.recorder.loader import Scheduled
from replay.recorder.stream import StreamBatch, StreamLoader, sample_digests


class Counting(IterableDataset):
    """Samples 0..n-1 as (a 3-vector of the number, its label), in an order shuffled per epoch from torch's
    generator as the pass begins (as a stream that draws its order does)."""

    def __init__(self, n: int):
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.epoch)
        for i in torch.randperm(self.n, generator=g).tolist():
            yield torch.full((3,), float(i)), i


def test_a_samples_digest_is_the_crc32c_of_each_field_then_of_those():
    x = torch.arange(12, dtype=torch.int64).reshape(4, 3)
    labels = torch.tensor([7, 8, 9, 10], dtype=torch.int16)
    digests = sample_digests({"x": x, "label": labels})
    for i in range(4):
        fields = np.array([google_crc32c.value(x[i].numpy().tobytes()),
                           google_crc32c.value(labels[i].numpy().tobytes())], dtype=np.uint32)
        assert digests[i] == google_crc32c.value(fields.tobytes())
    assert np.array_equal(sample_digests(x), [google_crc32c.value(row.numpy().tobytes()) for row in x])
    texts = sample_digests(["a cat", "a dog"])
    assert texts.tolist() == [google_crc32c.value(b"a cat"), google_crc32c.value(b"a dog")]
    assert sample_digests((x, labels)).tolist() == digests.tolist()   # a tuple as a dict: the fields in order


@pytest.mark.parametrize("batch, says", [
    ({"x": torch.zeros(4, 3), "y": torch.zeros(3)}, "different numbers of samples"),
    (torch.tensor(1.0), "a scalar tensor"),
    ({"x": torch.zeros(2), "meta": object()}, "holds a object"),
    ({}, "holds no tensor"),
])
def test_a_batch_it_cannot_digest_sample_by_sample_is_refused_in_one_line(batch, says):
    with pytest.raises(UsageError, match=says):
        sample_digests(batch)


def _taken(loader: StreamLoader, count: int) -> list[torch.Tensor]:
    return [next(loader)[0] for _ in range(count)]


def _loader(dataloader) -> tuple[StreamLoader, list[StreamBatch]]:
    taken: list[StreamBatch] = []
    return StreamLoader(dataloader, taken.append), taken


@pytest.mark.parametrize("kind", ["DataLoader", "StatefulDataLoader"])
def test_a_stream_continues_from_the_position_before_a_batch_across_a_pass_end(kind):
    """10 samples in batches of 4 (the last of a pass has 2): from the position before the 3rd batch taken
    (the last of pass 0), a new loader yields what the first did after it, pass 1's order included; the
    places count on across the pass."""
    def make():
        if kind == "StatefulDataLoader":
            from torchdata.stateful_dataloader import StatefulDataLoader
            return StatefulDataLoader(Counting(10), batch_size=4)
        return DataLoader(Counting(10), batch_size=4)

    torch.manual_seed(0)
    first, taken = _loader(make())
    batches = _taken(first, 6)
    assert [b.ids.tolist() for b in taken[:4]] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13]]
    position = taken[2].before
    assert (position["pass"], position["position"], position["place"]) == (0, 2, 8)
    assert (position["loader"] is not None) == (kind == "StatefulDataLoader")
    again, retaken = _loader(make())
    again.restore(position, [])
    assert all(torch.equal(a, b) for a, b in zip(_taken(again, 4), batches[2:], strict=True))
    assert [b.ids.tolist() for b in retaken] == [b.ids.tolist() for b in taken[2:]]
    assert [b.digests.tolist() for b in retaken] == [b.digests.tolist() for b in taken[2:]]


def test_a_replayed_batch_whose_samples_are_not_the_records_stops_the_replay():
    first, taken = _loader(DataLoader(Counting(10), batch_size=4))
    _taken(first, 2)
    recorded = [Scheduled(7, micro, b.ids, False, b.digests) for micro, b in enumerate(taken)]
    recorded[1].digests = recorded[1].digests.copy()
    recorded[1].digests[3] ^= 1
    again, retaken = _loader(DataLoader(Counting(10), batch_size=4))
    again.restore(taken[0].before, recorded)
    next(again)   # the record's first batch
    with pytest.raises(ReplayError, match="step 7, micro-batch 1: the stream's sample 7 is not the recorded one"):
        next(again)


class ForgetfulState(Counting):
    """A test double for a stream whose state_dict() does not bring it back (as Hugging Face datasets 4.7's after
    a `.map` over a streamed JSON file, which keeps the Arrow shard's read position): it says it is at its
    start whatever it has yielded."""

    def state_dict(self):
        return {"at": 0}

    def load_state_dict(self, state):
        pass


def test_a_loader_state_that_does_not_bring_the_stream_back_is_caught_and_state_false_draws_the_pass_again():
    """Through torchdata's StatefulDataLoader (which keeps its dataset's state_dict()): from its state, a replay
    stops at the first sample of the checkpoint's batch; with state=False the pass is drawn again to the position,
    and the replay's batches are the record's, checked by their digests."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    for state, says in ((True, "step 3, micro-batch 0: the stream's sample 8 is not the recorded one"), (False, None)):
        torch.manual_seed(0)
        taken: list[StreamBatch] = []
        first = StreamLoader(StatefulDataLoader(ForgetfulState(20), batch_size=4), taken.append, state=state)
        batches = _taken(first, 4)
        recorded = [Scheduled(3, micro, b.ids, False, b.digests) for micro, b in enumerate(taken[2:])]
        again = StreamLoader(StatefulDataLoader(ForgetfulState(20), batch_size=4), lambda batch: None, state=state)
        again.restore(taken[2].before, recorded)
        if says is not None:
            with pytest.raises(ReplayError, match=says):
                next(again)
        else:
            assert all(torch.equal(a, b) for a, b in zip(_taken(again, 2), batches[2:], strict=True))


def test_a_restored_stream_that_ends_before_the_position_is_refused():
    first, taken = _loader(DataLoader(Counting(10), batch_size=4))
    _taken(first, 3)
    short, _ = _loader(DataLoader(Counting(4), batch_size=4))   # one batch a pass, where the record had three
    short.restore(taken[2].before, [])
    with pytest.raises(ReplayError, match="ended after fewer batches than the record drew"):
        next(short)


def test_a_plain_dataloader_with_persistent_workers_is_refused_in_one_line():
    with pytest.raises(UsageError, match="persistent_workers=True cannot be continued inside a later pass"):
        StreamLoader(DataLoader(Counting(10), batch_size=4, num_workers=2, persistent_workers=True), lambda b: None)


class Packing(IterableDataset):
    """Documents 0..n-1 of 3 tokens each packed into rows of 2 tokens, stateful as torchdata asks, its state the
    live buffer it packs into (as torchtitan's text dataset keeps its token buffers): the tokens left over after a
    row wait in it, and a later batch changes what an earlier state_dict() returned."""

    def __init__(self, n: int):
        self.n, self.buffer, self.next = n, [], 0

    def state_dict(self):
        return {"buffer": self.buffer, "next": self.next}

    def load_state_dict(self, state):
        self.buffer, self.next = list(state["buffer"]), state["next"]

    def __iter__(self):
        while self.next < self.n:
            self.buffer.extend([self.next] * 3)
            self.next += 1
            while len(self.buffer) >= 2:
                row = torch.tensor(self.buffer[:2])
                del self.buffer[:2]
                yield row


def _pickling_loader(dataset):
    """A StatefulDataLoader that pickles its state per rank, the shape of torchtitan's ParallelAwareDataloader."""
    import pickle

    from torchdata.stateful_dataloader import StatefulDataLoader

    class Pickling(StatefulDataLoader):
        def state_dict(self):
            return {"dp_rank_0": pickle.dumps(super().state_dict()), "world_size": 1}

        def load_state_dict(self, state):
            super().load_state_dict(pickle.loads(state["dp_rank_0"]))

    return Pickling(dataset, batch_size=2)


def test_a_loader_that_pickles_its_state_is_kept_by_the_state_it_pickles_copied_as_it_was():
    first, taken = _loader(_pickling_loader(Packing(24)))
    batches = _taken(first, 5)
    position = taken[2].before
    assert position["loader_class"] == "StatefulDataLoader"   # its own state holds bytes: the store keeps no pickle
    again, retaken = _loader(_pickling_loader(Packing(24)))
    again.restore(position, [])
    assert all(torch.equal(a, b) for a, b in zip(_taken(again, 3), batches[2:], strict=True))
    assert [b.ids.tolist() for b in retaken] == [b.ids.tolist() for b in taken[2:]]


def test_a_loader_whose_state_holds_other_objects_is_refused_in_one_line():
    class Opaque(DataLoader):
        def state_dict(self):
            return {"handle": object()}

        def load_state_dict(self, state):
            pass

    loader, _ = _loader(Opaque(Counting(10), batch_size=4))
    with pytest.raises(UsageError, match=r"holds what the store keeps only as pickle \(object\)"):
        next(loader)
