"""The built-in model: transformers' GPT-2, built from a config (never downloaded), and its LR schedule."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging

from replay.config import ModelConfig, OptimConfig
from replay.kernels.plan import AttentionPlan
from replay.kernels.registry import apply_plan

BODY = "transformer."   # GPT2LMHeadModel's prefix of the GPT2Model inside it


def gpt2_config(cfg: ModelConfig, vocab_size: int, n_layer: int | None = None) -> GPT2Config:
    """transformers' config for this model (optionally only its first `n_layer` blocks)."""
    hf_logging.set_verbosity_error()
    return GPT2Config(
        vocab_size=vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd,
        n_layer=cfg.n_layer if n_layer is None else n_layer, n_head=cfg.n_head, resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout, use_cache=False,
    )


def build_model(cfg: ModelConfig, vocab_size: int, seed: int) -> GPT2LMHeadModel:
    """A freshly initialised GPT-2; the same seed gives the same weights on every rank and replay."""
    config = gpt2_config(cfg, vocab_size)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    apply_plan(model, AttentionPlan.parse(cfg.attention))
    return model


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy in FP32 (logits are upcast under autocast); with `keep`, the left-out
    samples count as 0 (the caller rescales to the mean over the step's kept samples)."""
    logits = model(input_ids=x).logits
    if keep is None:
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
    ce = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1), reduction="none")
    return ce.view(y.shape).masked_fill(~keep.to(y.device)[:, None], 0.0).sum() / y.numel()


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Linear warmup to lr, then cosine decay to min_lr; a factor of the base lr (for LambdaLR)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    decay = cfg.decay_steps or max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay)
    lr = cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))
    return lr / cfg.lr
