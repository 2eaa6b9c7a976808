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

The `Loop` keeps the steps' bookkeeping; what differs between recording and replaying is its mode's
(recorder/recording.py, recorder/replaying.py, chosen once by recorder/modes.py's `decide`), and a
replay's overrides are one component (recorder/overrides.py).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import os
import sys
import threading
import weakref
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from replay.config import RunConfig, SpikeConfig
from replay.errors import ReplayError, UsageError
from replay.kernels.plan import AttentionPlan
from replay.kernels.reach import AttentionReach
from replay.kernels.registry import apply_plan, transformers_model_in
from replay.kernels.sdpa_dispatch import sdpa_dispatch
from replay.lifeline import follow_parent
from replay.recorder.environment import AutocastSeen, configure_determinism, determinism_notice, fingerprint
from replay.recorder.loader import Batch, RecordedLoader, Scheduled
from replay.recorder.modes import Mode, Start, decide, one_line_errors
from replay.recorder.overrides import ReplayOverrides
from replay.recorder.placement import gather_placement
from replay.recorder.recorder import Recorder, TrainState
from replay.recorder.recording import Recording
from replay.recorder.replaying import Replaying
from replay.recorder.run_options import PRECISIONS, RunOptions
from replay.recorder.serving import Serving
from replay.recorder.spikes import SpikeEvent
from replay.recorder.state import TorchTrainState, note_sharding, unwrap
from replay.recorder.step_trace import StepTrace
from replay.recorder.stream import StreamBatch, StreamLoader
from replay.recorder.zero import engine_state
from replay.store import RunStore
from replay.store.lifecycle import complete_run, note_environment
from replay.store.location import Location, Where
from replay.store.manifest import ReplaySpec


@dataclass
class _Draw:
    """A training micro-batch the script drew: its sample ids, and the loader batch it is (loop.loader)."""

    ids: np.ndarray
    batch: Batch | StreamBatch | None = None


@dataclass
class _Step:
    """The step being trained: what the script has handed the loop of it so far."""

    number: int
    skipping: bool                                         # one the replay skips (yielded with yield_skipped=True)
    draws: list[_Draw] = field(default_factory=list)      # its micro-batches, then any drawn ahead for the next
    logged: bool = False
    autocast: bool = False                                 # a forward ran under loop.autocast(...)
    settling: str | None = None                            # "prime" or "check": a served replay's step, undone


def _at_exit(close: Callable[[], None]) -> None:
    """Call `close` (a loop's bound method, held weakly: a warm rank makes a loop per replay) when the
    interpreter exits, before it stops the thread pools a store's writes use (threading's own exit hook, as
    concurrent.futures registers; plain atexit handlers run after them), in this process only (a forked child
    inherits the hook). A closed loop's call does nothing."""
    method, pid = weakref.WeakMethod(close), os.getpid()

    def at_exit() -> None:
        alive = method()
        if alive is not None and os.getpid() == pid:   # a forked DataLoader worker runs these hooks too
            alive()

    getattr(threading, "_register_atexit", atexit.register)(at_exit)


P = ParamSpec("P")
R = TypeVar("R")


def _refusals_in_one_line(method: Callable[Concatenate[Loop, P], R]) -> Callable[Concatenate[Loop, P], R]:
    """A `Loop` refused as it is made or started (nothing written yet) ends an unguarded script with its one
    line and exit code, as a replay's errors do, rather than a traceback."""
    @functools.wraps(method)
    def guarded(self: Loop, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(self, *args, **kwargs)
        except ReplayError:
            sys.excepthook = one_line_errors(sys.excepthook, getattr(self, "rank", 0))
            raise
    return guarded


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
    engine: recorder/state.py). `apply_attention(plan, reach)` puts a replay's attention plan into the model
    at `--from`, counting its calls in `reach` (default: `sdpa_dispatch`), returning a context to leave at
    the end, or None.
    `skipped_numerics()` gives the numerics row of a step a replay skips. `yield_skipped=True`, for a
    driver that cannot leave a step out (the Trainer, recorder/hf_trainer.py): a step the replay skips is
    yielded with `loop.skipping` true; the driver runs it without its update (and steps its scheduler as
    usual) and ends it with `loop.log_skipped()` instead of `log`. `driver_state()`, for such a driver: its own
    state (scalars, lists and dicts), kept with every checkpoint and given back by `restored_driver_state`
    (Lightning's loop progress, recorder/lightning.py).
    """

    @_refusals_in_one_line
    def __init__(self, store: Where, model: torch.nn.Module, optimizer: Any, *, total_steps: int,
                 scheduler: Any = None, scaler: Any = None, precision: str = "fp32", checkpoint_every: int = 100,
                 snapshot_every: int = 0, snapshot_ring: int = 3, spike: SpikeConfig | None = None,
                 attention: str | None = None, n_head: int | None = None, layout: str | dict | None = None,
                 resume: bool = False, description: str = "", lease: str | None = None, state: TrainState | None = None,
                 apply_attention: Callable[[AttentionPlan, AttentionReach], Any] | None = None,
                 skipped_numerics: Callable[[], dict[str, np.ndarray]] | None = None, yield_skipped: bool = False,
                 driver_state: Callable[[], dict[str, Any]] | None = None):
        engine = engine_state(model, optimizer) if state is None else None   # a DeepSpeed engine (recorder/zero.py)
        if engine is not None:   # the engine steps its scheduler; a step the replay skips steps it here
            state, scheduler = engine, scheduler or model.lr_scheduler
        self._options = RunOptions(total_steps=total_steps, precision=precision, checkpoint_every=checkpoint_every,
                                   snapshot_every=snapshot_every, snapshot_ring=snapshot_ring, spike=spike,
                                   attention=attention, n_head=n_head, layout=layout, description=description)
        self.model, self.optimizer, self.scheduler, self.attention = model, optimizer, scheduler, attention
        self.rank, self.world = _rank_and_world()
        self._first = decide(store, lease, resume)
        self._played = _played_ranks(self._first, self.rank, self.world)   # `replay run --ranks`: several a process
        self.rank = self._played[0]
        self.world = self.world if len(self._played) == 1 else len(self._played) * self.world
        self.replaying = self._first.mode == "replay"
        self._apply_attention = apply_attention or _attention_applier(model, attention)
        self._state = state if state is not None else _train_state(model, optimizer, scheduler, scaler)
        self._skipped_numerics, self._yield_skipped = skipped_numerics, yield_skipped
        self._driver_state = driver_state
        self._ahead: list[_Draw] = []   # drawn ahead of the step that trains on them (a prefetch)
        self._lookahead = 0             # how many: as many as were drawn before the first step
        self._evaluating = 0
        self._loader: RecordedLoader | StreamLoader | None = None
        self._serving: Serving | None = None
        self._trace: StepTrace | None = None   # a step `replay diff` traces (recorder/step_trace.py)
        self._begun = self._window_open = self._closed = False

    @_refusals_in_one_line
    def start(self) -> Loop:
        """The one place a loop changes its process, done once, at its first use (`with loop`, `steps()`, a
        training `sample_ids`, `loader`, `autocast`, or any property of the run; every rank must make that
        first use at the same point of the script, as it joins a collective): this process dies with the
        `replay run` that started it, whose errors end it in one line; the store is prepared (a new run's,
        under rank 0's lease) or opened; torch's determinism settings and threads are the run's; every rank's
        node is gathered; the store is closed at the interpreter's exit."""
        if self._begun:
            return self
        self._begun = True
        follow_parent()   # started by `replay run`: die with it
        if self._first.by_replay_run:
            sys.excepthook = one_line_errors(sys.excepthook, self.rank)
            self._serving = Serving.from_env() if len(self._played) == 1 else None   # launch/script.py's pipes
            if self._serving is not None:
                sys.excepthook = self._serving.failing(sys.excepthook, self.rank)
        self._open(self._first)
        changed = configure_determinism(self._cfg.threads)
        if changed and not self.replaying and self.rank == 0:   # a replay runs as its recording did
            print(determinism_notice(changed), file=sys.stderr, flush=True)
        self._placement = gather_placement(played=len(self._played))
        self._fingerprint = fingerprint(next(self.model.parameters()).device)
        self._autocast: AutocastSeen | None = AutocastSeen(self.model)   # noted with the environment at the first log
        _at_exit(self.close)   # a script that never closes its loop loses none of what it recorded
        self._note_opened()
        return self

    @property
    def cfg(self) -> RunConfig:
        """The run's config, as recorded."""
        return self.start()._cfg

    @property
    def precision(self) -> str:
        """The run's precision, as recorded."""
        return self.cfg.precision

    @property
    def store(self) -> RunStore:
        """The store this loop writes: the run's, or the replay's."""
        return self.start()._store

    def _open(self, start: Start) -> None:
        """The run this loop writes now (a served script's: each replay in turn): its mode and its recorder,
        the checkpoint it starts from read ahead."""
        self.replaying = start.mode == "replay"
        self._mode: Mode = _mode_for(start, self)
        self._cfg = self._mode.cfg
        self.recorder = Recorder(start.store, self._state,
                                 cfg=self._mode.recorder_config, rank=self.rank, world_size=self.world,
                                 played=len(self._played),
                                 resume=start.resume, start_from=self._mode.start_from, lease=self._mode.lease,
                                 extra=self._checkpointed)
        self._store = self.recorder.store
        self._window_open, self._completed, self._started = True, False, False
        self._current: _Step | None = None
        self._restored = self.recorder.restored_extra()   # a resumed run's or a replay's checkpoint: its draws ahead
        self._unfinished: tuple[int, SpikeEvent | None] | None = None   # a step ended whose checkpoint is due
        self._start = start

    def _note_opened(self) -> None:
        """What the store keeps of this process (rank 0), and the sharding of its state against the record's."""
        sharding = getattr(self._state, "sharding", None)   # FSDP2's or ZeRO-3's pieces, against the record's,
        if sharding is not None:                            # before any checkpoint
            note_sharding(self.store, self._record().manifest.sharding, sharding(self.world), self.rank)
        if self.rank == 0:
            note_environment(self.store, self._fingerprint, resumed=self._start.resume)
            self.store.update_manifest(placement=self._placement)
            self._mode.opened(self.store)

    @property
    def step(self) -> int | None:
        """The step being trained (inside `for step in loop.steps()`), else None."""
        return self._current.number if self._current else None

    @property
    def skipping(self) -> bool:
        """The current step is one the replay skips (yielded with yield_skipped=True)."""
        return self._current is not None and self._current.skipping

    @property
    def window(self) -> ReplaySpec | None:
        """In a replay, what it replays (its window, overrides, skipped steps, dropped samples); else None."""
        return self.start()._mode.window

    @property
    def overrides(self) -> ReplayOverrides:
        """A replay's overrides as the training process applies them (recorder/overrides.py): the built-in
        trainer's dropped samples and scoped learning rates; a recording's apply nothing."""
        return self.start()._mode.overrides

    @property
    def in_window(self) -> bool:
        """In a replay, whether the current step is in the window (where the overrides apply)."""
        return self.start()._mode.in_window()

    def recorded_ids(self, step: int) -> np.ndarray:
        """In a replay, the sample ids the record has for `step` (of its window or the fast-forward before
        it): (rank, micro-batch, sample)."""
        return self.start()._mode.recorded_ids(step)

    @property
    def last_loss(self) -> float:
        """The last step's loss, averaged over the ranks."""
        return self.start().recorder.last_loss

    # -- the loop ----------------------------------------------------------------------------------

    def __enter__(self) -> Loop:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def steps(self) -> Iterator[int]:
        """The steps to train: from 0 (or the restored checkpoint) to the end; in a replay, from the
        parent's checkpoint at or before the window to its last step. Steps a replay skips are not
        yielded (their schedule moves on). Call `log` once in every step. A script kept up between
        replays (recorder/serving.py) goes on with the next replay's steps, from its checkpoint, restored
        in place, after one or two steps from it that are trained and undone (`_settle`)."""
        self.start()
        yield from self._window()
        while self._serving is not None:
            self._end_window()
            job = self._serving.answer()
            if job is None:
                return
            self._open(Start("replay", Location.parse(job.store), job.lease, job.resume, by_replay_run=True))
            refused = yield from self._settle()
            if refused is not None:
                self._end_window()
                self._serving.answer(refused)   # the launcher starts the script afresh: no more jobs here
                return
            self._note_opened()
            yield from self._window()

    def _window(self) -> Iterator[int]:
        """The steps of the run, or of the replay, that the loop writes now."""
        self._lookahead = len(self._ahead)
        self._check_lookahead()
        start = self.recorder.start()
        self._warn_ddp_layout(start)
        self._started = True
        self._mode.started(start)
        for step in range(start, self._mode.recorder_config.total_steps):
            self._finish()   # the last step's checkpoint, which its log left due
            skipping = self._mode.begin(step)
            if skipping and not self._yield_skipped:   # its batches, drawn ahead, are the next trained step's
                self._current = _Step(step, skipping=True)
            else:
                self._current, self._ahead = _Step(step, skipping=skipping, draws=self._ahead), []
            if self._current.skipping and not self._yield_skipped:
                self._skip(step_scheduler=True)
                continue
            self._begin_trace(step)
            yield step
            if not self._current.logged:
                raise UsageError(f"step {step} ended without loop.log(loss=...): call it once in every step")
        self._complete()

    def _begin_trace(self, step: int) -> None:
        """The step a `replay diff` of the run asks this rank to trace (recorder/step_trace.py), traced until its
        `log`."""
        request = self._mode.window.trace if self._mode.window is not None else None
        if request is not None and request.step == step and request.rank == self.rank:
            self._trace = StepTrace(request, self.model, self.optimizer, self.attention)

    def _end_trace(self) -> None:
        if self._trace is not None:
            trace, self._trace = self._trace, None
            trace.end()

    def _settle(self) -> Generator[int, None, str | None]:
        """A served replay's first steps: the script holds the batches it drew ahead for the last replay's next
        step. A step from the replay's checkpoint whose draws ahead get the recorded ids of the checkpoint's own
        step ("prime": trained on the stale batches, undone) leaves the script holding what a fresh start draws
        before its first step; then that step is trained again from the checkpoint ("check"), its state after
        the update compared with the record's on every rank, and undone. Returns why the script cannot serve the
        replay warm (its state is not the record's: it keeps state of its own), else None."""
        why = self._unservable()
        if why is not None:
            return why
        step = self.recorder.first_step()
        same = True
        for kind in ("prime", "check") if self._lookahead else ("check",):
            self.recorder.reload()
            if kind == "prime" or not self._lookahead:   # a loader's stream: from the checkpoint's position
                self._reposition(skips=False)
            self._current, self._ahead = _Step(step, skipping=False, draws=self._ahead, settling=kind), []
            yield step
            if not self._current.logged:
                raise UsageError(f"step {step} ended without loop.log(loss=...): call it once in every step")
            if kind == "check":
                same = self._as_recorded(step)
        self._current = None
        if not self._lookahead:
            self._reposition(skips=True)
        if not same:
            return (f"its state after step {step}, trained again from checkpoint {step} in the running script, is not "
                    "the record's: the script keeps state of its own that the loop does not restore (an EMA, a "
                    "counter, a generator)")
        return None

    def _reposition(self, skips: bool) -> None:
        """A loader's stream started again from the position the replay's checkpoint holds, passing over the
        batches of the steps the replay skips (`skips`) or not (the steps of `_settle`)."""
        if self._loader is not None:
            assert self._restored is not None, "a replay starts from a checkpoint"
            self._loader.reposition(self._restored["loader"], self._schedule(skips))

    def _unservable(self) -> str | None:
        """Why the next replay cannot be served by this process as it is, before any step."""
        if self._start.resume:
            return "a resumed replay restores its own checkpoint"
        if self._loader is not None and (self._restored or {}).get("loader") is None:
            return "the checkpoint it starts from holds no position of the loader's stream"
        if self._lookahead > len(self._mode.recorded_batches(self.recorder.first_step())):
            return "the script draws more batches ahead than a step trains on"
        if self._yield_skipped:
            return "a trainer of its own drives its steps (the Trainer's callback): the loop cannot restart them"
        digests = self._record().digests
        step = self.recorder.first_step()
        if digests is None or step < digests.since:
            return f"the record holds no state digests at step {step} to check a warm start against"
        return None

    def _as_recorded(self, step: int) -> bool:
        """This state is the record's after `step`, on every rank (its digests)."""
        recorded = self._record()
        digest = self.recorder.digest()
        row = recorded.read_steps(["state_digest"], start=step, stop=step + 1)["state_digest"][0][self.rank]
        info = recorded.digests
        same = (info is not None and info.names == self.recorder.digest.names and info.kind == self.recorder.digest.kind
                and np.array_equal(row[:len(digest)], digest))
        return _on_every_rank(same)

    def _complete(self) -> None:
        """Every step is recorded: its last checkpoint, the store's completion (rank 0)."""
        self._finish()
        self._current = None
        self.recorder.flush()
        if self.rank == 0:
            complete_run(self.store)
        self._completed = True

    def _warn_ddp_layout(self, start: int) -> None:
        """A DDP of the script's over 3 or more ranks, started past step 0, reduces its first step in its
        first-iteration bucket layout where the uninterrupted run's had rebuilt it (docs/determinism-and-
        faults.md): the last bits may differ. The built-in trainer rebuilds first; a script is told."""
        if start > 0 and self.rank == 0 and isinstance(self.model, torch.nn.parallel.DistributedDataParallel) \
                and self.world >= 3:
            print(f"warning: this run starts at step {start} on a fresh DDP over {self.world} ranks, which reduces "
                  "its first step in DDP's first-iteration bucket layout, not the rebuilt one the recording had "
                  "there: the last bits may differ from the record; run one forward and backward through the DDP "
                  "and drop its gradients before the first step to match (docs/determinism-and-faults.md)",
                  file=sys.stderr, flush=True)

    def sample_ids(self, ids):
        """This micro-batch's sample ids as the loader drew them (a tensor, array or list: random offsets,
        indices into a dataset); call it for every training micro-batch, in the step that trains on it or
        ahead of it (a prefetch: ids drawn before the first step, and as many at the end of each step, belong
        to the next step). Returns them unchanged in a recording; in a replay, the recorded ids (as the same
        type), after checking that the loader drew the same ones, which it does when its randomness comes
        from the recorded RNG states. Evaluation draws (the model in eval(), under torch.no_grad(), or in
        `with loop.evaluating():`) are returned as they are, neither recorded nor replaced."""
        if self._is_evaluating():
            return ids
        self.start()
        if self._loader is not None:
            raise UsageError("loop.sample_ids(...) and loop.loader(...) in one loop: pass the training batches "
                             "through one of them")
        drawn = np.asarray(ids.detach().cpu() if isinstance(ids, torch.Tensor) else ids, dtype=np.int64)
        recorded = self._draw(_Draw(drawn))
        if recorded is None:
            return ids
        if isinstance(ids, torch.Tensor):
            return torch.as_tensor(recorded, dtype=ids.dtype, device=ids.device)
        return recorded.tolist() if isinstance(ids, list) else recorded.astype(np.asarray(ids).dtype)

    def loader(self, dataloader: torch.utils.data.DataLoader, *, state: bool = True) -> RecordedLoader | StreamLoader:
        """The training batches from a `DataLoader` over a map-style dataset (any sampler, batch sampler,
        worker processes, prefetch, persistent workers): each batch the script takes is recorded by its
        dataset indices, and a replay or a resumed run continues the loader's stream where the checkpoint
        left it (recorder/loader.py). An endless stream: iterate it with next() or a for loop; it starts each
        epoch itself, calling the sampler's set_epoch(epoch) when it has one. Over an `IterableDataset` (a
        stream, torchdata's StatefulDataLoader too) each sample is recorded by its place in the stream and a
        digest of its contents, which a replay checks (recorder/stream.py); a stream continues from the loader's
        state_dict() where it has one, or with `state=False` by drawing its pass again to the position."""
        self.start()
        if self._loader is not None:
            raise UsageError("loop.loader(...) is called once: one training loader per loop")
        restored = (self._restored or {}).get("loader")
        if self._restored is not None and restored is None:
            raise UsageError("loop.loader(...): the checkpoint this run starts from was recorded without a loader "
                             "(its batches went through loop.sample_ids): run the script as it was recorded")
        if isinstance(getattr(dataloader, "dataset", None), torch.utils.data.IterableDataset):
            self._loader = StreamLoader(dataloader, self._took, follows=lambda: self._mode.follows_record, state=state)
        else:
            self._loader = RecordedLoader(dataloader, self._took, seed=torch.initial_seed(),
                                          tell=not self.replaying and self.rank == 0,
                                          follows=lambda: self._mode.follows_record)
        if restored is not None:
            self._loader.restore(restored, self._schedule())
        return self._loader

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Draws in this block are not training: neither recorded nor replaced (the model in eval() mode or
        torch.no_grad() say the same)."""
        self._evaluating += 1
        try:
            yield
        finally:
            self._evaluating -= 1

    def _is_evaluating(self) -> bool:
        return bool(self._evaluating) or not torch.is_grad_enabled() or not self.model.training

    def _took(self, batch: Batch | StreamBatch) -> None:
        if self._is_evaluating():
            raise UsageError("a batch of the training loader (loop.loader) was taken for an evaluation: its stream "
                             "is the training's; evaluate with a DataLoader of its own")
        self._draw(_Draw(batch.ids, batch))

    def _draw(self, draw: _Draw) -> np.ndarray | None:
        """Note a training micro-batch where it belongs (this step's, or the next's when drawn ahead); returns the
        ids a replay trains on instead, or None."""
        if self._current is None and self._started:
            raise UsageError("a training batch is drawn after the loop's last step: draw them inside "
                             "`for step in loop.steps()`, or just before it")
        if self._current is not None and self._current.settling:
            return self._settling_draw(self._current, draw)
        where: int | None = None if self._current is None else self._current.number
        draws = self._ahead if self._current is None else self._current.draws   # ahead of the first step, or in it
        step, micro = self._belongs(where, len(draws))
        # what the record drew here, from the same RNG states (no skipped step passed yet); none before the first
        # step, whose draws come before its checkpoint's RNG states are restored
        drawn_as = None if where is None else self._belongs(where, len(draws), skipping=False)
        draws.append(draw)
        if draw.batch is not None:   # its ids are the loader's, checked against the record where it sampled them
            if draw.batch.scheduled is not None and draw.batch.scheduled != (step, micro):
                raise ReplayError(f"the script trains step {step}'s micro-batch {micro} on the loader's batch of "
                                  f"step {draw.batch.scheduled[0]}'s micro-batch {draw.batch.scheduled[1]}: it does "
                                  "not take as many batches per step as it did in the record: run the script and "
                                  f"settings it was recorded with (`replay info {self._record().location}` shows them)")
            return None
        if where is None and self._restored is not None and not self.replaying:   # a resumed run's prefetch
            carried = self._restored.get("ahead", [])
            if micro >= len(carried):
                raise UsageError(f"the script draws {micro + 1} batch(es) before the first step; the run it resumes "
                                 f"drew {len(carried)}: run the script as it was recorded")
            draw.ids = np.asarray(carried[micro])
            return draw.ids
        recorded = self._mode.sample(step, micro, draw.ids, drawn_as)
        if recorded is not None:
            draw.ids = recorded
        return recorded

    def _settling_draw(self, now: _Step, draw: _Draw) -> np.ndarray | None:
        """A draw in a step of `_settle`: the recorded micro-batches of its step, in order (the steps the replay
        skips play no part in them), then those drawn past them (ahead): the step's first again after "prime",
        what a fresh start draws before its first step after "check" (past the steps the replay skips). Ids
        handed out, or a loader's batches as its stream yields them, the stream started again from the
        checkpoint's position where the draws ahead begin."""
        batches = self._mode.recorded_batches(now.number)
        index = len(now.draws)
        if draw.batch is not None:
            now.draws.append(draw)
            if self._lookahead and len(now.draws) == len(batches):
                self._reposition(skips=now.settling == "check")
            return None
        if index >= len(batches) and now.settling == "check":
            step, micro = self._belongs(None, index - len(batches))
            recorded = self._mode.recorded_batches(step)[micro]
        else:
            recorded = batches[index % len(batches)]
        if recorded.size != draw.ids.size:
            raise ReplayError(f"step {now.number}: the script draws a micro-batch of {draw.ids.size} samples, the "
                              f"record has {[len(b) for b in batches]}: run the script and settings it was recorded "
                              f"with (`replay info {self._record().location}` shows them)")
        draw.ids = recorded.reshape(draw.ids.shape)
        now.draws.append(draw)
        return draw.ids

    def _record(self) -> RunStore:
        """The store of the run as recorded: a replay's parent, or this run's own."""
        return self._mode.parent if isinstance(self._mode, Replaying) else self.store

    def _belongs(self, step: int | None, index: int, skipping: bool = True) -> tuple[int, int]:
        """A replay: the recorded (step, micro-batch) that the `index`-th draw of `step` (None: ahead of the
        first step) trains. Draws past a step's micro-batches (a prefetch) are the next trained step's first
        (`skipping`: past the steps the replay skips). In a recording the count of a step's micro-batches is
        known at `log` only: (step, index) as drawn."""
        window = self._mode.window
        if window is None:
            return (-1 if step is None else step), index
        if step is None:
            step = self.recorder.first_step()   # the start checkpoint's, or a resumed replay's own last
        else:
            trained = len(self._mode.recorded_batches(step))
            if index < trained:
                return step, index
            step, index = step + 1, index - trained
        while skipping and step in window.skip:
            step += 1
        return step, index

    def _check_lookahead(self) -> None:
        if self._restored is None or self._loader is not None:
            return
        ahead = len(self._restored.get("ahead", []))
        if len(self._ahead) != ahead:
            raise UsageError(f"the script drew {len(self._ahead)} batch(es) before the first step; the checkpoint it "
                             f"starts from has {ahead} drawn ahead: run the script as it was recorded")

    def _schedule(self, skips: bool = True) -> list[Scheduled]:
        """A replay: the record's batches from the checkpoint it restores to its window's end, in stream order,
        those of the steps it skips marked so (`skips`)."""
        window = self._mode.window
        if window is None:
            return []
        streamed = isinstance(self._loader, StreamLoader)
        return [Scheduled(step, micro, ids, skips and step in window.skip, digests)
                for step in range(self.recorder.first_step(), window.stop + 1)
                for micro, (ids, digests) in enumerate(zip(
                    self._mode.recorded_batches(step),
                    self._mode.recorded_digests(step) if streamed else itertools.repeat(None), strict=False))]

    def _checkpointed(self) -> dict[str, Any]:
        """What every checkpoint keeps of the loop: the draws ahead of the step it starts (a prefetch), and the
        training loader's position for that step."""
        out: dict[str, Any] = {"ahead": [d.ids for d in self._ahead if d.batch is None]}
        if isinstance(self._loader, StreamLoader):
            out["loader"] = self._loader.position([d.batch for d in self._ahead if isinstance(d.batch, StreamBatch)])
        elif self._loader is not None:
            out["loader"] = self._loader.position([d.batch for d in self._ahead if isinstance(d.batch, Batch)])
        if self._driver_state is not None:
            out["driver"] = self._driver_state()
        return out

    @property
    def restored_driver_state(self) -> dict[str, Any] | None:
        """What `driver_state()` gave when the checkpoint this run starts from was taken; None for a new run."""
        return (self.start()._restored or {}).get("driver")

    def log(self, loss, grad_norm=float("nan"), lr: float | None = None, tokens: int = 0,
            numerics: dict[str, np.ndarray] | None = None) -> SpikeEvent | None:
        """End the step: this rank's loss (a float or a tensor; one per recorded rank this process plays, under
        `replay run --ranks`), the gradient norm before clipping and the
        learning rate (the optimizer's first group's by default); `numerics`, a row of per-layer attention
        numerics (replay.kernels.numerics). Returns the spike the detector saw at this step, if any."""
        now = self._current
        if now is None or now.logged:
            raise UsageError("loop.log(...) is called once in every step of `for step in loop.steps()`")
        trained = len(now.draws) - self._lookahead   # the last ones drawn are the next step's (a prefetch)
        if trained < 1:
            raise UsageError(f"step {now.number} drew no training batch: pass every training micro-batch's sample ids "
                             "through loop.sample_ids(...), or take its batches from loop.loader(...)")
        now.logged = True
        self._end_trace()
        self._ahead = now.draws[trained:]
        if now.settling:   # trained to be undone (`_settle`): nothing of it is recorded
            return None
        if self.replaying:   # handed out at each draw, or carried from before the step: the record's, in order
            recorded = self._mode.recorded_batches(now.number)
            if len(recorded) != trained:
                raise ReplayError(f"step {now.number}: the script trains {trained} micro-batch(es), the record "
                                  f"{len(recorded)}: run the script and settings it was recorded with (`replay info "
                                  f"{self._record().location}` shows them)")
            assert all(np.array_equal(d.ids.reshape(-1), r.reshape(-1)) for d, r in zip(now.draws, recorded,
                                                                                     strict=False)), \
                f"step {now.number} trained on other samples than the record's"
        self._mode.check_step(autocast_used=now.autocast)
        lr = self.optimizer.param_groups[0]["lr"] if lr is None else lr
        streamed = None
        if isinstance(self._loader, StreamLoader):   # every draw is the stream's (loop.sample_ids refuses otherwise)
            streamed = [d.batch.digests for d in now.draws[:trained] if isinstance(d.batch, StreamBatch)]
            assert len(streamed) == trained, "a stream's step draws from the stream only"
        event = self.recorder.record_step(now.number, sample_ids=[d.ids.reshape(-1) for d in now.draws[:trained]],
                                          loss=_losses(loss), grad_norm=_number(grad_norm), lr=float(lr),
                                          tokens=int(tokens), numerics=numerics, counts=self._mode.counted(),
                                          finish=False, sample_digests=streamed)
        self._mode.reached(now.number, self.recorder.counted)
        # checkpointed when the next step begins (or at close): it must hold what the script does after log
        self._unfinished = (now.number, event)
        if self._autocast is not None:
            self._note_autocast(self._autocast)
        return event

    def _note_autocast(self, seen: AutocastSeen) -> None:
        """The autocast the first training forward ran under, into the run's environment (rank 0)."""
        seen.close()
        self._autocast = None
        if self.rank == 0 and seen.value is not None:
            note_environment(self.store, {**self._fingerprint, "autocast": seen.value}, resumed=self.recorder.resume)

    def log_skipped(self) -> None:
        """End a step the replay skips, which the driver ran without its update (`yield_skipped=True`)."""
        if self._current is None or self._current.logged or not self._current.skipping:
            raise UsageError("loop.log_skipped() ends a step the replay skips: call it once, in a step where "
                             "loop.skipping is true, instead of loop.log(...)")
        self._skip(step_scheduler=False)

    def _skip(self, step_scheduler: bool) -> None:
        """A skipped step: no training; the scheduler moves on as if it had trained (stepped here, or by
        the driver that ran the step without its update)."""
        now = self._current
        assert now is not None and now.skipping, "a step the replay skips is in progress"
        now.logged = True
        self.recorder.record_skipped(now.number, sample_ids=self._mode.skip(now.number),
                                     lr=self.optimizer.param_groups[0]["lr"],
                                     numerics=self._skipped_numerics() if self._skipped_numerics else None,
                                     finish=False, streamed=isinstance(self._loader, StreamLoader))
        if step_scheduler and self.scheduler is not None:
            self.scheduler.step()
        self._unfinished = (now.number, None)   # checkpointed when the next step begins: with the scheduler's step

    def _finish(self) -> None:
        """The checkpoint (on the cadence) of the step that ended last, if it is still due."""
        if self._unfinished is not None:
            step, event = self._unfinished
            self._unfinished = None
            self.recorder.finish_step(step, event)

    def autocast(self, device_type: str) -> _Autocast:
        """The context the forward runs under: autocast to the run's precision (none for fp32), or to a
        replay's --precision from the window on. Reusable: make it once, enter it every micro-batch."""
        self.start()
        return _Autocast(device_type, self._autocast_precision)

    def _autocast_precision(self) -> str:
        if self._current is not None:
            self._current.autocast = True
        return self._mode.precision()

    def close(self) -> None:
        """Flush the store and release what the loop holds (the `with` block does it; at the interpreter's exit,
        a loop not closed is closed, so that nothing it recorded is lost). A loop left by a `break` after the
        log of its last step (minGPT's own `max_iters` check) is complete; left earlier, it is not."""
        if self._closed:
            return
        self._closed = True
        try:
            self._end_window()
        finally:
            if self._loader is not None:
                self._loader.close()

    def _end_window(self) -> None:
        """Everything of the run (or replay) written now on disk, and the mode's changes to the model taken
        back."""
        if not self._window_open:
            return
        self._window_open = False
        try:
            last = self._current
            if not self._completed and last is not None and last.logged and last.settling is None \
                    and last.number == self._mode.recorder_config.total_steps - 1:
                self._complete()
            self._finish()   # a loop left after its last log (a `break`): that step's checkpoint is still due
            self.recorder.close()
        finally:
            try:
                self._end_trace()   # a step left while traced (an error): its hooks out before the mode's plan
            finally:
                self._mode.close()


class _Autocast:
    """`loop.autocast(device_type)`: asks the loop for the precision at every entry."""

    def __init__(self, device_type: str, precision: Callable[[], str]):
        self.device_type, self._precision = device_type, precision
        self._inner: Any = None

    def __enter__(self) -> Any:
        dtype = PRECISIONS[self._precision()]
        self._inner = torch.autocast(self.device_type, dtype=dtype) if dtype else contextlib.nullcontext()
        return self._inner.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self._inner.__exit__(*exc)


def _mode_for(start: Start, loop: Loop) -> Mode:
    """The mode a loop started as `start` runs in (recorder/modes.py): recording, or replaying a window."""
    if start.mode == "replay":
        return Replaying(start, loop._played, loop.optimizer, loop.scheduler, loop._apply_attention)
    return Recording(start, unwrap(loop.model), loop._options, loop.rank, loop.world)


def _rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size: the initialised process group's (Lightning's launcher, for one,
    sets no RANK), checked against torchrun's variables where they are set; one process without a group."""
    env = {k: int(os.environ[k]) for k in ("RANK", "WORLD_SIZE") if k in os.environ}
    if not dist.is_initialized():
        if env.get("WORLD_SIZE", 1) > 1:
            raise UsageError("WORLD_SIZE > 1: call torch.distributed.init_process_group() before Loop(...)")
        return 0, 1
    group = {"RANK": dist.get_rank(), "WORLD_SIZE": dist.get_world_size()}
    if any(env[k] != group[k] for k in env):
        raise UsageError(f"this process is rank {group['RANK']} of {group['WORLD_SIZE']} in its process group, but "
                         f"RANK and WORLD_SIZE say {env.get('RANK')} of {env.get('WORLD_SIZE')}: start the ranks with "
                         "one launcher, or unset the variables left from another job")
    return group["RANK"], group["WORLD_SIZE"]


def _played_ranks(start: Start, rank: int, world: int) -> range:
    """The recorded ranks this process plays: its own, or, in a replay on fewer processes than the record's
    ranks (`replay run --ranks`, train/fewer_ranks.py), its consecutive share of them."""
    if start.mode != "replay":
        return range(rank, rank + 1)
    replay = RunStore.open(start.store).manifest
    processes = replay.replay_spec.processes
    if processes is None or processes == replay.world_size:
        return range(rank, rank + 1)
    assert processes == world, "a replay on fewer processes runs as many as its spec says"
    per = replay.world_size // processes
    return range(rank * per, (rank + 1) * per)


def _losses(loss: Any) -> float | list[float]:
    return [_number(x) for x in loss] if isinstance(loss, (list, tuple)) else _number(loss)


def _train_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                 scaler: Any) -> TrainState:
    # A model fully_shard'ed by FSDP2 has DTensor parameters, which exist only once torch.distributed.tensor
    # is imported: FSDP2's state, and its half a second of imports, only then.
    if "torch.distributed.tensor" in sys.modules:
        from replay.recorder.fsdp import FSDP2TrainState, is_fsdp2

        if is_fsdp2(model):
            return FSDP2TrainState(model, optimizer, scheduler, scaler)
    return TorchTrainState(model, optimizer, scheduler, scaler)


def _attention_applier(model: torch.nn.Module, pattern: str | None) -> Callable[[AttentionPlan, AttentionReach], Any]:
    """How a replay puts its attention plan into the model: through transformers' AttentionInterface for a
    transformers model (per query head, grouped-query attention included), else by routing the SDPA calls
    of its attention modules (kernels/sdpa_dispatch.py)."""
    model = unwrap(model)
    inner = transformers_model_in(model) if pattern is None else None
    if inner is not None:
        return lambda plan, reach: apply_plan(inner, plan, reach)
    return lambda plan, reach: sdpa_dispatch(model, plan, pattern, reach)


def _number(x: Any) -> float:
    if hasattr(x, "full_tensor"):   # a DTensor (FSDP2's gradient norm): its value on every rank
        x = x.full_tensor()
    return float(x.detach()) if isinstance(x, torch.Tensor) else float(x)


def _on_every_rank(true: bool) -> bool:
    """Whether `true` holds on every rank of the process group (one small all-reduce)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return true
    flag = torch.tensor([int(true)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
