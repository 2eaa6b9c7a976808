"""examples/lightning: a LightningModule around a Llama from a config, trained by Lightning's own `Trainer` (its
DDP strategy and DistributedSampler, its epoch loop and fetching, accumulation, clipping, a validation run at
each epoch's end) with `LightningRecorder` among its callbacks, recorded under torchrun (gloo, 2 ranks) and
replayed, resumed and changed by the product's commands. Every run is a real process; Lightning is the real
package."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from replay.errors import UsageError
from replay.store import RunStore
from tests.conftest import REPO, replay_cli
from tests.examples.conftest import assert_resumed_as_recorded, assert_same_run, kill_after_checkpoint, run_example
from tests.examples.planted import overwrite_with_noise

L = pytest.importorskip("lightning")

EXAMPLE = REPO / "examples" / "lightning" / "train.py"
PYTHON = (sys.executable,)
BLOCKS, BATCH, ACCUM, STEPS = 64, 4, 2, 12   # 32 blocks a rank: an epoch is 8 batches, 4 steps
SETTINGS = [f"--n_blocks={BLOCKS}", f"--batch_size={BATCH}", f"--accumulate_grad_batches={ACCUM}",
            f"--max_steps={STEPS}", "--checkpoint_every=3", "--num_workers=2", "--precision=bf16-mixed"]


@pytest.fixture(scope="module")
def recorded(token_file, tmp_path_factory):
    """12 steps on 2 ranks under torchrun, BF16 autocast by Lightning's precision plugin, two DataLoader workers a
    rank, 3 epochs of Lightning's DistributedSampler; checkpoints every 3 steps: 3 and 9 in the middle of an
    epoch, 6 in epoch 1's."""
    workdir = tmp_path_factory.mktemp("lightning")
    done = run_example(EXAMPLE, workdir, f"--data_dir={token_file.parent}", f"--store={workdir / 'run'}", *SETTINGS)
    assert done.returncode == 0, done.stderr
    return workdir / "run"


def test_each_rank_records_its_shard_of_every_epoch_under_lightnings_autocast(recorded):
    store = RunStore.open(recorded)
    assert store.manifest.status == "complete" and store.manifest.world_size == 2
    assert store.manifest.command.launcher == "torchrun"
    info = json.loads(replay_cli("info", str(recorded), "--json").stdout)
    assert info["environment"]["autocast"] == "bf16 on cpu", info["environment"]
    model = info["config"]["model"]
    assert (model["n_layer"], model["n_head"]) == (2, 4), model   # the Llama inside the LightningModule
    assert info["layout"]["q"] == "model.model.layers.{layer}.self_attn.q_proj.weight"   # under the module's prefix
    ids = store.read_steps(["sample_ids"])["sample_ids"]
    assert ids.shape == (STEPS, 2, ACCUM, BATCH)
    for epoch in range(3):   # 4 steps an epoch: the two ranks' shards together hold every block once
        assert np.array_equal(np.sort(ids[epoch * 4:(epoch + 1) * 4].ravel()), np.arange(BLOCKS)), epoch
    assert not np.array_equal(ids[0:4, 0], ids[4:8, 0])   # the sampler reshuffles each epoch


def test_replays_across_epochs_are_bit_for_bit_and_changes_diverge_at_from(recorded):
    """From checkpoint 3 (in the middle of epoch 0: its batches before the checkpoint passed over by the tap,
    Lightning's loops given their progress) over two epoch ends, to step 9: bit for bit at the level of the
    state. One layer's attention on emulated BF16 from step 4 reaches 4 heads and diverges at step 4; a
    precision a replay cannot give Lightning is refused in one line."""
    result = replay_cli("run", str(recorded), "--from", "4", "--to", "9", "--verify", "--json")
    assert result.returncode == 0, result.stderr
    verification = json.loads(result.stdout)["verification"]
    assert (verification["bitwise"], verification["level"], verification["steps"]) == (True, "state", [3, 9])
    changed = replay_cli("run", str(recorded), "--from", "4", "--to", "4", "--verify", "--json",
                         "--attention", "reference-emu:dtype=bf16", "--layers", "1")
    assert changed.returncode == 0, changed.stderr   # a change is expected to diverge
    report = json.loads(changed.stdout)
    assert report["verification"]["divergence"]["step"] == 4, report["verification"]
    reached = {(path["layer"], path["backend"]) for path in report["reached"]["path"]}
    assert reached == {(0, "sdpa"), (1, "reference-emu:dtype=bf16")}, report["reached"]
    assert report["reached"]["counters"] == [f"attention 1.{h} reference-emu:dtype=bf16" for h in range(4)]
    refused = replay_cli("run", str(recorded), "--from", "4", "--to", "4", "--precision", "fp32")
    assert refused.returncode == 2 and "a Lightning run's autocast is its precision plugin's" in refused.stderr
    assert "Traceback" not in refused.stderr, refused.stderr


def test_diff_of_a_step_traces_lightnings_own_step_without_changing_its_bits(recorded):
    """`replay diff` through the callback: step 4 replayed twice under Lightning's Trainer, DDP and BF16 precision
    plugin, rank 0's step traced by the loop; side A's replay is the record bit for bit (no note), and layer 1's
    attention on emulated BF16 is the first difference."""
    done = replay_cli("diff", str(recorded), "--step", "4", "--attention", "reference-emu:dtype=bf16", "--layers", "1",
                      "--json")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["notes"] == [] and (answer["first"]["where"], answer["first"]["what"]) == ("attention 1", "O")
    assert {(h["layer"], h["head"]) for h in answer["heads"] if h["o"] > 0} == {(1, h) for h in range(4)}


def test_a_killed_recording_resumes_to_the_uninterrupted_one(recorded, token_file, tmp_path):
    store = tmp_path / "cut"
    args = [f"--data_dir={token_file.parent}", f"--store={store}", *SETTINGS]
    last = kill_after_checkpoint(run_example(EXAMPLE, tmp_path, *args, popen=True), store, 6)
    assert 6 <= last < STEPS
    resumed = run_example(EXAMPLE, tmp_path, *args, "--resume=True")
    assert resumed.returncode == 0, resumed.stderr
    assert_resumed_as_recorded(store, recorded, resumed_from=last, checkpoint=STEPS)


def test_a_recording_trains_as_the_trainer_without_the_recorder_bit_for_bit(token_file, tmp_path):
    """One process, 3 epochs (validation at each end): with the recorder among the callbacks and without it,
    every batch's loss and the final weights are the same."""
    args = [f"--data_dir={token_file.parent}", *SETTINGS[:-2], "--n_blocks=32"]   # 32 blocks: epochs of 4 steps
    recorded = run_example(EXAMPLE, tmp_path, *args, f"--store={tmp_path / 'run'}", f"--out={tmp_path / 'rec.pt'}",
                           launcher=PYTHON)
    assert recorded.returncode == 0, recorded.stderr
    plain = run_example(EXAMPLE, tmp_path, *args, "--record=False", f"--out={tmp_path / 'plain.pt'}", launcher=PYTHON)
    assert plain.returncode == 0 and "replay" not in plain.stderr, plain.stderr
    assert_same_run(tmp_path / "rec.pt", tmp_path / "plain.pt", steps=STEPS * ACCUM)


def test_bisect_names_the_step_whose_blocks_were_overwritten_in_the_token_file(token_file, tmp_path):
    """One process: 24 steps of one epoch (400 blocks), recorded; then random bytes above 127 (never in Python
    source) over every block step 21 drew, recorded again (the sampler draws the same blocks): the detector
    flags step 21 and a data bisect, each probe a Trainer started again with that step's update left out, names
    that step's batches."""
    settings = [f"--data_dir={token_file.parent}", "--n_blocks=400", "--max_steps=24", "--checkpoint_every=4"]
    clean = run_example(EXAMPLE, tmp_path, *settings, f"--store={tmp_path / 'clean'}", launcher=PYTHON)
    assert clean.returncode == 0, clean.stderr
    blocks = RunStore.open(tmp_path / "clean").read_steps(["sample_ids"])["sample_ids"][21].ravel()
    poisoned = overwrite_with_noise(token_file.parent, blocks * 32, 32, into=tmp_path / "data")
    store = tmp_path / "spiked"
    done = run_example(EXAMPLE, tmp_path, *settings[1:], f"--data_dir={poisoned}", f"--store={store}",
                       launcher=PYTHON)
    assert done.returncode == 0, done.stderr
    assert [e["step"] for e in RunStore.open(store).spikes] == [21]
    result = replay_cli("bisect", str(store), "--by", "data", "--json")
    assert result.returncode == 0, result.stderr
    verdict = json.loads(result.stdout)["verdict"]
    assert verdict["batches"] == [21], verdict


def test_a_run_the_recorder_cannot_replay_is_refused_before_a_store_is_made(tmp_path):
    """In this process, a real Trainer: without max_steps (a replay needs the run's length), with max_epochs
    beside it (which could end the run early), with a ckpt_path of Lightning's own (the store's run resumes from
    the store), and over an IterableDataset (refused once the loader is prepared, before the loop makes the
    store)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from replay.recorder.lightning import LightningRecorder

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(torch.randn(8, 4).unbind())

    data = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)
    quiet = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False,
             "enable_progress_bar": False, "enable_model_summary": False}
    own = L.Trainer(max_steps=1, **quiet)   # a checkpoint of Lightning's own, as a user would resume from
    own.fit(Tiny(), train_dataloaders=data)
    own.save_checkpoint(tmp_path / "own.ckpt")
    hook = sys.excepthook
    try:
        stream = DataLoader(Stream(), batch_size=4)
        for kwargs, fit, said in (({"max_epochs": 1}, {}, "set Trainer(max_steps=...)"),
                                  ({"max_steps": 2, "max_epochs": 3}, {}, "as max_steps only"),
                                  ({"max_steps": 2}, {"ckpt_path": str(tmp_path / "own.ckpt")}, "resume=True"),
                                  ({"max_steps": 2}, {"train_dataloaders": stream}, "over an IterableDataset")):
            trainer = L.Trainer(callbacks=[LightningRecorder(tmp_path / "run")], **quiet, **kwargs)
            with pytest.raises(UsageError, match=said.replace("(", r"\(").replace(")", r"\)")):
                trainer.fit(Tiny(), **{"train_dataloaders": data, **fit})
    finally:
        sys.excepthook = hook
    assert not (tmp_path / "run").exists()
