"""What a replay's overrides change inside a step: samples left out of the loss, and learning rates
scaled on part of the model (a layer, or one head's slices of the attention weights).

A scope is {"layers": [...]} or {"units": [[layer, head], ...]}, with the "scale"."""

from __future__ import annotations

import numpy as np
import torch
from transformers import GPT2LMHeadModel

from replay.recorder.state import unwrap


def keep_mask(micro_ids: np.ndarray, dropped: frozenset[int]) -> torch.Tensor | None:
    """Which samples of a micro-batch stay in the loss (None: all of them, the recorded computation).

    A step with left-out samples trains on the mean loss over its kept samples: each micro-batch's loss
    counts the left-out ones as 0 and is scaled by (samples of the step) / (kept samples of the step),
    so the usual averaging over micro-batches and ranks gives exactly that mean (and its gradient). A
    rank's logged loss is its share of it on that scale."""
    keep = ~np.isin(micro_ids, list(dropped)) if dropped else None
    return None if keep is None or keep.all() else torch.from_numpy(keep)


def kept_weight(step_ids: np.ndarray, dropped: frozenset[int]) -> float:
    """(samples of the step, all ranks) / (kept samples): the scale of a step with left-out samples."""
    return step_ids.size / int((~np.isin(step_ids, list(dropped))).sum()) if dropped else 1.0


class ScopedUpdate:
    """Scale the optimizer's update of part of the model by `scale`: p <- p_old + scale * (p_new - p_old).

    For AdamW this is the update the scaled learning rate would make (weight decay included). A layer
    scope covers every parameter of that block; a (layer, head) unit covers the head's columns of
    W_Q, W_K, W_V (and their biases) and its rows of W_O (GPT-2's Conv1D weights are [in, out])."""

    def __init__(self, model: torch.nn.Module, scope: dict):
        module = unwrap(model)
        assert isinstance(module, GPT2LMHeadModel), "the built-in GPT-2 (train/model.py)"
        cfg, blocks = module.config, module.transformer.h
        d = cfg.n_embd // cfg.n_head
        self.scale = float(scope["scale"])
        self.slices: list[tuple[torch.Tensor, tuple]] = []   # (parameter, index)
        for layer in scope.get("layers", []):
            self.slices += [(p, (...,)) for p in blocks[layer].parameters()]
        for layer, head in scope.get("units", []):
            attn = blocks[layer].attn
            for part in range(3):   # q, k, v
                cols = slice(part * cfg.n_embd + head * d, part * cfg.n_embd + (head + 1) * d)
                self.slices += [(attn.c_attn.weight, (slice(None), cols)), (attn.c_attn.bias, (cols,))]
            self.slices.append((attn.c_proj.weight, (slice(head * d, (head + 1) * d), slice(None))))

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        before = [p[index].clone() for p, index in self.slices]
        optimizer.step()
        for (p, index), old in zip(self.slices, before, strict=True):
            p[index] = old + self.scale * (p[index] - old)
