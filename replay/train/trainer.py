"""The built-in GPT-2 trainer: what `replay record` runs on every rank. Read it top to bottom.

The config comes from the store's manifest (written before any rank starts), so a rank needs only the
store path; the same code trains with one process, local torch.distributed ranks or DeepSpeed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from replay.config import RunConfig
from replay.recorder.environment import configure_determinism, fingerprint, seed_everything
from replay.recorder.recorder import Recorder, RecorderConfig
from replay.store import RunStore
from replay.store.lease import require
from replay.train.data import DataOrder, TokenData, load_data
from replay.kernels.numerics import NumericsProbe
from replay.kernels.registry import AttentionPlan, apply_plan, raise_deferred
from replay.train.counterfactual import ScopedUpdate, keep_mask, kept_weight
from replay.train.model import build_model, lm_loss, lr_factor
from replay.recorder.state import DeepSpeedTrainState, TorchTrainState


@dataclass
class Rank:
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @classmethod
    def from_env(cls, cfg: RunConfig) -> "Rank":
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
        device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
        return cls(rank, world, local_rank, device)



def init_distributed(r: Rank, cfg: RunConfig) -> None:
    if r.device.type == "cuda":
        torch.cuda.set_device(r.device)
    if cfg.launcher == "deepspeed":
        import deepspeed
        import deepspeed.ops

        # DeepSpeed would otherwise compile its shared-memory all-reduce (a C++ build, about 40 s on each new
        # machine) for inference collectives that training never calls: gloo does every reduction here.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="nccl" if r.device.type == "cuda" else "gloo")
    elif r.world > 1 and not dist.is_initialized():   # warm ranks (launch/pool.py) keep theirs
        dist.init_process_group("nccl" if r.device.type == "cuda" else "gloo", device_id=None)


def train(store_path: str, lease: str, resume: bool = False, keep_group: bool = False) -> None:
    """Train (or resume, or replay) the run in `store_path` as this rank, writing under `lease` (the spec of
    the launching command's lease: store/lease.py)."""
    require(lease)
    store = RunStore.open(store_path, mode="a")
    cfg = store.manifest.config
    r = Rank.from_env(cfg)
    configure_determinism(cfg.threads)
    seed_everything(cfg.seed)
    init_distributed(r, cfg)
    if r.rank == 0:
        env = fingerprint(r.device)
        if resume:
            resumes = store.manifest.resumes
            store.update_manifest(resumes=[*resumes[:-1], dataclasses.replace(resumes[-1], environment=env)])
        else:
            store.update_manifest(environment=env)
    try:
        _train(store, cfg, r, resume, lease)
    finally:
        if dist.is_initialized() and not keep_group:
            dist.destroy_process_group()


@dataclass
class Schedule:
    """Which steps to train and on which samples: the seeded data order of a new recording, or, for a
    replay, exactly the sample ids its parent run recorded, from the parent's checkpoint."""

    stop: int
    checkpoint_every: int
    snapshot_every: int
    parent: RunStore | None = None       # replays only
    start_checkpoint: int = 0
    recorded_ids: np.ndarray | None = None
    skip: frozenset[int] = frozenset()   # steps whose batches are not trained on
    lr_scale: float = 1.0                # of the whole model (at `from`)
    drop: dict[int, frozenset[int]] = field(default_factory=dict)   # step -> sample ids left out
    lr_scope: dict | None = None         # where lr_scale applies, if not the whole model
    override_from: int = 0               # replays: the recorded config until this step (the fast-forward)
    recorded_cfg: RunConfig | None = None

    @classmethod
    def for_store(cls, store: RunStore, cfg: RunConfig) -> "Schedule":
        spec = store.manifest.replay
        if spec is None:
            return cls(cfg.steps, cfg.checkpoint_every, cfg.snapshot_every)
        parent = RunStore.open(store.path / spec.parent)
        stop = spec.stop + 1
        ids = parent.read_steps(["sample_ids"])["sample_ids"]
        drop: dict[int, set[int]] = {}
        for step, sample in spec.drop:
            drop.setdefault(step, set()).add(sample)
        return cls(stop, spec.checkpoint_every or stop + 1, 0, parent=parent,   # 0: only the checkpoint at the end
                   start_checkpoint=spec.start_checkpoint, recorded_ids=ids, skip=frozenset(spec.skip),
                   drop={k: frozenset(v) for k, v in drop.items()},
                   lr_scale=1.0 if spec.lr_scope else float(spec.overrides.get("lr_scale", 1.0)),
                   lr_scope=spec.lr_scope, override_from=spec.start, recorded_cfg=parent.manifest.config)

    def ids(self, order: DataOrder, step: int, r: Rank, micro_batch_size: int) -> np.ndarray:
        if self.recorded_ids is None:
            return order.rank_ids(step, r.rank, r.world, micro_batch_size)
        return self.recorded_ids[step, r.rank]


def _train(store: RunStore, cfg: RunConfig, r: Rank, resume: bool, lease: str) -> None:
    schedule = Schedule.for_store(store, cfg)
    data = load_data(cfg, schedule.parent or store)
    active = schedule.recorded_cfg or cfg   # a replay fast-forwards as recorded, then switches at `from`
    model = build_model(active.model, data.vocab_size, cfg.seed).to(r.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                  eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, functools.partial(lr_factor, cfg=cfg.optim, total_steps=cfg.steps))
    if cfg.launcher == "deepspeed":
        engine = _deepspeed_engine(cfg, model, optimizer, scheduler)
        state, step_fn = DeepSpeedTrainState(engine), functools.partial(_deepspeed_step, engine, data, r)
        optimizer, scheduler = engine.optimizer, engine.lr_scheduler
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model) if r.world > 1 else model
        state = TorchTrainState(ddp, optimizer, scheduler)
        step_fn = functools.partial(_torch_step, ddp, optimizer, scheduler, data, r)

    start_from = (schedule.parent, schedule.start_checkpoint) if schedule.parent and not resume else None
    recorder = Recorder(str(store.path), state, rank=r.rank, world_size=r.world, resume=resume, start_from=start_from,
                        lease=lease,
                        cfg=RecorderConfig(total_steps=schedule.stop, checkpoint_every=schedule.checkpoint_every,
                                           snapshot_every=schedule.snapshot_every, snapshot_ring=cfg.snapshot_ring,
                                           spike=cfg.spike))
    start = recorder.start()
    probe = NumericsProbe(model) if cfg.numerics else None
    order = DataOrder(data.n_samples, cfg.batch_size, cfg.seed)
    scoped = None   # a scoped lr_scale, from `from` on
    t0 = time.perf_counter()
    for step in range(start, schedule.stop):
        if active is not cfg and step >= schedule.override_from:
            # a resumed replay past `from` restored already-scaled learning rates with its state
            lr_scale = schedule.lr_scale if step == schedule.override_from else 1.0
            active = _switch_to_overrides(model, optimizer, scheduler, cfg, lr_scale)
            if schedule.lr_scope:
                scoped = ScopedUpdate(model, schedule.lr_scope)
        ids = schedule.ids(order, step, r, cfg.micro_batch_size)
        if step in schedule.skip:   # not trained on; the schedule moves on as if the batch had been seen
            recorder.record_skipped(step, sample_ids=ids, lr=scheduler.get_last_lr()[0],
                                    numerics=probe.skipped() if probe else None)
            scheduler.step()
            continue
        dropped = schedule.drop.get(step, frozenset())
        weight = kept_weight(schedule.recorded_ids[step], dropped) if dropped else 1.0
        with probe.collecting() if probe else contextlib.nullcontext():
            loss, grad_norm, lr = step_fn(active, ids, dropped, weight, scoped)
        raise_deferred()
        event = recorder.record_step(step, sample_ids=ids, loss=loss, grad_norm=grad_norm, lr=lr,
                                     tokens=ids.size * cfg.model.block_size,
                                     numerics=probe.end_step() if probe else None)
        if r.rank == 0 and (event or (step + 1) % cfg.log_every == 0 or step + 1 == schedule.stop):
            rate = (step + 1 - start) / (time.perf_counter() - t0)
            note = f"  SPIKE (robust z {event.score:.1f})" if event else ""
            print(f"step {step:>6}  loss {recorder.last_loss:8.4f}  "
                  f"grad-norm {grad_norm:9.4f}  lr {lr:.2e}  {rate:6.1f} steps/s{note}", file=sys.stderr, flush=True)
    recorder.close()
    if r.rank == 0:
        store.update_manifest(status="complete", steps_recorded=store.n_steps)


def _switch_to_overrides(model, optimizer, scheduler, cfg: RunConfig, lr_scale: float) -> RunConfig:
    """A replay reaching its window: from here on, the overridden attention plan, precision and LRs."""
    apply_plan(model, AttentionPlan.parse(cfg.model.attention))
    if lr_scale != 1.0:
        scheduler.base_lrs = [lr * lr_scale for lr in scheduler.base_lrs]
        for group in optimizer.param_groups:
            group["lr"] *= lr_scale
    return cfg


def _torch_step(model, optimizer, scheduler, data: TokenData, r: Rank, cfg: RunConfig, ids: np.ndarray,
                dropped: frozenset[int], weight: float, scoped: ScopedUpdate | None) -> tuple[float, float, float]:
    """One optimizer step over this rank's micro-batches: (mean loss, grad norm before clipping, lr)."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    accum = len(ids)
    total = torch.zeros((), dtype=torch.float32, device=r.device)
    for m, micro in enumerate(ids):
        x, y = (t.to(r.device) for t in data.batch(micro))
        sync = m == accum - 1 or not isinstance(model, torch.nn.parallel.DistributedDataParallel)
        with (contextlib.nullcontext() if sync else model.no_sync()):
            with _autocast(cfg, r):
                loss = lm_loss(model, x, y, keep_mask(micro, dropped))
                loss = loss * weight if dropped else loss   # counterfactual.py: the mean over kept samples
            (loss / accum).backward()
        total += loss.detach()
    max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    lr = scheduler.get_last_lr()[0]
    scoped.step(optimizer) if scoped else optimizer.step()
    scheduler.step()
    return float(total / accum), float(grad_norm), lr


def _autocast(cfg: RunConfig, r: Rank):
    if cfg.precision == "bf16":
        return torch.autocast(r.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _deepspeed_engine(cfg: RunConfig, model, optimizer, scheduler):
    import deepspeed

    # ZeRO allocates a reduce bucket each step (default 5e8 elements, 2 GB in FP32): size it to the model,
    # or a CPU rank spends its time page-faulting. Bucketing moves no arithmetic: the bits are unchanged.
    bucket = int(min(5e8, max(1 << 20, sum(p.numel() for p in model.parameters()))))
    ds_config = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage, "reduce_bucket_size": bucket,
                              "allgather_bucket_size": bucket},
        "bf16": {"enabled": cfg.precision == "bf16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed prints its config; keep stdout for progress
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=ds_config)
    return engine


def _deepspeed_step(engine, data: TokenData, r: Rank, cfg: RunConfig, ids: np.ndarray, dropped: frozenset[int],
                    weight: float, scoped: None) -> tuple[float, float, float]:
    assert not dropped and scoped is None, "refused for DeepSpeed by replayer/overrides.py"
    engine.train()
    total = torch.zeros((), dtype=torch.float32, device=r.device)
    lr = engine.lr_scheduler.get_last_lr()[0]
    for micro in ids:
        x, y = (t.to(r.device) for t in data.batch(micro))
        loss = lm_loss(engine, x, y)
        engine.backward(loss)   # DeepSpeed divides by the accumulation steps itself
        engine.step()           # steps the optimizer (and scheduler) at the accumulation boundary
        total += loss.detach()
    grad_norm = engine.get_global_grad_norm()
    return float(total / len(ids)), float(grad_norm if grad_norm is not None else math.nan), lr
