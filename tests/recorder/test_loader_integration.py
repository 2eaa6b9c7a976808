"""`loop.loader(dataloader)` with worker processes, and ranks that draw different batches: the loader's
workers fetch each batch from a seed of its place in the stream (a recording says so once when a fetch draws
random numbers), replays continue the stream with workers restarted in the middle of an epoch, and a rank
drawing an extra batch gets one line on every rank."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap

import torch
from torch.utils.data import DataLoader, RandomSampler

from replay.recorder import Loop
from replay.recorder.loader import WORKERS_DRAW
from replay.replayer.replays import ReplayRequest, prepare, replay_id
from replay.store import RunStore
from replay.store.lease import writing
from tests.conftest import REPO
from tests.recorder.test_loader import BATCH, Numbers, _parts, _train


def _workers(n: int) -> DataLoader:
    data = Numbers()
    return DataLoader(data, batch_size=BATCH, sampler=RandomSampler(data), num_workers=n,
                      prefetch_factor=3 if n else None, persistent_workers=n > 0)


def test_worker_processes_fetch_from_their_batchs_seed_say_so_once_and_replay_it(tmp_path, capfd):
    """The samples' augmentations are drawn in the workers from a seed of each batch's place in the stream,
    not from the workers' own generators: the recording says so in one line (2 workers, 4 epochs), and a
    replay from a checkpoint in the middle of an epoch, its workers started there, fetches the same bits."""
    torch.set_num_threads(1)
    model, optimizer = _parts()
    recorded = _train(Loop(tmp_path / "w2", model, optimizer, total_steps=8, checkpoint_every=3), model, optimizer,
                      _workers(2))
    assert not multiprocessing.active_children()   # the loop's close stopped the loader's workers
    assert capfd.readouterr().err.count(WORKERS_DRAW) == 1

    req = ReplayRequest(start=4, stop=7)   # from checkpoint 3, in the middle of an epoch: workers start there
    path = tmp_path / "w2" / "replays" / replay_id(req)
    with writing(path, "a test's replay") as lease:
        prepare(RunStore.open(tmp_path / "w2"), req)
        model, optimizer = _parts()
        replayed = _train(Loop(path, model, optimizer, total_steps=8, lease=lease.spec), model, optimizer, _workers(2))
    assert sorted(replayed) == [3, 4, 5, 6, 7] and all(replayed[s] == recorded[s] for s in replayed)
    assert WORKERS_DRAW not in capfd.readouterr().err   # a replay draws as its record did


SCRIPT = """
import os, sys
import torch, torch.distributed as dist
from replay.recorder import Loop

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(1, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
with Loop(sys.argv[1], model, optimizer, total_steps=4, checkpoint_every=2) as loop:
    for step in loop.steps():
        draws = 2 if step == 1 and dist.get_rank() == 1 else 1   # rank 1 trains on an extra batch at step 1
        for _ in range(draws):
            ids = loop.sample_ids(torch.randint(0, 100, (3,)))
            loss = model(ids.float().view(-1, 1) / 100).pow(2).mean()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loop.log(loss=loss)
"""


def test_ranks_that_draw_different_batches_get_one_line_on_every_rank(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(tmp_path / "run")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    line = ("step 1: the ranks drew different training batches (rank 0: 1 micro-batch(es), 3 samples, rank 1: 2 "
            "micro-batch(es), 6 samples)")
    assert done.stderr.count(line) == 2, done.stderr[-3000:]   # on both ranks, before any collective of the ids
    assert "Received data size doesn't match" not in done.stderr
    assert RunStore.open(tmp_path / "run").read_steps()["loss"].shape == (1,)   # step 0 recorded, nothing of step 1
