"""What a recording of the user's own loop makes its run's config and manifest from: the `Loop` keywords
(`RunOptions`) and what the model says of itself (its attention's layers and heads, its width, a
transformers model's config and weight layout)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import torch

from replay.config import Cadence, ModelConfig, RunConfig, SpikeConfig
from replay.errors import UsageError
from replay.kernels.registry import transformers_model_in
from replay.kernels.sdpa_dispatch import attention_modules
from replay.store.layout import FAMILIES, resolve_layout
from replay.store.manifest import ModelInfo

PRECISIONS = {"fp32": None, "float32": None, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
              "fp16": torch.float16, "float16": torch.float16}
_HEAD_ATTRS = ("n_head", "num_heads", "n_heads", "num_attention_heads")


@dataclass(frozen=True)
class RunOptions:
    """`Loop`'s keywords that describe a recording (a replay's are the record's)."""

    total_steps: int
    precision: str = "fp32"
    checkpoint_every: int = 100
    snapshot_every: int = 0
    snapshot_ring: int = 3
    spike: SpikeConfig | None = None
    attention: str | None = None               # a pattern naming the attention modules
    n_head: int | None = None                  # heads per layer, when the modules do not say
    layout: str | dict[str, Any] | None = None
    description: str = ""

    def __post_init__(self) -> None:
        """Refuse what would make the run unrecordable or unreplayable, before anything is written."""
        if not _whole(self.total_steps) or self.total_steps < 1:
            raise UsageError(f"Loop(total_steps={self.total_steps!r}): a replay needs the run's length, a whole number "
                             ">= 1 (a loop that runs until stopped: pass the most steps it may run; minGPT: set "
                             "trainer.max_iters)")
        self.cadence.check("Loop(")
        if self.precision not in PRECISIONS:
            raise UsageError(f"Loop(precision={self.precision!r}): use one of {', '.join(PRECISIONS)}")

    @property
    def cadence(self) -> Cadence:
        return Cadence(self.checkpoint_every, self.snapshot_every, self.snapshot_ring)

    def config(self, model: torch.nn.Module, world: int) -> RunConfig:
        """The run's config, as far as a loop of the user's own can tell it."""
        n_layer, heads = _attention_shape(model, self.attention, self.n_head)
        return RunConfig(preset="custom", steps=self.total_steps, nproc=world, precision=_canonical(self.precision),
                         threads=torch.get_num_threads(), **dataclasses.asdict(self.cadence),
                         spike=self.spike or SpikeConfig(),
                         model=ModelConfig(n_layer=n_layer, n_head=heads, n_embd=_width(model), block_size=0,
                                           attention=_implementation(model)))

    def model_manifest(self, model: torch.nn.Module, cfg: RunConfig) -> tuple[dict[str, Any] | None, ModelInfo | None]:
        """(weight layout, model info) for the manifest: a transformers model's config rebuilds it for the
        analysis probe, and its family's layout is the default."""
        layout, info = self.layout, None
        inner = transformers_model_in(model)
        if inner is not None:
            config: Any = inner.config
            info = ModelInfo(json.loads(config.to_json_string(use_diff=False)))
            layout = layout or FAMILIES.get(config.model_type)
        under = next((name for name, m in model.named_modules() if m is inner), "")   # a wrapper's prefix, or ""
        return resolve_layout(layout, cfg.model, under), info


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _implementation(model: torch.nn.Module) -> str:
    """The attention the recording runs, as a replay's plan names it: a transformers model's own
    implementation (eager, sdpa; another, such as flash_attention_2, takes no overrides); else SDPA."""
    inner = transformers_model_in(model)
    if inner is not None:
        config: Any = inner.config
        return str(config.get_text_config()._attn_implementation)
    return "sdpa"


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
    inner = transformers_model_in(model)
    for owner in (modules[0][1], getattr(inner if inner is not None else model, "config", None), model):
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
