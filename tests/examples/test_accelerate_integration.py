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
import torch

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


DISPATCH = "--dispatch_batches=True"   # accelerate's DataLoaderDispatcher: rank 0 samples and fetches for both


@pytest.fixture(scope="module")
def dispatched(token_file, tmp_path_factory) -> Path:
    """The run of `recorded` (fp32) under torchrun with `dispatch_batches=True`: rank 0's DataLoader samples two
    batches a micro-step over all 64 blocks and accelerate sends rank 1 the second; rank 0 saves the loss of
    its last micro-batch of every step (`--out`)."""
    workdir = tmp_path_factory.mktemp("dispatched")
    done = _torchrun(workdir, f"--data_dir={token_file.parent}", f"--store={workdir / 'run'}", *SETTINGS, DISPATCH,
                     f"--out={workdir / 'out.pt'}")
    assert done.returncode == 0, done.stderr
    return workdir / "run"


def test_a_dispatcher_records_the_slice_each_rank_trained_on(dispatched, token_file):
    """Each epoch (4 steps) covers every block once over both ranks, reshuffled; and what a rank recorded is what
    it trained on: the loss of the blocks recorded for each rank's last micro-batch of step 6, computed here
    from checkpoint 6's weights, is for rank 0 the loss rank 0 saw (and not rank 1's), and their mean the loss
    the step log holds."""
    from transformers import LlamaConfig, LlamaForCausalLM

    store = RunStore.open(dispatched)
    steps = store.read_steps(["sample_ids", "loss"])
    ids = steps["sample_ids"]
    assert ids.shape == (STEPS, 2, ACCUM, BATCH)
    epochs = [ids[e * 4:(e + 1) * 4] for e in range(3)]
    assert all(np.array_equal(np.sort(e.ravel()), np.arange(BLOCKS)) for e in epochs)
    assert not np.array_equal(epochs[0], epochs[1])
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                         attn_implementation="sdpa"))   # the example's
    weights = store.read_shard(6, 0)["state"]["replicated"]["model"]
    model.load_state_dict({k.removeprefix("module."): v for k, v in weights.items()})
    tokens = torch.from_numpy(np.fromfile(token_file, dtype=np.uint16)[:BLOCKS * 32].astype(np.int64)).view(BLOCKS, 32)
    with torch.no_grad():
        losses = [model(input_ids=tokens[ids[6, r, -1]], labels=tokens[ids[6, r, -1]]).loss.item() for r in (0, 1)]
    seen = torch.load(dispatched.parent / "out.pt", weights_only=True)["losses"][6]   # rank 0's
    assert np.isclose(losses[0], seen, rtol=1e-5, atol=0) and not np.isclose(losses[1], seen, rtol=1e-3, atol=0)
    assert np.isclose(np.mean(losses), steps["loss"][6], rtol=1e-5, atol=0)


def test_a_dispatched_run_replays_bit_for_bit_skips_steps_and_a_halved_rate_diverges_at_from(dispatched):
    """A fresh start from checkpoint 6 over epoch 1's end; on the script's ranks kept up, a window from
    checkpoint 3, a halved learning rate from step 4 (its first step differs), and a window that skips step 5's
    batches (drawn through the dispatcher on both ranks and dropped: the steps after it train on the record's)."""
    fresh = replay_cli("run", str(dispatched), "--from", "7", "--to", "9", "--verify")
    assert fresh.returncode == 0, fresh.stderr
    assert "verify: every replayed step equals the record bit for bit" in fresh.stdout, fresh.stdout
    requests = [ReplayRequest(3, 5), ReplayRequest(4, 5, overrides=Overrides(lr_scale=0.5)),
                ReplayRequest(4, 8, overrides=Overrides(skip=[5]))]
    with ScriptServer(RunStore.open(dispatched).manifest.command) as server:
        results = [run(dispatched, req, ranks=server) for req in requests]
        assert server.refused is None
    assert (results[0].verification.bitwise, results[0].verification.level) == (True, "state")
    changed = results[1].verification
    assert not changed.bitwise and changed.divergence is not None and changed.divergence.step == 4
    skipped = RunStore.open(results[2].location)
    assert skipped.manifest.status == "complete"
    recorded_ids = RunStore.open(dispatched).read_steps(["sample_ids"])["sample_ids"]
    assert np.array_equal(skipped.read_steps(["sample_ids"], start=6, stop=9)["sample_ids"], recorded_ids[6:9])


@pytest.mark.parametrize("setting", [BF16, DISPATCH])
def test_a_killed_recording_resumes_to_the_uninterrupted_one(setting, token_file, tmp_path, request):
    """Under torchrun, killed after checkpoint 6 and resumed, the run is the uninterrupted one bit for bit: BF16 by
    the script's own setting (the one `accelerate launch` recorded), and through the dispatcher (`dispatched`)."""
    uninterrupted = request.getfixturevalue("recorded" if setting == BF16 else "dispatched")
    store = tmp_path / "cut"
    args = [f"--data_dir={token_file.parent}", f"--store={store}", *SETTINGS, setting]
    last = kill_after_checkpoint(_torchrun(tmp_path, *args, popen=True), store, 6)
    assert 6 <= last < STEPS
    resumed = _torchrun(tmp_path, *args, "--resume=True")
    assert resumed.returncode == 0, resumed.stderr
    assert_resumed_as_recorded(store, uninterrupted, resumed_from=last, checkpoint=STEPS)


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
