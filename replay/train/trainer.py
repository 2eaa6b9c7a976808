"""The built-in GPT-2 trainer: what `replay record` runs on every rank. Read it top to bottom.

The config comes from the store's manifest (written before any rank starts), so a rank needs only the
store path; the same code trains with one process, local torch.distributed ranks or DeepSpeed. It talks
to replay through the loop API (replay.recorder.Loop) only, as a script of the user's own does.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from replay.config import Launcher, RunConfig
from replay.kernels.numerics import NumericsProbe
from replay.kernels.registry import apply_plan, raise_deferred
from replay.recorder.environment import configure_determinism, rng_state, seed_everything, set_rng_state
from replay.recorder.loop import Loop
from replay.recorder.state import DeepSpeedTrainState, TorchTrainState
from replay.store import RunStore
from replay.store.lease import require
from replay.store.location import Location, Where
from replay.train.data import DataOrder, TokenData, load_data
from replay.train.fewer_ranks import PlayedRanks, played_step
from replay.train.model import build_model, lm_loss, lr_factor


@dataclass
class Rank:
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @classmethod
    def from_env(cls, cfg: RunConfig) -> Rank:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
        device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
        return cls(rank, world, local_rank, device)



def init_distributed(r: Rank, cfg: RunConfig) -> None:
    if r.device.type == "cuda":
        torch.cuda.set_device(r.device)
    if cfg.launcher is Launcher.DEEPSPEED:
        # lazy: DeepSpeed (1.3 s) is optional, for --launcher deepspeed only
        import deepspeed
        import deepspeed.ops

        # DeepSpeed would otherwise compile its shared-memory all-reduce (a C++ build, about 40 s on each new
        # machine) for inference collectives that training never calls: gloo does every reduction here.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="nccl" if r.device.type == "cuda" else "gloo")
    elif r.world > 1 and not dist.is_initialized():   # warm ranks (launch/pool.py) keep theirs
        dist.init_process_group("nccl" if r.device.type == "cuda" else "gloo", device_id=None)


def train(location: Where, lease: str, resume: bool = False, keep_group: bool = False) -> None:
    """Train (or resume, or replay) the run at `location` as this rank, writing under `lease` (the spec of
    the launching command's lease: store/lease.py)."""
    location = Location.parse(location)
    require(lease)
    store = RunStore.open(location)
    cfg = store.manifest.config
    r = Rank.from_env(cfg)
    configure_determinism(cfg.threads)
    seed_everything(cfg.seed)
    init_distributed(r, cfg)
    try:
        _train(store, cfg, r, resume, lease)
    finally:
        if dist.is_initialized() and not keep_group:
            dist.destroy_process_group()


def _train(store: RunStore, cfg: RunConfig, r: Rank, resume: bool, lease: str) -> None:
    """One client of the loop API (replay.recorder.Loop), like any script: the Loop restores, hands out the
    recorded sample ids in a replay, applies its overrides from `--from` on, and ends after the window."""
    spec = store.manifest.replay
    parent = RunStore.open(store.location.resolve(spec.parent)) if spec else None
    data = load_data(cfg, parent or store)
    recorded = parent.manifest.config if parent else cfg   # a replay builds the model as recorded
    # transformers types PreTrainedModel.to (a decorated method) as taking the model: a wrong stub
    model = build_model(recorded.model, data.vocab_size, cfg.seed).to(r.device)  # type: ignore[arg-type]
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                  eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, functools.partial(lr_factor, cfg=cfg.optim, total_steps=cfg.steps))
    state: DeepSpeedTrainState | TorchTrainState
    step_fn: Callable[..., tuple[float | list[float], float, float]]
    played = None   # `replay run --ranks N`: this process plays several recorded ranks (train/fewer_ranks.py)
    ddp: torch.nn.Module | None = None   # the plain path's: a DDP over several ranks, else the model
    ranks, world = [r.rank], r.world
    if spec and spec.processes and spec.processes < store.manifest.world_size:
        played = PlayedRanks(model, store.manifest.world_size, spec.processes, r.rank)
        ranks, world = list(played.ranks), played.world
        state, step_fn = TorchTrainState(played.ddp, optimizer, scheduler), functools.partial(
            played_step, played, optimizer, scheduler, data)
    elif cfg.launcher is Launcher.DEEPSPEED:
        engine = _deepspeed_engine(cfg, model, optimizer, scheduler)
        state, step_fn = DeepSpeedTrainState(engine), functools.partial(_deepspeed_step, engine, data, r)
        optimizer, scheduler = engine.optimizer, engine.lr_scheduler
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model) if r.world > 1 else model
        state = TorchTrainState(ddp, optimizer, scheduler)
        step_fn = functools.partial(_torch_step, ddp, optimizer, scheduler, data, r)
    probe = NumericsProbe(model) if cfg.numerics else None
    loop = Loop(store.location, model, optimizer, total_steps=cfg.steps, scheduler=scheduler, state=state,
                lease=lease, resume=resume, apply_attention=lambda plan, reach: apply_plan(model, plan, reach),
                skipped_numerics=probe.skipped if probe else None)
    order = DataOrder(data.n_samples, cfg.batch_size, cfg.seed)
    t0 = time.perf_counter()
    with loop:
        start = None
        for step in loop.steps():
            start = step if start is None else start
            ids = np.stack([loop.sample_ids(micro) for rank in ranks
                            for micro in order.rank_ids(step, rank, world, cfg.micro_batch_size)])
            # a replay or resume of 3 or more ranks (with 2, a + b == b + a: the layout cannot change the bits)
            if isinstance(ddp, torch.nn.parallel.DistributedDataParallel) and r.world > 2 and step == start > 0:
                _rebuild_buckets(ddp, data, r, loop, ids[0])
            with probe.collecting() if probe else contextlib.nullcontext():
                loss, grad_norm, lr = step_fn(loop, ids)
            raise_deferred()
            event = loop.log(loss, grad_norm=grad_norm, lr=lr, tokens=ids.size * cfg.model.block_size,
                             numerics=probe.end_step() if probe else None)
            last = step + 1 == (spec.stop + 1 if spec else cfg.steps)
            if r.rank == 0 and (event or (step + 1) % cfg.log_every == 0 or last):
                rate = (step + 1 - start) / (time.perf_counter() - t0)
                note = f"  SPIKE (robust z {event.score:.1f})" if event else ""
                print(f"step {step:>6}  loss {loop.last_loss:8.4f}  "
                      f"grad-norm {grad_norm:9.4f}  lr {lr:.2e}  {rate:6.1f} steps/s{note}",
                      file=sys.stderr, flush=True)


def _rebuild_buckets(ddp: torch.nn.parallel.DistributedDataParallel, data: TokenData, r: Rank, loop: Loop,
                     micro: np.ndarray) -> None:
    """Leave `ddp` reducing in the bucket layout an uninterrupted run has at any step past 0.

    DDP's first iteration lays its buckets out in parameter order; the next forward rebuilds them in the
    order the first backward's gradients became ready. gloo's ring sums each element over the ranks in an
    order set by its position in the bucket, so from 3 ranks on the layout changes the bits. The record
    reduced step 0 in the first layout and every later step in the rebuilt one; a DDP made at step k > 0
    must start in the rebuilt one. Torch builds that layout only from a backward it has seen, so: one
    forward and backward of a real micro-batch through `ddp` (its all-reduce included, on every rank),
    whose gradients are dropped, with every RNG put back. Parameters, optimizer, scheduler and the loop's
    step are untouched; the step's own first forward rebuilds the buckets, as the record's step 1 did."""
    rngs = rng_state()
    ddp.train()
    x, y = (t.to(r.device) for t in data.batch(micro))
    with loop.autocast(r.device.type):
        loss = lm_loss(ddp, x, y)
    loss.backward()
    ddp.zero_grad(set_to_none=True)
    set_rng_state(rngs)


def _torch_step(model, optimizer, scheduler, data: TokenData, r: Rank, loop: Loop,
                ids: np.ndarray) -> tuple[float, float, float]:
    """One optimizer step over this rank's micro-batches: (mean loss, grad norm before clipping, lr). A
    replay's samples left out and scoped learning rate are its overrides' (recorder/overrides.py)."""
    assert loop.step is not None, "inside loop.steps()"
    model.train()
    optimizer.zero_grad(set_to_none=True)
    accum = len(ids)
    total = torch.zeros((), dtype=torch.float32, device=r.device)
    weight = loop.overrides.loss_weight(loop.step, loop.recorded_ids(loop.step) if loop.replaying else ids)
    for m, micro in enumerate(ids):
        x, y = (t.to(r.device) for t in data.batch(micro))
        sync = m == accum - 1 or not isinstance(model, torch.nn.parallel.DistributedDataParallel)
        with (contextlib.nullcontext() if sync else model.no_sync()):
            with loop.autocast(r.device.type):
                loss = lm_loss(model, x, y, loop.overrides.kept(loop.step, micro))
                loss = loss * weight if weight != 1.0 else loss   # the mean over the step's kept samples
            (loss / accum).backward()
        total += loss.detach()
    max_norm = loop.cfg.optim.grad_clip if loop.cfg.optim.grad_clip > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    lr = scheduler.get_last_lr()[0]
    loop.overrides.optimizer_step(optimizer, model)
    scheduler.step()
    return float(total / accum), float(grad_norm), lr


def _deepspeed_engine(cfg: RunConfig, model, optimizer, scheduler):
    # lazy: optional, 1.3 s (see init_distributed)
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


def _deepspeed_step(engine, data: TokenData, r: Rank, loop: Loop, ids: np.ndarray) -> tuple[float, float, float]:
    # dropped samples and scoped learning rates: refused for DeepSpeed (store/capabilities.py)
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
