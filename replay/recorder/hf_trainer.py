"""A Hugging Face `transformers.Trainer` run, recorded and replayed: a callback over the loop API (loop.py).

    from replay.recorder.hf_trainer import TrainerRecorder

    recorder = TrainerRecorder("runs/hf", layout="hf-llama")
    trainer = Trainer(model, args, train_dataset=train_dataset)
    recorder.train(trainer)                 # instead of trainer.train(): adds the callback, starts or resumes

    trainer = Trainer(model, args, train_dataset=train_dataset, callbacks=[recorder])
    trainer.train()                         # the same: this Trainer's train() goes through recorder.train

The Trainer's training DataLoader is the loop's (`loop.loader`, recorder/loader.py, driven by the Trainer):
its batch sampler is tapped, so each batch is noted by its dataset indices where it is sampled (worker
processes, prefetch and persistent workers included), and each training forward of the model takes the
next one: the step's sample ids. A checkpoint keeps where the data stream stands; a replay checks that the
sampler yields the recorded indices. The callback drives a `Loop` from the Trainer's events:

- at the first `on_step_begin`, the loop starts: a recording writes checkpoint 0, a resumed recording or a
  replay restores its checkpoint (a replay's: the parent's at or before --from) into the Trainer's model,
  optimizer, scheduler and loss scaler (fp16: accelerate's) and every RNG; every later `on_step_begin`
  takes the previous step's checkpoint (on the cadence), so what ran after the step (evaluation, logging)
  is in it, as in the Loop;
- the per-step loss is the model's own loss of each micro-batch (a forward hook; their sum when the
  Trainer passes `num_items_in_batch`, as transformers 5 does for its causal-LM losses, else their mean),
  not the Trainer's logged average; the gradient norm is the one after the Trainer's clipping (read
  before the optimizer step);
- a replay ends the Trainer after --to (`should_training_stop`) and never writes the Trainer's own
  checkpoints (its `save_strategy` set to "no"): the store's checkpoints are the replay's. In a recording the Trainer's
  own checkpoints are the user's, written as their `TrainingArguments` say.

A run that starts at a step S > 0 (a resumed recording, a replay from a later checkpoint) must find the
Trainer at S's place in its epoch (its batch count within the epoch, a last step's fewer micro-batches),
which only the Trainer's own resume reaches: `recorder.train` hands it a checkpoint of its own format
holding nothing but the step and the model's current weights (a temporary directory, deleted after), so
the Trainer skips to S itself and loads no optimizer, scheduler or RNG state; the loop then restores the
store's checkpoint at S over all of it. A Trainer built with the recorder among its `callbacks` gets there
too: at the end of its `__init__` (`on_init_end`; the event is given no Trainer, so it is that `__init__`'s
`self`) its `train` becomes an attribute of that instance calling `recorder.train` on its own `train`. A Trainer the
recorder was added to later (`trainer.add_callback`) and then started by its `train()` could not be
started past step 0 by a replay: its recording is refused as it starts, before the store is made.

A step a replay skips (`--skip`, and the data bisect's probes) still runs, as the Trainer runs every step
it fetches, but without its update: its gradients are dropped before the optimizer step, and the
scheduler moves on as the Trainer steps it.

What a Trainer run cannot do that a loop of your own can (docs/your-loop.md): `--precision` (its autocast
is accelerate's), resuming a replay, `ignore_data_skip=True` for a run that starts past step 0, and an
iterable training dataset (no sampler to tap).
"""

from __future__ import annotations

import inspect
import os
import sys
import tempfile
from types import FrameType
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainerState
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import SaveStrategy
from transformers.utils import WEIGHTS_NAME

from replay.errors import ReplayError, UsageError
from replay.recorder.command import RESUME_ENV, STORE_ENV
from replay.recorder.loader import RecordedLoader
from replay.recorder.loop import Loop
from replay.recorder.modes import refuse
from replay.recorder.state import unwrap
from replay.store import RunStore
from replay.store.location import Location, Where


class TrainerRecorder(TrainerCallback):
    """Record a `transformers.Trainer` run into `store` (or replay it, started by `replay run`); the
    keyword arguments are the `Loop`'s (checkpoint_every, snapshot_every, snapshot_ring, spike, layout,
    description, n_head, resume). The run's length is the Trainer's `max_steps`; its precision its
    `bf16`/`fp16`. Start the Trainer with `recorder.train(trainer)`, or build it with `callbacks=[recorder]`
    and start it with `trainer.train()`."""

    def __init__(self, store: Where, **loop_options: Any):
        unknown = set(loop_options) - {"checkpoint_every", "snapshot_every", "snapshot_ring", "spike", "layout",
                                       "description", "n_head", "resume"}
        if unknown:
            raise UsageError(f"TrainerRecorder does not take {', '.join(sorted(unknown))}")
        self.store, self.options = Location.parse(store), loop_options
        self.loop: Loop | None = None
        self._batches: RecordedLoader | None = None
        self._steps = None
        self._losses: list[torch.Tensor] = []
        self._summed = False
        self._grad_norm: Any = float("nan")
        self._hooks: list = []
        self._started = False   # by self.train, which can start the Trainer past step 0

    def train(self, trainer: Any, **train_kwargs: Any) -> Any:
        """`trainer.train(**train_kwargs)`, recorded: a new recording from step 0; a resumed one (resume=True)
        or a replay from where its checkpoint stands, through the Trainer's own resume (the module's
        docstring). Adds this callback to the Trainer when it is not among its callbacks."""
        if train_kwargs.get("resume_from_checkpoint"):
            raise UsageError("TrainerRecorder: train(resume_from_checkpoint=...): the store's run resumes from the "
                             "store: TrainerRecorder(store, resume=True)")
        train_kwargs.pop("resume_from_checkpoint", None)
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        run = trainer.train.own if isinstance(trainer.train, _Routed) else trainer.train
        start = self._start_step()
        if start and trainer.args.ignore_data_skip:
            raise UsageError("TrainerRecorder: a run that starts at a later step needs the Trainer to skip its "
                             "epoch's trained batches: leave ignore_data_skip=False")
        self._started = True
        try:
            if start == 0:
                return run(**train_kwargs)
            with tempfile.TemporaryDirectory(prefix="replay-trainer-") as where:
                _trainer_checkpoint(trainer, start, where)
                return run(resume_from_checkpoint=where, **train_kwargs)
        finally:
            self._started = False

    @staticmethod
    def dataset(dataset: Any) -> Any:
        """The training dataset, unchanged: scripts written for an earlier `replay` passed it through here; the
        Trainer's DataLoader is what is recorded now."""
        return dataset

    def _start_step(self) -> int:
        """The step the run's first `on_step_begin` restores: a replay's start checkpoint, a resumed
        recording's last committed one, else 0."""
        replay_store = os.environ.get(STORE_ENV)
        if replay_store:
            store = RunStore.open(replay_store)
            if os.environ.get(RESUME_ENV) == "1":
                committed = store.checkpoints()
                if committed:
                    return committed[-1].step
            spec = store.manifest.replay
            assert spec is not None, "a replay's store has its spec"
            return spec.start_checkpoint
        if not self.options.get("resume") or not (self.store / "zarr.json").exists():
            return 0
        committed = RunStore.open(self.store).checkpoints()
        return committed[-1].step if committed else 0

    # -- the Trainer's events ----------------------------------------------------------------------

    def on_init_end(self, args, state, control, **kwargs):
        trainer = _trainer_being_built(self)
        if trainer is not None and not isinstance(vars(trainer).get("train"), _Routed):
            trainer.train = _Routed(self, trainer)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None,
                       train_dataloader=None, **kwargs):
        self._check_start(args, state)
        precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
        self.loop = Loop(self.store, model, getattr(optimizer, "optimizer", optimizer), scheduler=lr_scheduler,
                         scaler=getattr(optimizer, "scaler", None),   # accelerate's (fp16), kept by its optimizer
                         total_steps=state.max_steps, precision=precision, yield_skipped=True, **self.options)
        try:
            if self.loop.window is not None:
                self._check_replay(self.loop)
                args.save_strategy = SaveStrategy.NO   # the store's checkpoints are the replay's; the Trainer's stay
            self._batches = self.loop.loader(getattr(train_dataloader, "base_dataloader", train_dataloader)).driven()
        except BaseException:
            self.loop.close()
            raise
        self._hooks = [model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
                       model.register_forward_hook(self._after_forward)]
        self._steps = self.loop.steps()

    def _check_start(self, args, state) -> None:
        """Refuse, before the store is touched, a start a replay could not reproduce past step 0 (a recording
        not started through `self.train`), or a Trainer not at the store's step."""
        how = "build the Trainer with callbacks=[recorder] or start it with recorder.train(trainer)"
        if not self._started and not os.environ.get(STORE_ENV):
            refuse(f"TrainerRecorder: a Trainer given the recorder after it was built (trainer.add_callback) and "
                   f"started by its own train() could not be started past step 0 by a replay: {how}",
                   args.process_index)
        start = self._start_step()
        if state.global_step != start:
            refuse(f"TrainerRecorder: the Trainer starts at step {state.global_step}, the store's run at step "
                   f"{start}: {how}", args.process_index)

    @staticmethod
    def _check_replay(loop: Loop) -> None:
        if loop.store.manifest.config.precision != loop.precision:
            raise ReplayError("--precision: a Trainer run's autocast is accelerate's (TrainingArguments' bf16), "
                              "which a replay cannot change")

    def _before_forward(self, module, args, kwargs):
        if module.training and torch.is_grad_enabled():   # a training micro-batch: the stream's next batch
            assert self._batches is not None, "the loader is tapped at the training's start"
            self._batches.take()
            self._summed = kwargs.get("num_items_in_batch") is not None

    def _after_forward(self, module, args, output):
        loss = getattr(output, "loss", None) if not isinstance(output, dict) else output.get("loss")
        if module.training and loss is not None:
            self._losses.append(loss.detach().float())

    def on_step_begin(self, args, state, control, **kwargs):
        step = next(self._steps)   # the first: restores the start checkpoint; later ones: the last step's
        assert state.global_step == step, "the Trainer starts at the store's step (recorder.train)"
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


class _Routed:
    """The `train` of a Trainer built with the recorder among its callbacks: an attribute of that instance
    (nothing else changes), its calls made through `recorder.train` on the Trainer's own `train`."""

    def __init__(self, recorder: TrainerRecorder, trainer: Any):
        self.recorder, self.trainer, self.own = recorder, trainer, trainer.train

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        names = inspect.signature(self.own).parameters   # resume_from_checkpoint, trial, ignore_keys_for_eval
        return self.recorder.train(self.trainer, **dict(zip(names, args, strict=False)), **kwargs)


def _trainer_being_built(callback: TrainerCallback) -> Any:
    """The Trainer whose `__init__` calls `on_init_end` (its callback handler gives a callback no Trainer): the
    nearest caller's `self` that is a Trainer with `callback` among its callbacks; None if there is none."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer) and callback in candidate.callback_handler.callbacks:
            return candidate
        frame = frame.f_back
    return None


def _trainer_checkpoint(trainer: Any, step: int, where: str) -> None:
    """A checkpoint of the Trainer's own format at `step` holding only its state and the model's current
    weights (which its resume loads first): no optimizer, scheduler, scaler or RNG files, so it loads none."""
    exportable: list[Any] = [c for c in [*trainer.callback_handler.callbacks, trainer.control]   # as the Trainer does
                             if isinstance(c, ExportableState)]
    state = TrainerState(global_step=step, max_steps=trainer.args.max_steps,
                         train_batch_size=trainer._train_batch_size, stateful_callbacks=exportable)
    state.compute_steps(trainer.args, trainer.args.max_steps)
    state.save_to_json(os.path.join(where, TRAINER_STATE_NAME))
    torch.save(unwrap(trainer.model).state_dict(), os.path.join(where, WEIGHTS_NAME))   # on every rank
