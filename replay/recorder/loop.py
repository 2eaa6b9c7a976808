"""Your own training loop, recorded and replayed: the public API (docs/your-loop.md).

    from replay.recorder import Loop

    loop = Loop("runs/mine", model, optimizer, total_steps=max_iters, precision="bf16")
    ctx = loop.autocast("cuda")                     # the forward's autocast, which a replay may change
    with loop:
        for step in loop.steps():                   # a replay: the recorded window, then the loop ends
            for micro in range(accum):
                ix = loop.sample_ids(torch.randint(len(data) - block_size, (batch_size,)))
                with ctx:
                    loss = model(x(ix), y(ix))
                ...
            optimizer.step()
            loop.log(loss=loss, grad_norm=norm)

Run as it is, the script records: per step every rank's sample ids, loss, grad norm and learning rate;
checkpoints of the model, optimizer, scheduler, scaler and every RNG; spikes with a ring of snapshots;
and the command that started it (recorder/command.py). `replay run STORE --from A --to B` starts that
command again in replay mode (it names the replay's store in REPLAY_LOOP_STORE): the same `Loop` then
restores the checkpoint at or before A, hands `sample_ids` exactly the recorded ids (checking that the
loader drew them too), applies the overrides from A on, writes the replay's step log, and ends
`steps()` after B. Without replay's environment variables the script runs as a recording.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from replay.config import ModelConfig, RunConfig, SpikeConfig
from replay.errors import ReplayError, UsageError
from replay.kernels.plan import AttentionPlan
from replay.kernels.registry import apply_plan, is_transformers_model
from replay.kernels.sdpa_dispatch import attention_modules, sdpa_dispatch
from replay.lifeline import follow_parent
from replay.recorder import command as cmd
from replay.recorder.environment import configure_determinism, fingerprint
from replay.recorder.recorder import Recorder, RecorderConfig, TrainState
from replay.recorder.spikes import SpikeEvent
from replay.recorder.state import TorchTrainState, unwrap
from replay.store import RunStore
from replay.store.layout import FAMILIES, resolve_layout
from replay.store.lease import ENV as LEASE_ENV
from replay.store.lease import Lease
from replay.store.manifest import PROBE_SAMPLES, PROBE_TOKENS, DataInfo, Manifest, ModelInfo, ReplaySpec, ResumeInfo
from replay.store.run_store import check_empty

PRECISIONS = {"fp32": None, "float32": None, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
              "fp16": torch.float16, "float16": torch.float16}
_HEAD_ATTRS = ("n_head", "num_heads", "n_heads", "num_attention_heads")


@dataclass
class _Replay:
    """A replay's side of the loop: its window and what changes from `start` on."""

    spec: ReplaySpec
    parent: RunStore
    ids: np.ndarray                      # (step, rank, call, sample): what the parent trained on, from ...
    first: int                           # ... this step (its start checkpoint's) to the window's end
    plan: AttentionPlan | None           # None: the recorded attention
    precision: str | None
    lr_scale: float | None


class Loop:
    """Record (or, started by `replay run`, replay) a training loop of your own; one per rank.

    `store`: where the run goes (ignored in a replay). `total_steps`: the optimizer steps of the run.
    `precision`: what `autocast()` gives ("bf16", "fp16", "fp32"). `attention`: a pattern naming the
    attention modules (`transformer.h.*.attn`) when they cannot be found by their names. `n_head`: the
    heads per layer, when the attention modules do not say (`n_head`, `num_heads` attributes).
    `layout`: where the attention weights live, for `replay analyze` (store/layout.py): "nanogpt",
    "hf-gpt2", "hf-llama" or a mapping (a transformers GPT-2, Llama, Qwen2 or Mistral: its own by default).
    `resume`: continue the run in `store` from its last committed checkpoint.

    For a launcher that prepares the store itself (the built-in `replay record` and `replay run`):
    `lease`, the spec of the lease it holds (store/lease.py), says the store exists already: a new run, one
    to resume (`resume=True`, rewound by the launcher) or a replay (its kind says so); its config is the
    stored one. `state` is checkpointed instead of model, optimizer, scheduler and scaler (a DeepSpeed
    engine: recorder/state.py). `apply_attention(plan)` puts a replay's attention plan into the model at
    `--from` (default: `sdpa_dispatch`), returning a context to leave at the end, or None.
    `skipped_numerics()` gives the numerics row of a step a replay skips. `yield_skipped=True`, for a
    driver that cannot leave a step out (the Trainer, recorder/hf_trainer.py): a step the replay skips is
    yielded with `loop.skipping` true; the driver runs it without its update (and steps its scheduler as
    usual) and ends it with `loop.log_skipped()` instead of `log`.
    """

    def __init__(self, store: str | os.PathLike, model: torch.nn.Module, optimizer: Any, *, total_steps: int,
                 scheduler: Any = None, scaler: Any = None, precision: str = "fp32", checkpoint_every: int = 100,
                 snapshot_every: int = 0, snapshot_ring: int = 3, spike: SpikeConfig | None = None,
                 attention: str | None = None, n_head: int | None = None, layout: str | dict | None = None,
                 resume: bool = False, description: str = "", lease: str | None = None, state: TrainState | None = None,
                 apply_attention: Callable[[AttentionPlan], Any] | None = None,
                 skipped_numerics: Callable[[], dict[str, np.ndarray]] | None = None, yield_skipped: bool = False):
        follow_parent()   # started by `replay run`: die with it
        if precision not in PRECISIONS:
            raise UsageError(f"Loop(precision={precision!r}): use one of {', '.join(PRECISIONS)}")
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.rank, self.world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        if self.world > 1 and not dist.is_initialized():
            raise UsageError("WORLD_SIZE > 1: call torch.distributed.init_process_group() before Loop(...)")
        self.attention = attention
        self._apply_attention = apply_attention or _attention_applier(unwrap(model), attention)
        self._skipped_numerics = skipped_numerics
        self._yield_skipped = yield_skipped
        self.skipping = False   # the current step is one the replay skips (yielded with yield_skipped=True)
        self._lease: Lease | None = None
        if os.environ.get(cmd.STORE_ENV):   # started again by `replay run`: its replay store and lease
            sys.excepthook = _one_line_errors(sys.excepthook, self.rank)
            store, lease = os.environ[cmd.STORE_ENV], os.environ[LEASE_ENV]
            resume = os.environ.get(cmd.RESUME_ENV) == "1"
        elif lease is None:             # the script's own recording: rank 0 prepares the store
            n_layer, heads = _attention_shape(unwrap(model), attention, n_head)
            cfg = RunConfig(preset="custom", steps=total_steps, nproc=self.world, precision=_canonical(precision),
                            threads=torch.get_num_threads(), checkpoint_every=checkpoint_every,
                            snapshot_every=snapshot_every, snapshot_ring=snapshot_ring, spike=spike or SpikeConfig(),
                            model=ModelConfig(n_layer=n_layer, n_head=heads, n_embd=_width(unwrap(model)),
                                              block_size=0, attention=_implementation(unwrap(model))))
            lease = self._prepare(str(store), cfg, resume, layout, description)
        opened = RunStore.open(store)
        self._replay = self._read_replay(opened) if opened.kind == "replay" else None
        self.replaying = self._replay is not None
        cfg = self._replay.parent.manifest.config if self._replay else opened.manifest.config   # as recorded
        configure_determinism(cfg.threads)
        self.cfg, self.precision = cfg, cfg.precision
        state = state or TorchTrainState(model, optimizer, scheduler, scaler)
        start_from = None
        if self._replay is not None and not resume:
            start_from = (self._replay.parent, self._replay.spec.start_checkpoint)
        stop = self._replay.spec.stop + 1 if self._replay else cfg.steps
        every = (self._replay.spec.checkpoint_every or stop + 1) if self._replay else cfg.checkpoint_every
        self.recorder = Recorder(str(store), state, rank=self.rank, world_size=self.world, resume=resume,
                                 start_from=start_from, lease=lease,
                                 cfg=RecorderConfig(total_steps=stop, checkpoint_every=every,
                                                    snapshot_every=0 if self._replay else cfg.snapshot_every,
                                                    snapshot_ring=cfg.snapshot_ring, spike=cfg.spike))
        self.store = self.recorder.store
        self._stop = stop
        self.step: int | None = None
        self._ids: list[np.ndarray] = []
        self._logged = False
        self._overriding = False
        self._autocast_entered = False
        self._check_draws = True
        self._pending: tuple[int, SpikeEvent | None] | None = None   # a logged step not yet checkpointed
        self._shape: tuple[int, ...] | None = None                   # of every step's sample ids
        self._exits = contextlib.ExitStack()
        self._probe_hook = None
        if self.rank == 0:
            self._note_environment(resume)
            info = self.store.manifest.model
            if not self.replaying and info is not None and info.probe is None:
                self._probe_hook = unwrap(model).register_forward_pre_hook(self._take_probe, with_kwargs=True)

    @property
    def window(self) -> ReplaySpec | None:
        """In a replay, what it replays (its window, overrides, skipped steps, dropped samples); else None."""
        return self._replay.spec if self._replay else None

    @property
    def in_window(self) -> bool:
        """In a replay, whether the current step is in the window (where the overrides apply)."""
        return self._overriding

    def recorded_ids(self, step: int) -> np.ndarray:
        """In a replay, the sample ids the record has for `step` (of its window or the fast-forward before
        it): (rank, micro-batch, sample)."""
        assert self._replay is not None, "a recording has no recorded ids to read"
        return self._replay.ids[step - self._replay.first]

    @property
    def last_loss(self) -> float:
        """The last step's loss, averaged over the ranks."""
        return self.recorder.last_loss

    # -- the store, before any step ----------------------------------------------------------------

    def _prepare(self, path: str, cfg: RunConfig, resume: bool, layout, description: str) -> str:
        """Rank 0 creates (or, resuming, rewinds) the store under its lease; every rank gets the lease's
        spec, or rank 0's error, after a barrier."""
        message, spec = None, None
        if self.rank == 0:
            try:
                self._lease = Lease.acquire(path, f"a training script ({Path(sys.argv[0]).name or 'python'})")
                spec = self._lease.spec
                if resume and (Path(path) / "zarr.json").is_file():
                    self._rewind(path)
                else:
                    self._create(path, cfg, layout, description)
            except BaseException as e:
                if self._lease is not None:
                    self._lease.release()
                    self._lease = None
                if not isinstance(e, ReplayError):
                    raise
                message = str(e)
        if self.world > 1:
            box = [message, spec]
            dist.broadcast_object_list(box, src=0)
            message, spec = box
        if message is not None:
            raise UsageError(message) if self.rank == 0 else ReplayError(f"rank 0 could not prepare {path}: {message}")
        return spec

    def _create(self, path: str, cfg: RunConfig, layout, description: str) -> None:
        check_empty(Path(path))
        data = DataInfo(embedded=False, path=None, bytes=0, method="none", digest="",
                        source=description or "a training script of the user's own")
        model, info = unwrap(self.model), None
        if is_transformers_model(model):   # its config rebuilds it for the analysis probe; its family's layout
            info = ModelInfo(json.loads(model.config.to_json_string(use_diff=False)))
            layout = layout or FAMILIES.get(model.config.model_type)
        RunStore.create(path, Manifest(kind="run", config=cfg, world_size=self.world, launcher="custom", data=data,
                                       created=time.time(), command=cmd.capture(self.world),
                                       layout=resolve_layout(layout, cfg.model), model=info))

    def _rewind(self, path: str) -> None:
        store = RunStore.open(path, mode="a")
        m = store.manifest
        if m.kind != "run" or m.launcher != "custom" or m.command is None:
            raise UsageError(f"Loop(resume=True): {path} was not recorded by a Loop")
        if m.world_size != self.world:
            raise UsageError(f"Loop(resume=True) with {self.world} ranks, but {path} was recorded with "
                             f"{m.world_size}: resume with the same world size")
        if os.environ.get("REPLAY_ALLOW_CHANGED") != "1":
            cmd.check_unchanged(m.command, "resuming", allow="set REPLAY_ALLOW_CHANGED=1")
        last = store.rewind(verify_world_size=self.world)
        store.update_manifest(status="running", resumes=[*m.resumes, ResumeInfo(from_step=last or 0,
                                                                                 time=time.time())])

    def _take_probe(self, module, args, kwargs) -> None:
        """The analysis probe's batch of a transformers model: the first training forward's input_ids."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not module.training or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            return
        self._probe_hook.remove()
        rows = ids[:PROBE_SAMPLES, :PROBE_TOKENS].detach().cpu().tolist()
        self.store.update_manifest(model=dataclasses.replace(self.store.manifest.model, probe=rows))

    def _read_replay(self, store: RunStore) -> _Replay:
        spec = store.manifest.replay
        assert spec is not None, "replay run names a replay store"
        parent = RunStore.open(store.path / spec.parent)
        overrides = spec.overrides
        cfg = store.manifest.config
        plan = None
        if cfg.model.attention != parent.manifest.config.model.attention:
            plan = AttentionPlan.parse(cfg.model.attention)
        precision = cfg.precision if cfg.precision != parent.manifest.config.precision else None
        lr_scale = None if spec.lr_scope else overrides.get("lr_scale")   # a scoped one is the loop's to apply
        ids = parent.read_steps(["sample_ids"], start=spec.start_checkpoint, stop=spec.stop + 1)["sample_ids"]
        return _Replay(spec, parent, ids, spec.start_checkpoint, plan, precision, lr_scale)

    def _note_environment(self, resumed: bool) -> None:
        device = next(self.model.parameters()).device
        env = fingerprint(device)
        if resumed and self.store.manifest.resumes:
            resumes = self.store.manifest.resumes
            self.store.update_manifest(resumes=[*resumes[:-1], dataclasses.replace(resumes[-1], environment=env)])
        else:
            self.store.update_manifest(environment=env)

    # -- the loop ----------------------------------------------------------------------------------

    def __enter__(self) -> Loop:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def steps(self) -> Iterator[int]:
        """The steps to train: from 0 (or the restored checkpoint) to the end; in a replay, from the
        parent's checkpoint at or before the window to its last step. Steps a replay skips are not
        yielded (their schedule moves on). Call `log` once in every step."""
        start = self.recorder.start()
        if self._replay and any(s < start for s in self._replay.spec.skip):   # a replay resumed after a skip:
            self._check_draws = False   # its restored RNG states are its own, no longer the record's
        for step in range(start, self._stop):
            self._finish()   # the previous step's checkpoint: its state includes what the script did after log
            self.step, self._ids, self._logged, self._autocast_entered = step, [], False, False
            if self._replay and step >= self._replay.spec.start and not self._overriding:
                self._begin_overrides(step)
            self.skipping = bool(self._replay) and step in self._replay.spec.skip
            if self.skipping and not self._yield_skipped:
                self._skip(step, step_scheduler=True)
                continue
            yield step
            if not self._logged:
                raise UsageError(f"step {step} ended without loop.log(loss=...): call it once in every step")
        self._finish()
        self.step = None
        self.recorder.flush()
        if self.rank == 0:
            self.store.update_manifest(status="complete", steps_recorded=self.store.n_steps)

    def sample_ids(self, ids):
        """This micro-batch's sample ids as the loader drew them (a tensor, array or list: random offsets,
        indices into a dataset); call it for every training micro-batch. Returns them unchanged in a
        recording; in a replay, the recorded ids (as the same type), after checking that the loader drew
        the same ones, which it does when its randomness comes from the recorded RNG states."""
        drawn = np.asarray(ids.detach().cpu() if isinstance(ids, torch.Tensor) else ids, dtype=np.int64)
        if self.step is None:
            raise UsageError("loop.sample_ids(...) is called inside `for step in loop.steps()`")
        if self._replay is None:
            self._ids.append(drawn)
            return ids
        recorded_step = self.recorded_ids(self.step)[self.rank]
        call = len(self._ids)
        if call >= len(recorded_step) or recorded_step[call].shape != drawn.shape:
            raise ReplayError(f"step {self.step}: the script draws micro-batch {call} of shape {drawn.shape}, the "
                              f"record has {len(recorded_step)} of shape {recorded_step[0].shape}: it does not run "
                              "as recorded")
        recorded = recorded_step[call]
        if self._check_draws and not np.array_equal(recorded, drawn):
            raise ReplayError(f"step {self.step}, rank {self.rank}: the loader drew samples {drawn[:4].tolist()}..., "
                              f"the record has {recorded[:4].tolist()}...: its randomness is not the recorded RNG "
                              "state's (an unrecorded generator, or a changed script)")
        self._ids.append(recorded)
        if isinstance(ids, torch.Tensor):
            return torch.as_tensor(recorded, dtype=ids.dtype, device=ids.device)
        return recorded.tolist() if isinstance(ids, list) else recorded.astype(np.asarray(ids).dtype)

    def log(self, loss, grad_norm=float("nan"), lr: float | None = None, tokens: int = 0,
            numerics: dict[str, np.ndarray] | None = None) -> SpikeEvent | None:
        """End the step: this rank's loss (a float or a tensor), the gradient norm before clipping and the
        learning rate (the optimizer's first group's by default); `numerics`, a row of per-layer attention
        numerics (replay.kernels.numerics). Returns the spike the detector saw at this step, if any."""
        if self.step is None or self._logged:
            raise UsageError("loop.log(...) is called once in every step of `for step in loop.steps()`")
        if not self._ids:
            raise UsageError(f"step {self.step} drew no samples through loop.sample_ids(...): pass every "
                             "training micro-batch's sample ids through it")
        if self._overriding and self._replay.precision and not self._autocast_entered:
            raise UsageError("--precision: this script does not run its forward under loop.autocast(...), so a "
                             "replay cannot change its precision")
        lr = self.optimizer.param_groups[0]["lr"] if lr is None else lr
        self._logged = True
        if len({a.shape for a in self._ids}) > 1 or (self._shape is not None and self._shape != np.shape(self._ids)):
            raise UsageError(f"step {self.step} drew micro-batches of {[a.shape for a in self._ids]} sample ids; every "
                             f"step must draw the same ({self._shape or 'as its first micro-batch'}): one "
                             "loop.sample_ids(...) call per training micro-batch, each of the batch size")
        self._shape = np.shape(self._ids)
        event = self.recorder.record_step(self.step, sample_ids=np.stack(self._ids), loss=_number(loss),
                                          grad_norm=_number(grad_norm), lr=float(lr), tokens=int(tokens),
                                          numerics=numerics, finish=False)
        self._pending = (self.step, event)
        return event

    def _finish(self) -> None:
        if self._pending is not None:
            step, event = self._pending
            self._pending = None
            self.recorder.finish_step(step, event)

    def autocast(self, device_type: str) -> _Autocast:
        """The context the forward runs under: autocast to the run's precision (none for fp32), or to a
        replay's --precision from the window on. Reusable: make it once, enter it every micro-batch."""
        return _Autocast(self, device_type)

    def close(self) -> None:
        """Flush the store and release what the loop holds (the `with` block does it)."""
        try:
            self._finish()   # a loop left after its last log (a `break`): that step's checkpoint is still due
            if self._probe_hook is not None:
                self._probe_hook.remove()
            self._exits.close()
            self.recorder.close()
        finally:
            if self._lease is not None:
                self._lease.release()
                self._lease = None

    # -- replay overrides --------------------------------------------------------------------------

    def _begin_overrides(self, step: int) -> None:
        r = self._replay
        self._overriding = True
        if r.plan is not None:
            applied = self._apply_attention(r.plan)
            if applied is not None:
                self._exits.enter_context(applied)
        if r.lr_scale is None:
            return
        if isinstance(self.scheduler, torch.optim.lr_scheduler.LambdaLR):   # scale what it scales, once (a
            if step == r.spec.start:              # replay resumed inside its window restored scaled ones)
                self.scheduler.base_lrs = [lr * r.lr_scale for lr in self.scheduler.base_lrs]
                for group in self.optimizer.param_groups:
                    group["lr"] *= r.lr_scale
        else:   # rates the script (or a scheduler from other state, as OneCycleLR) sets: scaled at each step
            self._exits.enter_context(_scaled_lr(self.optimizer, r.lr_scale))

    def log_skipped(self) -> None:
        """End a step the replay skips, which the driver ran without its update (`yield_skipped=True`)."""
        if self.step is None or self._logged or not self.skipping:
            raise UsageError("loop.log_skipped() ends a step the replay skips (loop.skipping), once")
        self._logged = True
        self._skip(self.step, step_scheduler=False)

    def _skip(self, step: int, step_scheduler: bool) -> None:
        """A skipped step: no training; the scheduler moves on as if it had trained (stepped here, or by
        the driver that ran the step without its update)."""
        self._check_draws = False   # the loader's randomness no longer follows the record's
        ids = self.recorded_ids(step)[self.rank]
        self.recorder.record_skipped(step, sample_ids=ids, lr=self.optimizer.param_groups[0]["lr"],
                                     numerics=self._skipped_numerics() if self._skipped_numerics else None,
                                     finish=False)
        if step_scheduler and self.scheduler is not None:
            self.scheduler.step()
        self._pending = (step, None)   # its checkpoint holds the scheduler's step


class _Autocast:
    def __init__(self, loop: Loop, device_type: str):
        self.loop, self.device_type = loop, device_type
        self._inner: Any = None

    def __enter__(self):
        loop = self.loop
        loop._autocast_entered = True
        precision = loop._replay.precision if loop._overriding and loop._replay.precision else loop.precision
        dtype = PRECISIONS[precision]
        self._inner = torch.autocast(self.device_type, dtype=dtype) if dtype else contextlib.nullcontext()
        return self._inner.__enter__()

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)


@contextlib.contextmanager
def _scaled_lr(optimizer: torch.optim.Optimizer, scale: float) -> Iterator[None]:
    """Every optimizer step with its learning rates times `scale` (set back after the step, so a schedule
    that assigns them keeps working)."""
    saved: list[float] = []

    def before(*_):
        saved[:] = [g["lr"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["lr"] = g["lr"] * scale

    def after(*_):
        for g, lr in zip(optimizer.param_groups, saved):
            g["lr"] = lr

    handles = [optimizer.register_step_pre_hook(before), optimizer.register_step_post_hook(after)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _one_line_errors(hook, rank: int):
    """In a replay, the loop's own errors end the process with one line and their exit code, as a rank of the
    built-in trainer does (a traceback with REPLAY_DEBUG=1); any other error is the script's, shown whole."""
    def excepthook(kind, value, tb):
        if not issubclass(kind, ReplayError) or os.environ.get("REPLAY_DEBUG"):
            return hook(kind, value, tb)
        print(f"rank {rank}: {value}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(value.exit_code)
    return excepthook


def _attention_applier(model: torch.nn.Module, pattern: str | None) -> Callable[[AttentionPlan], Any]:
    """How a replay puts its attention plan into the model: through transformers' AttentionInterface for a
    transformers model (per query head, grouped-query attention included), else by routing the SDPA calls
    of its attention modules (kernels/sdpa_dispatch.py)."""
    if pattern is None and is_transformers_model(model):
        return lambda plan: apply_plan(model, plan)
    return lambda plan: sdpa_dispatch(model, plan, pattern)


def _implementation(model: torch.nn.Module) -> str:
    """The attention the recording runs, as a replay's plan names it: a transformers model's own
    implementation (eager, sdpa; another, such as flash_attention_2, takes no overrides); else SDPA."""
    if is_transformers_model(model):
        return model.config.get_text_config()._attn_implementation
    return "sdpa"


def _number(x) -> float:
    return float(x.detach()) if isinstance(x, torch.Tensor) else float(x)


def _canonical(precision: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(precision, precision)


def _attention_shape(model: torch.nn.Module, pattern: str | None, n_head: int | None) -> tuple[int, int]:
    """(layers, heads per layer) of the model's attention, as attention overrides number them; (0, 0) for
    a model with no attention module (its runs record and replay; attention overrides are refused)."""
    try:
        modules = attention_modules(model, pattern)
    except UsageError:
        if pattern:
            raise
        return 0, n_head or 0
    if n_head:
        return len(modules), n_head
    for owner in (modules[0][1], getattr(model, "config", None), model):
        for attr in _HEAD_ATTRS:
            value = getattr(owner, attr, None)
            if isinstance(value, int) and value > 0:
                return len(modules), value
    raise UsageError("cannot tell the attention heads per layer from the model: pass Loop(..., n_head=N)")


def _width(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    for attr in ("n_embd", "hidden_size", "d_model"):
        value = getattr(config, attr, None)
        if isinstance(value, int):
            return value
    embedding = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return embedding.embedding_dim if embedding is not None else 0
