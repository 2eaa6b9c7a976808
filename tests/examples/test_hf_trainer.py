"""TrainerRecorder in this process: misuse fails in one line before anything trains (the Trainer stops at
its first event), a Trainer built with the recorder among its callbacks records and resumes as
recorder.train does, a run's precision and loss scaler are the Trainer's, an fp16 run on a GPU resumes
with accelerate's loss scaler as it was, and a collate that draws random numbers draws what it would without
replay, a resumed run too. The example's runs recorded, killed, resumed and replayed:
test_hf_trainer_integration.py."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from replay.errors import UsageError
from replay.store import RunStore
from tests.conftest import tree_snapshot
from tests.examples.conftest import assert_resumed_as_recorded


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = (torch.arange(8) + i) % 16
        return {"input_ids": x, "labels": x}


def _masking(samples):
    """A collate that draws: each label left out (-100) with probability 1/4, drawn from torch's generator."""
    x = torch.stack([s["input_ids"] for s in samples])
    return {"input_ids": x, "labels": x.masked_fill(torch.rand(x.shape) < 0.25, -100)}


def _trainer(tmp_path, callbacks=(), collate=None, dropout=0.0, **args):
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, attention_dropout=dropout)
    options = {"max_steps": 4, "per_device_train_batch_size": 4, "report_to": "none", "use_cpu": True,
               "save_strategy": "no", "seed": 0, **args}
    return Trainer(model=AutoModelForCausalLM.from_config(config), args=TrainingArguments(
        output_dir=str(tmp_path / "out"), **options), train_dataset=_Tokens(10), data_collator=collate,
        callbacks=list(callbacks))


def _stop_after(step: int):
    """A callback that ends the Trainer's run after `step`."""
    from transformers import TrainerCallback

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == step

    return Stop()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """4 steps over 10 samples (batches of 4, 4, 2), checkpoints 0, 2, 4."""
    from replay.recorder.hf_trainer import TrainerRecorder

    tmp = tmp_path_factory.mktemp("recorded")
    TrainerRecorder(str(tmp / "run"), checkpoint_every=2).train(_trainer(tmp))
    return tmp / "run"


def test_a_recording_through_recorder_train_adds_the_callback_and_keeps_a_partial_batch(recorded):
    store = RunStore.open(recorded)
    assert store.manifest.status == "complete" and store.manifest.config.precision == "fp32"
    assert [c.step for c in store.checkpoints()] == [0, 2, 4]
    ids = store.read_steps(["sample_ids"])["sample_ids"][:, 0, 0]
    assert sorted(ids[:3][ids[:3] >= 0].tolist()) == list(range(10)) and (ids[2] >= 0).sum() == 2


@pytest.mark.parametrize("started_by", ["trainer.train", "recorder.train"])
def test_a_trainer_built_with_the_recorder_records_and_resumes_as_recorder_train_does(recorded, tmp_path, started_by):
    """Trainer(callbacks=[recorder]) and trainer.train(): stopped after step 2 and resumed there (the middle of an
    epoch: the Trainer's own resume, reached through its train), the steps and the last weights are those
    recorder.train recorded, bit for bit; recorder.train on such a Trainer resumes it once, as trainer.train."""
    from replay.recorder.hf_trainer import TrainerRecorder

    recorder = TrainerRecorder(str(tmp_path / "run"), checkpoint_every=2)
    _trainer(tmp_path, callbacks=[recorder, _stop_after(2)]).train()
    assert RunStore.open(tmp_path / "run").manifest.status == "running"
    recorder = TrainerRecorder(str(tmp_path / "run"), checkpoint_every=2, resume=True)
    trainer = _trainer(tmp_path, callbacks=[recorder])
    trainer.train() if started_by == "trainer.train" else recorder.train(trainer)
    assert_resumed_as_recorded(tmp_path / "run", recorded, resumed_from=2, checkpoint=4)


@pytest.mark.parametrize("how, message", [
    ("added", r"a Trainer given the recorder after it was built \(trainer.add_callback\) and started by its own "
              r"train\(\) could not be started past step 0 by a replay: build the Trainer with callbacks=\[recorder\] "
              r"or start it with recorder.train\(trainer\)"),
    ("ignore_data_skip", "leave ignore_data_skip=False"),
    ("resume_from_checkpoint", r"resumes from the store: TrainerRecorder\(store, resume=True\)"),
])
def test_a_resume_the_trainer_cannot_reach_is_one_error_and_leaves_the_store_as_it_was(recorded, tmp_path, how,
                                                                                         message, monkeypatch):
    from replay.recorder.hf_trainer import TrainerRecorder

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)   # a refusal makes the uncaught error one line
    before = tree_snapshot(recorded)
    recorder = TrainerRecorder(str(recorded), resume=True)
    trainer = _trainer(tmp_path, ignore_data_skip=how == "ignore_data_skip")
    with pytest.raises(UsageError, match=message):
        if how == "added":
            trainer.add_callback(recorder)
            trainer.train()
        else:
            recorder.train(trainer, **({"resume_from_checkpoint": "elsewhere"} if how != "ignore_data_skip" else {}))
    assert tree_snapshot(recorded) == before


def test_an_unknown_option_is_refused():
    from replay.recorder.hf_trainer import TrainerRecorder

    with pytest.raises(UsageError, match="TrainerRecorder does not take every"):
        TrainerRecorder("run", every=3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (accelerate's fp16 loss scaler)"))])
def test_an_fp16_run_keeps_accelerates_loss_scaler_and_resumes_bit_for_bit(tmp_path, device):
    """Stopped after step 1 (its checkpoint, 2, written) and resumed: the weights and the loss scaler's state
    at checkpoint 4 are the uninterrupted run's (on a CPU accelerate keeps no scaler: nothing to keep)."""
    from replay.recorder.hf_trainer import TrainerRecorder

    gpu = {"use_cpu": device == "cpu", "fp16": True}
    TrainerRecorder(str(tmp_path / "whole"), checkpoint_every=2).train(_trainer(tmp_path, **gpu))
    stopped = _trainer(tmp_path, callbacks=[_stop_after(2)], **gpu)
    TrainerRecorder(str(tmp_path / "cut"), checkpoint_every=2).train(stopped)
    assert RunStore.open(tmp_path / "cut").manifest.status == "running"
    TrainerRecorder(str(tmp_path / "cut"), checkpoint_every=2, resume=True).train(_trainer(tmp_path, **gpu))
    whole, cut = (RunStore.open(tmp_path / name).read_shard(4, 0)["state"]["replicated"] for name in ("whole", "cut"))
    assert RunStore.open(tmp_path / "whole").manifest.config.precision == "fp16"
    if device == "cuda":
        assert whole["scaler"] == cut["scaler"] and whole["scaler"]["scale"] > 0
    else:
        assert "scaler" not in whole
    assert all(torch.equal(whole["model"][k], cut["model"][k]) for k in whole["model"])


def test_a_collate_that_draws_draws_as_without_replay_and_a_resumed_run_as_the_uninterrupted_one(tmp_path):
    """No worker processes: the collate's masks and the attention's dropout are drawn from the global
    generators as `trainer.train()` alone draws them (every step's logged loss and the final weights, bit for
    bit). Stopped after step 2, in the middle of the first epoch (batches of 4, 4, 2) whose next batches the
    Trainer had fetched, masks drawn, before checkpoint 2, and resumed: the uninterrupted run's steps."""
    from transformers import TrainerCallback

    from replay.recorder.hf_trainer import TrainerRecorder

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 2

    run = {"collate": _masking, "dropout": 0.1, "logging_steps": 1}
    plain = _trainer(tmp_path, **run)
    plain.train()
    whole = _trainer(tmp_path, **run)
    TrainerRecorder(str(tmp_path / "whole"), checkpoint_every=2).train(whole)
    losses = [[e["loss"] for e in t.state.log_history if "loss" in e] for t in (plain, whole)]
    assert len(losses[0]) == 4 and losses[0] == losses[1]
    assert all(torch.equal(v, whole.model.state_dict()[k]) for k, v in plain.model.state_dict().items())

    TrainerRecorder(str(tmp_path / "cut"), checkpoint_every=2).train(_trainer(tmp_path, [Stop()], **run))
    TrainerRecorder(str(tmp_path / "cut"), checkpoint_every=2, resume=True).train(_trainer(tmp_path, **run))
    a, b = (RunStore.open(tmp_path / name) for name in ("whole", "cut"))
    assert [r.from_step for r in b.manifest.resumes] == [2]
    assert all(np.array_equal(a.read_steps([f])[f], b.read_steps([f])[f]) for f in ("sample_ids", "loss", "grad_norm"))
    final_a, final_b = (s.read_shard(4, 0)["state"]["replicated"]["model"] for s in (a, b))
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)
