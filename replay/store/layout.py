"""Where a checkpoint keeps each layer's weights: the one place the analysis reads them from.

A layout names, per layer, the model state-dict keys of W_Q, W_K and W_V (three keys, or one fused
key holding Q, K, V in that order), W_O and the MLP's two matrices, and how the matrices are stored:
`in_out` (transformers' Conv1D, GPT-2) or `out_in` (`nn.Linear`). The analysis always sees them as
(in, out): head h of W_Q, W_K, W_V is columns h*hd:(h+1)*hd, and head h of W_O is rows h*hd:(h+1)*hd.

Built in: "hf-gpt2" (transformers' GPT2LMHeadModel, the built-in trainer's model), "nanogpt"
(nanoGPT's GPT: `transformer.h.{layer}.attn.c_attn` as an `nn.Linear`) and "hf-llama" (transformers'
LlamaForCausalLM and the families that share its names: Qwen2, Mistral; `q_proj`, `k_proj`, `v_proj`,
`o_proj`, with the MLP's `up_proj` as "fc" and `down_proj` as "proj", its `gate_proj` left out). With
grouped-query attention W_K and W_V are narrower than W_Q: they hold the key/value heads, and query head h
reads key/value head h // (heads / key-value heads). A model of one's own gives a mapping instead, e.g.
for separate projections:

    {"q": "blocks.{layer}.attn.wq.weight", "k": "blocks.{layer}.attn.wk.weight",
     "v": "blocks.{layer}.attn.wv.weight", "o": "blocks.{layer}.attn.wo.weight",
     "fc": "blocks.{layer}.ff.w1.weight", "proj": "blocks.{layer}.ff.w2.weight", "orientation": "out_in"}
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from replay.config import Launcher, ModelConfig
from replay.errors import UsageError

# Every checkpoint's tree (recorder/recorder.py writes it): each rank's shard is {"state":
# TrainState.state_dict(rank), "rng": rng_state()}; a TrainState's tree is {"replicated": ..., "local": ...},
# with the model's state dict at "replicated/model" (rank 0's shard). A shard's tensors are keyed by their
# path in that tree.
MODEL_KEYS = "/state/replicated/model/"


def model_key(name: str) -> str:
    """The key of the model's tensor `name` (a state-dict key) in rank 0's shard."""
    return MODEL_KEYS + name


_GPT2 = {"qkv": "transformer.h.{layer}.attn.c_attn.weight", "o": "transformer.h.{layer}.attn.c_proj.weight",
         "fc": "transformer.h.{layer}.mlp.c_fc.weight", "proj": "transformer.h.{layer}.mlp.c_proj.weight"}
_LLAMA = {role: f"model.layers.{{layer}}.{key}.weight" for role, key in (
    ("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"), ("o", "self_attn.o_proj"),
    ("fc", "mlp.up_proj"), ("proj", "mlp.down_proj"))}
BUILT_IN = {"hf-gpt2": {**_GPT2, "orientation": "in_out"}, "nanogpt": {**_GPT2, "orientation": "out_in"},
            "hf-llama": {**_LLAMA, "orientation": "out_in"}}
_ROLES = ("qkv", "q", "k", "v", "o", "fc", "proj")


@dataclass
class Layout:
    o: str
    fc: str | None = None
    proj: str | None = None
    qkv: str | None = None         # one fused key (Q, K, V stacked along the output dimension) ...
    q: str | None = None           # ... or three
    k: str | None = None
    v: str | None = None
    orientation: str = "out_in"    # "out_in" (nn.Linear) or "in_out" (Conv1D)
    name: str = "custom"

    def __post_init__(self) -> None:
        if self.orientation not in ("out_in", "in_out"):
            raise UsageError("layout orientation must be out_in (nn.Linear) or in_out (Conv1D), "
                             f"got {self.orientation!r}")
        if (self.qkv is None) == (self.q is None or self.k is None or self.v is None):
            raise UsageError("a layout names either one fused 'qkv' key or the three keys 'q', 'k' and 'v'")
        for role in _ROLES:
            key = getattr(self, role)
            if key is not None and "{layer}" not in key:
                raise UsageError(f"layout key {role!r} ({key!r}) has no '{{layer}}' to put the layer number in")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Layout:
        unknown = set(d) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise UsageError(f"unknown layout keys {sorted(unknown)}: use {', '.join(_ROLES)} and orientation")
        if "o" not in d:
            raise UsageError("a layout names W_O's key as 'o'")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def keys(self, layer: int) -> dict[str, str]:
        """The state-dict keys of one layer's matrices, by role."""
        return {role: key.format(layer=layer) for role in _ROLES if (key := getattr(self, role)) is not None}

    def matrices(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One layer's matrices as (in, out), by analysis name (q, k, v, o and, where named, fc, proj), from
        {role: tensor} as `keys` names them."""
        def io(m: np.ndarray) -> np.ndarray:
            return m.T if self.orientation == "out_in" else m

        out = {role: io(m) for role, m in tensors.items() if role != "qkv"}
        if "qkv" in tensors:
            fused = io(tensors["qkv"])
            d = fused.shape[1] // 3
            out.update(q=fused[:, :d], k=fused[:, d:2 * d], v=fused[:, 2 * d:])
        return out


# A transformers model's layout by its config's model_type: the default of a Loop given none.
FAMILIES = {"gpt2": "hf-gpt2", "llama": "hf-llama", "qwen2": "hf-llama", "mistral": "hf-llama"}


def resolve_layout(layout: str | dict[str, Any] | None, model: ModelConfig, under: str = "") -> dict[str, Any] | None:
    """A layout given by name or mapping, checked, as the manifest stores it (None: none given). `under`: where
    the named family's model sits in the recorded module (a LightningModule's `model`), its keys prefixed so."""
    if layout is None:
        return None
    if isinstance(layout, str):
        if layout not in BUILT_IN:
            raise UsageError(f"unknown layout {layout!r}: use {', '.join(BUILT_IN)} or a mapping of keys")
        keys = {role: f"{under}.{key}" if under and role in _ROLES else key for role, key in BUILT_IN[layout].items()}
        return Layout(**keys, name=layout).to_dict()
    return Layout.from_dict(dict(layout)).to_dict()


def layout_of(launcher: Launcher, stored: dict[str, Any] | None) -> Layout | None:
    """The layout a run's checkpoints have: the built-in trainer's GPT-2, the one a loop of the user's own
    declared, or None (a loop that declared none)."""
    if launcher != Launcher.CUSTOM:
        return Layout(**BUILT_IN["hf-gpt2"], name="hf-gpt2")
    return Layout.from_dict(stored) if stored else None
