"""A Lightning `Trainer.fit` run, recorded and replayed: a callback over the loop API (loop.py).

    from replay.recorder.lightning import LightningRecorder

    trainer = L.Trainer(max_steps=1000, strategy="ddp", callbacks=[LightningRecorder("runs/lit")])
    trainer.fit(model, datamodule=data)      # under torchrun for several ranks: Lightning launches none itself

The training DataLoader is the one Lightning iterates, after it has put its own `DistributedSampler` in (the
loop's `loop.loader`, recorder/loader.py, driven by Lightning's epochs): its batch sampler is tapped in the
moment between Lightning preparing the loader and iterating it, so each batch is noted by its dataset
indices where it is sampled, with worker processes and Lightning's own fetching ahead alike. The callback
drives a `Loop` from the Trainer's events:

- `setup` refuses what the recorder could not record or a replay not reproduce (below);
- `on_fit_start` (the model set up, the optimizer and scheduler made, DDP joined): the `Loop` is made (the
  run's length is the Trainer's `max_steps`, its precision the Trainer's) and, for a run that starts past
  step 0 (a resumed recording, a replay from a later checkpoint), Lightning's loops are given the progress
  they had at that checkpoint (their own `load_state_dict`, as from a checkpoint Lightning saved at the end
  of the step before), so the Trainer goes on at that step, in that epoch, at that batch;
- the first batch of each optimizer step (`on_train_batch_start`) begins the loop's step: the first
  restores the start checkpoint (model, optimizer, scheduler, loss scaler and every RNG), every later one
  takes the last step's checkpoint on the cadence, after what Lightning ran between the steps
  (validation, logging); every batch is the stream's next (its sample ids);
- `on_before_optimizer_step`: the gradient norm before Lightning clips; in a step the replay skips
  (`--skip`, a data bisect's probe) the gradients are dropped, so the optimizer changes nothing, while
  Lightning steps its scheduler as it does;
- the step's loss is the sum of its batches' `training_step` losses as Lightning backpropagates them (each
  divided by `accumulate_grad_batches`); `loop.log` at the batch that stepped the optimizer, with the loops'
  progress kept for the next checkpoint; a replay stops the Trainer after --to (`should_stop`);
- `on_train_end`: the last checkpoint and the store's completion.

A replay never writes Lightning's own checkpoints (its `ModelCheckpoint`s are taken out); in a recording
they are the user's, and the callbacks' states (a best score, a patience count) are kept with every
checkpoint. Refused as the run starts, before the store is made, in one line: no `max_steps`, or
`max_epochs`/`max_time` beside it (either could end the run early), manual optimization,
`reload_dataloaders_every_n_epochs`, a `ckpt_path` (the store's run resumes from the store: `resume=True`), a
precision other than 32-true, bf16-mixed and 16-mixed, a strategy other than DDP or one device, validation at
wall-clock times, several LR schedulers, a training DataLoader prepared before the fit (as
`trainer.estimated_stepping_batches` does), several training DataLoaders or an iterable one, `limit_train_batches`
or `overfit_batches` with worker processes, and several ranks launched by Lightning itself (start them with
torchrun, which the recording names and a replay runs again).
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint, Timer

from replay.errors import ReplayError
from replay.recorder.loader import RecordedLoader
from replay.recorder.loop import Loop
from replay.recorder.modes import refuse
from replay.recorder.stream import storable_tree
from replay.store.location import Location, Where

# the Trainer's precision as the Loop names it; "true" half precisions keep no autocast the Loop knows
_PRECISIONS = {"32-true": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16"}
_STRATEGIES = ("DDPStrategy", "SingleDeviceStrategy")   # FSDP's, DeepSpeed's: checkpoints and steps of their own
_LOOP_OPTIONS = {"checkpoint_every", "snapshot_every", "snapshot_ring", "spike", "layout", "description", "n_head",
                 "attention", "resume"}


class LightningRecorder(Callback):
    """Record a Lightning `Trainer.fit` run into `store` (or replay it, started by `replay run`); the keyword
    arguments are the `Loop`'s (checkpoint_every, snapshot_every, snapshot_ring, spike, layout, description,
    n_head, attention, resume). The run's length is the Trainer's `max_steps`, its precision the Trainer's."""

    def __init__(self, store: Where, **loop_options: Any):
        unknown = set(loop_options) - _LOOP_OPTIONS
        if unknown:
            raise TypeError(f"LightningRecorder does not take {', '.join(sorted(unknown))}")
        self.store, self.options = Location.parse(store), loop_options
        self.loop: Loop | None = None
        self._batches: RecordedLoader | None = None
        self._steps: Any = None
        self._in_step = False          # a batch of the current optimizer step has been trained
        self._global_step = 0          # the Trainer's, as the step began
        self._losses: list[torch.Tensor] = []
        self._grad_norm: Any = float("nan")
        self._progress: dict[str, Any] = {}   # Lightning's loops' progress as the last step ended

    # -- the Trainer's events ----------------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":   # before Lightning loads a checkpoint of its own or builds anything
            self._check_start(trainer, pl_module)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        rank = trainer.global_rank
        if trainer.ckpt_path is not None:   # known once Lightning has begun restoring it
            refuse("LightningRecorder: trainer.fit(ckpt_path=...): the store's run resumes from the store: "
                   "LightningRecorder(store, resume=True)", rank)
        if len(trainer.lr_scheduler_configs) > 1:
            refuse("LightningRecorder: configure_optimizers returns several LR schedulers; the recorder keeps one",
                   rank)
        if trainer.fit_loop._combined_loader is not None:
            refuse("LightningRecorder: the training DataLoader was iterated before the fit began (as "
                   "trainer.estimated_stepping_batches does in configure_optimizers): the recorder would not see "
                   "its first batches; take the schedule's length from max_steps", rank)
        self._batches, self._steps, self._in_step = None, None, False
        self._tap_when_prepared(trainer, pl_module)

    def _check_start(self, trainer: Any, pl_module: Any) -> None:
        """Refuse, before the store is touched, a run the loop could not record or a replay not reproduce."""
        rank = trainer.global_rank
        if trainer.max_steps is None or trainer.max_steps < 1:
            refuse("LightningRecorder: the run's length is the Trainer's max_steps: set Trainer(max_steps=...)", rank)
        if trainer.max_epochs != -1 or any(isinstance(c, Timer) for c in trainer.callbacks):
            refuse("LightningRecorder: max_epochs and max_time could end the run before max_steps, leaving its store "
                   "incomplete: give the run's length as max_steps only", rank)
        if not pl_module.automatic_optimization:
            refuse("LightningRecorder: a LightningModule with manual optimization steps its optimizer itself: record "
                   "it with a Loop of your own (docs/your-loop.md) or use automatic optimization", rank)
        if trainer.reload_dataloaders_every_n_epochs:
            refuse("LightningRecorder: reload_dataloaders_every_n_epochs makes a new training DataLoader whose batches "
                   "the recorder does not see: leave it 0", rank)
        if str(trainer.precision) not in _PRECISIONS:
            refuse(f"LightningRecorder: precision {trainer.precision!r} is not recorded: use one of "
                   f"{', '.join(sorted(_PRECISIONS))}", rank)
        if type(trainer.strategy).__name__ not in _STRATEGIES:
            refuse(f"LightningRecorder: the {type(trainer.strategy).__name__} is not recorded (its checkpoints and "
                   f"steps are its own): use strategy='ddp' or one device", rank)
        if getattr(trainer, "_val_check_time_interval", None) is not None:
            refuse("LightningRecorder: a validation at wall-clock times draws from the generators at other steps in "
                   "every run: give val_check_interval in batches", rank)
        if trainer.world_size > 1 and "RANK" not in os.environ:   # no launcher gave this process its rank
            refuse("LightningRecorder: this Trainer launches its own processes, which a replay could not start "
                   "again as they were: start the script with torchrun (torchrun --nproc-per-node N script.py), "
                   "under which Lightning launches none", rank)

    def _tap_when_prepared(self, trainer: Any, pl_module: Any) -> None:
        """Make the loop and tap the training DataLoader between Lightning preparing it (its sampler put in) and
        iterating it: the fit loop's `_load_combined_loader_states`, the one call between the two, runs `_start`
        after it (this fit loop only, as an attribute of the instance)."""
        fit_loop = trainer.fit_loop
        own = getattr(type(fit_loop), "_load_combined_loader_states", None)
        if own is None:
            refuse("LightningRecorder: this Lightning version prepares its training data in a way the recorder does "
                   "not know (tested with Lightning 2.6)", trainer.global_rank)

        def load_then_start() -> None:
            own(fit_loop)
            del fit_loop._load_combined_loader_states   # once: a later preparation is Lightning's own again
            self._start(trainer, pl_module, fit_loop._combined_loader.flattened)

        fit_loop._load_combined_loader_states = load_then_start

    def _start(self, trainer: Any, pl_module: Any, loaders: list[Any]) -> None:
        """The training DataLoader is prepared and not iterated yet: the checks that need it, then the loop (the
        store from here on), Lightning's progress and its callbacks' states at the start checkpoint, the tap."""
        rank = trainer.global_rank
        if len(loaders) != 1:
            refuse(f"LightningRecorder: the run trains on {len(loaders)} DataLoaders; it records one", rank)
        loader = loaders[0]
        if isinstance(getattr(loader, "dataset", None), torch.utils.data.IterableDataset):
            refuse("LightningRecorder: the training DataLoader is over an IterableDataset, which it does not record "
                   "yet: use a map-style dataset, or a Loop of your own (docs/your-loop.md, streams)", rank)
        if (trainer.limit_train_batches != 1.0 or trainer.overfit_batches) and loader.num_workers > 0:
            refuse("LightningRecorder: limit_train_batches or overfit_batches with worker processes ends an epoch "
                   "while the workers have sampled past it, which a replay cannot follow: use num_workers=0", rank)
        scheduler = trainer.lr_scheduler_configs[0].scheduler if trainer.lr_scheduler_configs else None
        self.loop = loop = Loop(self.store, pl_module, trainer.optimizers[0], scheduler=scheduler,
                                scaler=getattr(trainer.precision_plugin, "scaler", None),
                                total_steps=trainer.max_steps, precision=_PRECISIONS[str(trainer.precision)],
                                yield_skipped=True, driver_state=lambda: self._progress, **self.options)
        try:
            if loop.window is not None:
                if loop.store.manifest.config.precision != loop.precision:
                    raise ReplayError("--precision: a Lightning run's autocast is its precision plugin's (the "
                                      "Trainer's `precision`), which a replay cannot change")
                trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, ModelCheckpoint)]
            restored = loop.restored_driver_state
            if restored is not None:   # the loops go on where the checkpoint's step begins
                trainer.fit_loop.load_state_dict(restored["loops"])
                states = restored["callbacks"]
                for callback in trainer.callbacks:
                    if callback.state_key in states:
                        callback.load_state_dict(states[callback.state_key])
                # Lightning warns that a loader without a state of its own restarts its epoch: the tap does not
                warnings.filterwarnings("ignore", "You're resuming from a checkpoint that ended before the epoch")
            elif loop.recorder.first_step() > 0:
                raise ReplayError("the checkpoint this run starts from holds no progress of Lightning's loops: it was "
                                  "not recorded by LightningRecorder")
            tapped = loop.loader(loader)
            assert isinstance(tapped, RecordedLoader), "a map-style dataset's loader"
            self._batches = tapped.driven(skips=True)
        except BaseException:
            loop.close()
            raise
        self._steps = loop.steps()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        assert self._batches is not None and self.loop is not None, "the loader is tapped before the first batch"
        if not self._in_step:
            step = next(self._steps)   # the first: restores the start checkpoint; later ones: the last step's
            if trainer.global_step != step:
                raise ReplayError(f"LightningRecorder: the Trainer is at step {trainer.global_step}, the loop at "
                                  f"step {step}")
            self._in_step, self._global_step, self._losses = True, trainer.global_step, []
        self._batches.take()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        assert self.loop is not None, "a step is under way"
        if self.loop.skipping:   # the Trainer runs every step: this one's update is left out
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
            return
        norms = [p.grad.detach().float().norm() for g in optimizer.param_groups for p in g["params"]
                 if p.grad is not None]
        self._grad_norm = torch.linalg.vector_norm(torch.stack(norms)) if norms else float("nan")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        assert self.loop is not None, "a step is under way"
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self._losses.append(loss.detach().float())
        if trainer.global_step == self._global_step:   # an accumulated batch: the step goes on
            return
        self._in_step = False
        if self.loop.skipping:
            self.loop.log_skipped()
        elif not self._losses:
            raise ReplayError(f"step {self.loop.step}: training_step returned no loss (LightningRecorder records the "
                              "loss Lightning backpropagates)")
        else:
            self.loop.log(loss=torch.stack(self._losses).sum(), grad_norm=self._grad_norm)
        loops = trainer.fit_loop.state_dict()
        loops.pop("combined_loader", None)   # a stateful loader's own state: the tapped stream holds its place
        self._progress = {"loops": loops, "callbacks": _callback_states(trainer, self)}
        window = self.loop.window
        if window is not None and self.loop.step is not None and self.loop.step >= window.stop:
            trainer.should_stop = True

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        try:   # the last step's checkpoint and, at the run's end, the store's completion
            left = next(self._steps, None) if self._steps is not None else None
            if left is not None and self.loop is not None:
                if self.loop.replaying:
                    raise ReplayError(f"the Trainer stopped at step {left}, before the replay's last step")
                if trainer.global_rank == 0:
                    print(f"replay: the Trainer stopped at step {left}, before max_steps={trainer.max_steps} "
                          "(EarlyStopping or should_stop): the store holds its steps before it and stays 'running'",
                          file=sys.stderr, flush=True)
        finally:
            self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self.loop is not None:
            self.loop.close()


def _callback_states(trainer: Any, recorder: LightningRecorder) -> dict[str, Any]:
    """The Trainer's callbacks' own states (a ModelCheckpoint's best score, an EarlyStopping's patience), as
    Lightning's checkpoints keep them, where the store can keep them (no pickle)."""
    states = {}
    for callback in trainer.callbacks:
        state = callback.state_dict() if callback is not recorder else None
        if state and storable_tree(state):
            states[callback.state_key] = state
    return states
