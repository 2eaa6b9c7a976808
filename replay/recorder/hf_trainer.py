"""A Hugging Face `transformers.Trainer` run, recorded and replayed: a callback over the loop API (loop.py).

    from replay.recorder.hf_trainer import TrainerRecorder

    recorder = TrainerRecorder("runs/hf", layout="hf-llama")
    trainer = Trainer(model, args, train_dataset=recorder.dataset(train_dataset), callbacks=[recorder])
    trainer.train()

`recorder.dataset(...)` wraps a map-style dataset so that every batch the Trainer fetches is noted by its
indices (the step's sample ids); in a replay it serves the recorded indices instead, from the start
checkpoint's step on. The callback drives a `Loop` from the Trainer's events:

- at the first `on_step_begin`, the loop starts: a recording writes checkpoint 0, a replay restores the
  parent's checkpoint at or before --from into the Trainer's model, optimizer and scheduler (and every
  RNG) and sets the Trainer's step to it; every later `on_step_begin` takes the previous step's
  checkpoint (on the cadence), so what ran after the step (evaluation, logging) is in it, as in the Loop;
- the per-step loss is the model's own loss of each micro-batch (a forward hook; their sum when the
  Trainer passes `num_items_in_batch`, as transformers 5 does for its causal-LM losses, else their mean),
  not the Trainer's logged average; the gradient norm is the one after the Trainer's clipping (read
  before the optimizer step);
- a replay ends the Trainer after --to (`should_training_stop`) and never writes the Trainer's own
  checkpoints (its `save_strategy` set to "no"): the store's checkpoints are the replay's. In a recording the Trainer's
  own checkpoints are the user's, written as their `TrainingArguments` say.

A step a replay skips (`--skip`, and the data bisect's probes) still runs, as the Trainer runs every step
it fetches, but without its update: its gradients are dropped before the optimizer step, and the
scheduler moves on as the Trainer steps it.

What a Trainer run cannot do that a loop of your own can (docs/your-loop.md): `--precision` (its autocast
is accelerate's), resuming a killed recording or
replay (the Trainer restarts its data from the beginning), fp16 (its loss scaler is inside accelerate),
dataloader worker processes (the indices are noted in this process), and epochs that end with a smaller
batch (use `dataloader_drop_last=True`).
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback
from transformers.trainer_utils import SaveStrategy

from replay.errors import ReplayError, UsageError
from replay.recorder.command import RESUME_ENV
from replay.recorder.loop import Loop


class RecordedDataset(torch.utils.data.Dataset):
    """A map-style dataset whose fetched indices are noted, batch by batch (or, in a replay, replaced by the
    recorded ones)."""

    def __init__(self, dataset, owner: TrainerRecorder):
        self.dataset, self.owner = dataset, owner

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):   # a read outside the DataLoader's batches (a length grouping): not noted
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> list:   # what the DataLoader calls for each batch
        indices = self.owner._fetched([int(i) for i in indices])
        return [self.dataset[i] for i in indices]


class TrainerRecorder(TrainerCallback):
    """Record a `transformers.Trainer` run into `store` (or replay it, started by `replay run`); the
    keyword arguments are the `Loop`'s (checkpoint_every, snapshot_every, snapshot_ring, spike, layout,
    description, n_head). The run's length is the Trainer's `max_steps`; its precision its `bf16`/`fp16`."""

    def __init__(self, store: str, **loop_options: Any):
        unknown = set(loop_options) - {"checkpoint_every", "snapshot_every", "snapshot_ring", "spike", "layout",
                                       "description", "n_head"}
        if unknown:
            raise UsageError(f"TrainerRecorder does not take {', '.join(sorted(unknown))}")
        self.store, self.options = store, loop_options
        self.loop: Loop | None = None
        self._dataset: RecordedDataset | None = None
        self._batches: deque[list[int]] = deque()   # indices of the batches fetched and not yet trained on
        self._serve: tuple[int, int] | None = None   # a replay: the (step, micro-batch) the next fetch gets
        self._steps = None
        self._losses: list[torch.Tensor] = []
        self._summed = False
        self._grad_norm = float("nan")
        self._hooks: list = []

    def dataset(self, dataset) -> RecordedDataset:
        """The training dataset, as the Trainer must see it (map-style: indexable, with a length)."""
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise UsageError("TrainerRecorder.dataset(...) takes a map-style dataset (with __getitem__ and __len__)")
        self._dataset = RecordedDataset(dataset, self)
        return self._dataset

    # -- the data ----------------------------------------------------------------------------------

    def _fetched(self, indices: list[int]) -> list[int]:
        if self._serve is not None and self.loop is not None and self.loop.window is not None:
            step, micro = self._serve
            if step <= self.loop.window.stop:   # past --to: the Trainer's prefetch, never trained on
                recorded = self.loop.recorded_ids(step)[self.loop.rank]
                if micro >= len(recorded) or len(recorded[micro]) != len(indices):
                    raise ReplayError(f"step {step}: the Trainer fetches batch {micro} of {len(indices)} samples, the "
                                      f"record has {len(recorded)} of {len(recorded[0])}: it does not run as recorded")
                indices = recorded[micro].tolist()
                self._serve = (step, micro + 1) if micro + 1 < len(recorded) else (step + 1, 0)
        self._batches.append(indices)
        return indices

    # -- the Trainer's events ----------------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if self._dataset is None:
            raise UsageError("TrainerRecorder: pass the training dataset through recorder.dataset(...) to the Trainer")
        if args.dataloader_num_workers:
            raise UsageError("TrainerRecorder notes the sample ids in the training process: set "
                             "dataloader_num_workers=0")
        batch = args.per_device_train_batch_size * args.world_size
        if not args.dataloader_drop_last and len(self._dataset) % batch:
            raise UsageError(f"the training set's {len(self._dataset)} samples do not split into batches of {batch}: "
                             "set dataloader_drop_last=True, so that every step has the same batch")
        batches, accumulate = len(self._dataset) // batch, args.gradient_accumulation_steps
        if batches % accumulate and state.max_steps > batches // accumulate:
            raise UsageError(f"an epoch's {batches} batches do not split into steps of {accumulate} "
                             "(gradient_accumulation_steps), and the run is longer than an epoch: every step must "
                             "train on as many micro-batches; change the dataset size or the accumulation")
        if args.fp16:
            raise UsageError("TrainerRecorder: fp16 training keeps its loss scaler inside accelerate, where a "
                             "checkpoint cannot reach it; train in bf16 or fp32")
        if state.global_step:
            raise UsageError("TrainerRecorder: trainer.train(resume_from_checkpoint=...) is not supported: the store's "
                             "run starts at step 0 (record a new run)")
        precision = "bf16" if args.bf16 else "fp32"
        self.loop = Loop(self.store, model, getattr(optimizer, "optimizer", optimizer), scheduler=lr_scheduler,
                         total_steps=state.max_steps, precision=precision, yield_skipped=True, **self.options)
        self._batches.clear()
        window = self.loop.window
        if window is not None:
            try:
                self._check_replay(self.loop)
            except BaseException:
                self.loop.close()
                raise
            args.save_strategy = SaveStrategy.NO   # the store's checkpoints are the replay's; the Trainer's stay
            self._serve = (window.start_checkpoint, 0)
        self._hooks = [model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
                       model.register_forward_hook(self._after_forward)]
        self._steps = self.loop.steps()

    @staticmethod
    def _check_replay(loop: Loop) -> None:
        if loop.store.manifest.config.precision != loop.precision:
            raise ReplayError("--precision: a Trainer run's autocast is accelerate's (TrainingArguments' bf16), "
                              "which a replay cannot change")
        if os.environ.get(RESUME_ENV) == "1":
            raise ReplayError("a Trainer run's replay cannot be resumed: discard it and run it again")

    def _before_forward(self, module, args, kwargs):
        if module.training:
            self._summed = kwargs.get("num_items_in_batch") is not None

    def _after_forward(self, module, args, output):
        loss = getattr(output, "loss", None) if not isinstance(output, dict) else output.get("loss")
        if module.training and loss is not None:
            self._losses.append(loss.detach().float())

    def on_step_begin(self, args, state, control, **kwargs):
        step = next(self._steps)   # the first: restores a replay's checkpoint; later ones: the last step's
        if state.global_step != step:
            state.global_step = step
        for _ in range(args.gradient_accumulation_steps):
            if not self._batches:
                raise ReplayError(f"step {step}: the Trainer trains on a batch that was not fetched through "
                                  "recorder.dataset(...)")
            ids = np.asarray(self._batches.popleft(), dtype=np.int64)
            if not self.loop.skipping:   # a skipped step's ids are the record's, noted by the loop
                self.loop.sample_ids(ids)
        self._losses = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.loop.skipping:   # the Trainer runs every step: this one's update is left out, its schedule moves on
            for p in model.parameters():
                p.grad = None
            return
        norms = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
        self._grad_norm = torch.linalg.vector_norm(torch.stack(norms)) if norms else float("nan")

    def on_step_end(self, args, state, control, **kwargs):
        if self.loop.skipping:
            self.loop.log_skipped()
        elif not self._losses:
            raise ReplayError(f"step {self.loop.step}: the model returned no loss in training (TrainerRecorder reads "
                              "the model output's `loss`)")
        else:
            losses = torch.stack(self._losses)
            loss = losses.sum() if self._summed else losses.mean()
            if self._summed and args.average_tokens_across_devices and args.world_size > 1:
                loss = loss * args.world_size   # each rank's share is of every rank's tokens, as the Trainer does
            self.loop.log(loss=loss, grad_norm=self._grad_norm)
        if self.loop.replaying and self.loop.step >= self.loop.window.stop:
            control.should_training_stop = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        try:   # the last step's checkpoint and, at the run's end, the store's completion
            if self._steps is not None and next(self._steps, None) is not None and self.loop.replaying:
                raise ReplayError("the Trainer stopped before the replay's last step")
        finally:
            for hook in self._hooks:
                hook.remove()
            if self.loop is not None:
                self.loop.close()
