"""A `Loop` builds nothing process-wide when it is made: its process-wide effects (the excepthook, torch's
determinism settings and threads, the exit hook, the store) all happen in `Loop.start`, at its first use."""

from __future__ import annotations

import sys

import torch

from replay.recorder import Loop


def test_making_a_loop_changes_nothing_and_its_first_use_starts_it(tmp_path):
    deterministic, threads, hook = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads(), sys.excepthook
    torch.use_deterministic_algorithms(False)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        loop = Loop(tmp_path / "run", model, optimizer, total_steps=2)
        assert not (tmp_path / "run").exists()
        assert not torch.are_deterministic_algorithms_enabled() and sys.excepthook is hook
        with loop:   # its first use
            assert (tmp_path / "run" / "zarr.json").exists()
            assert torch.are_deterministic_algorithms_enabled()   # the recording's setting (recorder/environment.py)
            for step in loop.steps():
                loop.sample_ids([step])
                loop.log(loss=float(model(torch.ones(1, 4)).sum().detach()))
        assert loop.store.manifest.status == "complete"
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(threads)
