"""examples/accelerate: run_clm_no_trainer's shape (a Llama from a config, `accelerator.prepare` of the model, the
optimizer, the DataLoader and the scheduler, `accumulate` and `backward` as written), recorded by `accelerate
launch` and under torchrun (gloo, 2 ranks: accelerate's MULTI_CPU) and replayed, resumed and changed by the
product's commands. Every run is a real process; accelerate is the real package."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import google_crc32c
import numpy as np
import pytest

from replay.launch.script import ScriptServer
from replay.replayer.replays import ReplayRequest, run
from replay.store import RunStore
from replay.store.overrides import Overrides
from tests.conftest import REPO, replay_cli
from tests.examples.conftest import (
    TORCHRUN,
    assert_resumed_as_recorded,
    assert_same_run,
    kill_after_checkpoint,
    run_example,
)
from tests.examples.planted import overwrite_with_noise

pytest.importorskip("accelerate")

EXAMPLE = REPO / "examples" / "accelerate" / "train.py"
PYTHON = (sys.executable,)
BLOCKS, BATCH, ACCUM, STEPS = 64, 4, 2, 12   # 32 blocks a rank: an epoch is 8 batches, 4 steps
SETTINGS = [f"--n_blocks={BLOCKS}", f"--per_device_train_batch_size={BATCH}",
            f"--gradient_accumulation_steps={ACCUM}", f"--max_train_steps={STEPS}", "--checkpoint_every=3"]
BF16 = "--mixed_precision=bf16"   # the script's own setting (the recording's comes from `accelerate launch`)
# accelerate's own launcher, 2 processes on this CPU (its multi-GPU launcher is torchrun's agent, gloo without CUDA)
ACCELERATE_LAUNCH = (str(Path(sys.executable).parent / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
                     "--num_machines", "1", "--mixed_precision", "bf16", "--dynamo_backend", "no")


def _torchrun(workdir: Path, *args: str, popen: bool = False, launcher: tuple[str, ...] = TORCHRUN):
    return run_example(EXAMPLE, workdir, *args, popen=popen, launcher=launcher)


@pytest.fixture(scope="module")
def recorded(token_file, tmp_path_factory) -> Path:
    """12 steps on 2 ranks started by `accelerate launch`, under the BF16 mixed precision it configures, 3 epochs
    of accelerate's default sampler (a generator it synchronises across the ranks), checkpoints every 3 steps: at
    3 and 9 in the middle of an epoch, at 6 in epoch 1's."""
    workdir = tmp_path_factory.mktemp("accelerate")
    done = _torchrun(workdir, f"--data_dir={token_file.parent}", f"--store={workdir / 'run'}", *SETTINGS,
                     launcher=ACCELERATE_LAUNCH)
    assert done.returncode == 0, done.stderr
    return workdir / "run"


def test_each_rank_records_its_shard_of_every_epoch_and_accelerates_autocast(recorded):
    store = RunStore.open(recorded)
    assert store.manifest.status == "complete" and store.manifest.world_size == 2
    assert store.manifest.command.launcher == "torchrun"   # what `accelerate launch` runs the ranks under
    assert store.manifest.command.env["ACCELERATE_MIXED_PRECISION"] == "bf16"   # set again for every replay
    info = json.loads(replay_cli("info", str(recorded), "--json").stdout)
    assert info["environment"]["autocast"] == "bf16 on cpu", info["environment"]   # inside DDP, around forward
    ids = store.read_steps(["sample_ids"])["sample_ids"]
    assert ids.shape == (STEPS, 2, ACCUM, BATCH)
    epochs = [np.sort(ids[e * 4:(e + 1) * 4].ravel()) for e in range(3)]   # both ranks, 4 steps
    assert all(np.array_equal(e, np.arange(BLOCKS)) for e in epochs)      # each block once an epoch
    orders = [ids[e * 4:(e + 1) * 4, 0].ravel() for e in range(3)]
    assert not np.array_equal(orders[0], orders[1]) and not np.array_equal(orders[1], orders[2])   # reshuffled


def test_replays_from_each_epoch_are_bit_for_bit_and_a_halved_rate_diverges_at_from(recorded, tmp_path):
    """A fresh start from checkpoint 6 (epoch 1: its order comes from the sampler's generator as the epoch
    began, not as the script starts), then, on the script's ranks kept up, windows from the checkpoints in
    epochs 0 and 2 and a halved learning rate from step 4, whose first step already differs."""
    fresh = replay_cli("run", str(recorded), "--from", "7", "--to", "8", "--verify")
    assert fresh.returncode == 0, fresh.stderr
    assert "verify: every replayed step equals the record bit for bit" in fresh.stdout, fresh.stdout
    requests = [ReplayRequest(3, 5), ReplayRequest(9, 11), ReplayRequest(4, 5, overrides=Overrides(lr_scale=0.5))]
    with ScriptServer(RunStore.open(recorded).manifest.command) as server:
        results = [run(recorded, req, ranks=server) for req in requests]
        assert server.refused is None
    assert [(r.verification.bitwise, r.verification.level) for r in results[:2]] == [(True, "state")] * 2
    changed = results[2].verification
    assert not changed.bitwise and changed.divergence is not None and changed.divergence.step == 4


def test_a_stream_accelerate_dispatches_is_recorded_by_place_and_digest_and_replays_bit_for_bit(token_file, tmp_path):
    """run_clm's --streaming: the blocks as an IterableDataset, which accelerate prepares as a DataLoaderDispatcher
    (rank 0 reads the batches of both ranks and sends each its slice): each rank's samples by their place in its
    stream and their digests, each block once an epoch over both ranks; a replay from checkpoint 6 (in epoch 1,
    which accelerate's loader numbers itself) over the end of it, the stream drawn again through the dispatcher,
    bit for bit."""
    store = tmp_path / "streamed"
    done = _torchrun(tmp_path, f"--data_dir={token_file.parent}", f"--store={store}", *SETTINGS, "--streaming=True")
    assert done.returncode == 0, done.stderr
    steps = RunStore.open(store).read_steps(["sample_ids", "sample_digest"])
    assert np.array_equal(steps["sample_ids"][:, 1].reshape(STEPS, -1), np.arange(STEPS * 8).reshape(STEPS, 8))
    tokens = np.fromfile(token_file, dtype=np.uint16)[:BLOCKS * 32].astype(np.int64).reshape(BLOCKS, 32)
    per_field = [google_crc32c.value(block.tobytes()) for block in tokens]   # input_ids, and labels the same
    blocks = Counter(google_crc32c.value(np.array([c, c], dtype=np.uint32).tobytes()) for c in per_field)
    for epoch in range(3):   # 4 steps an epoch
        assert Counter(steps["sample_digest"][epoch * 4:(epoch + 1) * 4].ravel().tolist()) == blocks, epoch
    result = replay_cli("run", str(store), "--from", "7", "--to", "9", "--verify", "--json")
    assert result.returncode == 0, result.stderr
    v = json.loads(result.stdout)["verification"]
    assert (v["steps"], v["bitwise"], v["level"]) == ([6, 9], True, "state")


def test_a_killed_recording_resumes_to_the_uninterrupted_one(recorded, token_file, tmp_path):
    """Under torchrun, BF16 by the script's own setting: killed after checkpoint 6 and resumed, the run is the one
    `accelerate launch` recorded, bit for bit."""
    store = tmp_path / "cut"
    args = [f"--data_dir={token_file.parent}", f"--store={store}", *SETTINGS, BF16]
    last = kill_after_checkpoint(_torchrun(tmp_path, *args, popen=True), store, 6)
    assert 6 <= last < STEPS
    resumed = _torchrun(tmp_path, *args, "--resume=True")
    assert resumed.returncode == 0, resumed.stderr
    assert_resumed_as_recorded(store, recorded, resumed_from=last, checkpoint=STEPS)


def test_a_recording_trains_as_the_script_without_replay_bit_for_bit(token_file, tmp_path):
    """One process, 3 epochs of the prepared loader: with its replay lines and without them (--record=False,
    run_clm's loop over the prepared loader, epoch after epoch), every step's loss and the final weights are the
    same."""
    args = [f"--data_dir={token_file.parent}", *SETTINGS, "--n_blocks=32"]   # fp32; 32 blocks: epochs of 4 steps
    recorded = _torchrun(tmp_path, *args, f"--store={tmp_path / 'run'}", f"--out={tmp_path / 'recorded.pt'}",
                         launcher=PYTHON)
    assert recorded.returncode == 0, recorded.stderr
    plain = _torchrun(tmp_path, *args, "--record=False", f"--out={tmp_path / 'plain.pt'}", launcher=PYTHON)
    assert plain.returncode == 0 and "replay" not in plain.stderr, plain.stderr
    assert_same_run(tmp_path / "recorded.pt", tmp_path / "plain.pt", steps=STEPS)


def test_bisect_names_the_step_whose_blocks_were_overwritten_in_the_token_file(token_file, tmp_path):
    """One process (the bisect's subject is the data, not the ranks): 48 steps in one epoch (800 blocks),
    recorded; then random bytes above 127 (never in Python source) over every block step 45 drew, recorded
    again (the sampler draws the same blocks): the recording's detector flags step 45, and a data bisect names
    that step's batches."""
    settings = ["--n_blocks=800", "--max_train_steps=48", "--checkpoint_every=4"]
    clean = _torchrun(tmp_path, f"--data_dir={token_file.parent}", f"--store={tmp_path / 'clean'}", *settings,
                      launcher=PYTHON)
    assert clean.returncode == 0, clean.stderr
    blocks = RunStore.open(tmp_path / "clean").read_steps(["sample_ids"])["sample_ids"][45].ravel()
    poisoned = overwrite_with_noise(token_file.parent, blocks * 32, 32, into=tmp_path / "data")
    store = tmp_path / "spiked"
    done = _torchrun(tmp_path, f"--data_dir={poisoned}", f"--store={store}", *settings, launcher=PYTHON)
    assert done.returncode == 0, done.stderr
    assert [e["step"] for e in RunStore.open(store).spikes] == [45]
    result = replay_cli("bisect", str(store), "--by", "data", "--json")
    assert result.returncode == 0, result.stderr
    verdict = json.loads(result.stdout)["verdict"]
    assert verdict["batches"] == [45] and verdict["data_window"] == [44, 45]
