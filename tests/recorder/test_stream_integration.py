"""recorder/stream.py with DataLoader worker processes: a stream whose workers draw random numbers, continued
from a position inside its second pass."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from replay.recorder.stream import StreamBatch, StreamLoader


class Drawing(IterableDataset):
    """12 samples a pass, split over the workers, each drawn from the worker's torch generator (seeded from the
    DataLoader iterator's base seed, which the iterator draws from torch's generator when it is made)."""

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for _ in range(worker, 12, workers):
            yield torch.randint(0, 1_000_000, (3,))


def test_a_stream_whose_workers_draw_continues_inside_a_later_pass_as_recorded():
    """Batches of 2 from 2 workers: 6 a pass. From the position before batch 8 (pass 1, its 2nd), a new loader
    makes pass 1's iterator from the generator state the record made it from, not from torch's generator as it
    is now (moved on here), and yields what the record did; torch's generator is not drawn from for it."""
    def loader() -> tuple[StreamLoader, list[StreamBatch]]:
        taken: list[StreamBatch] = []
        return StreamLoader(DataLoader(Drawing(), batch_size=2, num_workers=2), taken.append), taken

    torch.manual_seed(0)
    first, taken = loader()
    batches = [next(first) for _ in range(10)]
    first.close()
    position = taken[7].before
    assert (position["pass"], position["position"], position["place"]) == (1, 1, 14)
    assert position["iterator"] is not None
    assert not torch.equal(batches[0], batches[6])   # pass 1's workers were seeded anew: other draws

    torch.manual_seed(123)   # the replay's generator is wherever its own run left it
    again, retaken = loader()
    again.restore(position, [])
    before = torch.get_rng_state()
    resumed = [next(again) for _ in range(3)]   # the rest of pass 1: batches 8, 9, 10 of the record's 12
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(a, b) for a, b in zip(resumed, batches[7:10], strict=True))
    assert [b.digests.tolist() for b in retaken] == [b.digests.tolist() for b in taken[7:10]]
    again.close()
