"""A window of a W-rank data-parallel run replayed on fewer processes (`replay run --ranks N`).

Each of the N processes plays W/N recorded ranks: it runs each one's micro-batches in sequence, into a
gradient of that rank's own (the ops the recorded rank ran, at the recorded thread count), then adds the W
gradients as the recorded DDP all-reduce did, and steps the optimizer identically on every process.

What the recorded reduction was (torch 2.13, gloo on CPU; benchmarks/gloo_order.py is the evidence):
- DDP's reducer copies each gradient into its bucket multiplied by 1/W, then all-reduces (sums) the bucket.
- The buckets: a DDP's first iteration lays its parameters out in registration order; after it, DDP
  rebuilds the buckets in the order the gradients became ready. The recording's DDP began at step 0.
- gloo's all-reduce is a ring: the bucket is cut into W chunks (of K segments of at most 1 MiB each), and
  chunk c is summed left to right over ranks c-1, c-2, ..., c+1 (mod W), then c. For W <= 2 any order gives
  the same bits.

The layouts are DDP's own: the model runs under a DDP over a process group of this process alone, whose
communication hook notes each bucket's parameters and offsets and reduces nothing (ranks_layout).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from replay.recorder.loop import Loop
from replay.train.data import TokenData
from replay.train.model import lm_loss

SEGMENT_BYTES = 1 << 20   # gloo's largest ring segment: a rank's chunk is cut into as many as it takes


def ring_sum(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum of the W ranks' flat tensors, element for element as gloo's ring all-reduce adds them: the
    buffer is cut into W chunks of K segments (K: as many as keep a segment within SEGMENT_BYTES), and chunk
    c is added over ranks c-1, c-2, ..., c+1, then c (benchmarks/gloo_order.py: bit for bit, any size)."""
    world, n = len(parts), parts[0].numel()
    segments = max(1, -(-n * parts[0].element_size() // (world * SEGMENT_BYTES)))
    chunk = segments * -(-n // (world * segments))
    out = torch.empty_like(parts[0])
    for c in range(world):
        piece = slice(min(n, c * chunk), min(n, (c + 1) * chunk))
        order = [(c - 1 - i) % world for i in range(world - 1)] + [c]
        acc = parts[order[0]][piece].clone()
        for r in order[1:]:
            acc += parts[r][piece]
        out[piece] = acc
    return out


@dataclass
class Bucket:
    params: list[torch.nn.Parameter]
    offsets: list[int]
    numel: int


@dataclass
class Layout:
    """DDP's buckets, as its hook saw them: the first iteration's, and the rebuilt ones after it."""

    seen: list[list[Bucket]] = field(default_factory=list)   # per synchronised backward, its buckets
    current: list[Bucket] = field(default_factory=list)

    def hook(self, state, bucket):   # unannotated: DDP checks the annotations' objects, not these strings
        buffer = bucket.buffer()
        base = buffer.storage_offset()
        self.current.append(Bucket(list(bucket.parameters()), [g.storage_offset() - base for g in bucket.gradients()],
                                   buffer.numel()))
        if bucket.is_last():
            self.seen.append(self.current)
            self.current = []
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done

    def of_step(self, step: int) -> list[Bucket]:
        """The buckets the recording's DDP reduced `step` in: its first iteration's at step 0, else rebuilt."""
        return self.seen[0] if step == 0 else self.seen[-1]


class PlayedRanks:
    """The recorded ranks this process plays: `ranks`, of `world`; its process is `process` of `processes`."""

    def __init__(self, model: torch.nn.Module, world: int, processes: int, process: int):
        self.world, self.processes, self.process = world, processes, process
        per = world // processes
        self.ranks = range(process * per, (process + 1) * per)
        self.model = model
        if processes > 1:   # every process makes every group; each uses its own
            groups = [dist.new_group([p], backend="gloo") for p in range(processes)]
            own = groups[process]
        else:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            own = dist.group.WORLD
        self.ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=own)
        self.layout = Layout()
        self.ddp.register_comm_hook(None, self.layout.hook)

    def step(self, micro_batches: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
             autocast: contextlib.AbstractContextManager, step: int) -> list[float]:
        """Each played rank's micro-batches ((x, y) each) into its own gradient, then the recorded all-reduce
        of all W into the parameters' .grad. Returns each played rank's mean loss."""
        grads, losses = [], []
        params = list(self.model.parameters())
        for batches in micro_batches:
            for p in params:
                p.grad = None
            total = torch.zeros((), dtype=torch.float32)
            accum = len(batches)
            for m, (x, y) in enumerate(batches):
                with self.ddp.no_sync() if m < accum - 1 else contextlib.nullcontext():
                    with autocast:
                        loss = lm_loss(self.ddp, x, y)
                    (loss / accum).backward()
                total += loss.detach()
            grads.append({p: p.grad for p in params})
            losses.append(float(total / accum))
        for bucket in self.layout.of_step(step):
            mine = [torch.mul(self._flatten(bucket, g), 1.0 / self.world) for g in grads]
            summed = ring_sum(self._all(mine))
            for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                p.grad = summed[offset:offset + p.numel()].view_as(p).clone()
        return losses

    def _flatten(self, bucket: Bucket, grads: dict[torch.nn.Parameter, torch.Tensor | None]) -> torch.Tensor:
        flat = torch.zeros(bucket.numel, dtype=torch.float32)
        for p, offset in zip(bucket.params, bucket.offsets, strict=True):
            g = grads[p]
            assert g is not None, "every parameter of the built-in GPT-2 gets a gradient"
            flat[offset:offset + p.numel()] = g.reshape(-1)
        return flat

    def _all(self, mine: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every recorded rank's tensor, in rank order, from the processes playing them."""
        if self.processes == 1:
            return mine
        stacked = torch.stack(mine)
        out = [torch.empty_like(stacked) for _ in range(self.processes)]
        dist.all_gather(out, stacked)
        return [t for block in out for t in block]


def played_step(played: PlayedRanks, optimizer: torch.optim.Optimizer, scheduler, data: TokenData, loop: Loop,
                ids: np.ndarray) -> tuple[list[float], float, float]:
    """One optimizer step of the played ranks (trainer.py's `_torch_step`, for several recorded ranks):
    (each played rank's mean loss, grad norm before clipping, lr). Replays with overrides are refused with
    --ranks (replayer/replays.py)."""
    played.ddp.train()
    per = len(ids) // len(played.ranks)
    batches = [[data.batch(micro) for micro in ids[i * per:(i + 1) * per]] for i in range(len(played.ranks))]
    assert loop.step is not None, "inside loop.steps()"
    losses = played.step(batches, loop.autocast("cpu"), loop.step)
    max_norm = loop.cfg.optim.grad_clip if loop.cfg.optim.grad_clip > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(played.ddp.parameters(), max_norm)
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    return losses, float(grad_norm), lr
