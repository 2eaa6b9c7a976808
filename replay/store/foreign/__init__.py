"""Checkpoints replay did not record, read as a series for the analysis: a folder (or an object-store
prefix) of transformers Trainer `checkpoint-<step>` folders (store/foreign/hf.py), `torch.distributed.
checkpoint` folders (dcp.py) or nanoGPT `ckpt.pt` files (nanogpt.py); or one such checkpoint, a series of one.

    series = open_series(Location.parse("out/"), heads=None, layout=None)
    series.checkpoints                       # [ForeignCheckpoint(step, location, identity), ...] by step
    series.read_model(40, ["transformer.h.0.attn.c_attn.weight"])   # {name: tensor}, only those read

The format is told by names alone (no tensor is loaded to decide); the model's shape and its layout
(store/layout.py) come from the last checkpoint: its config where it has one, its tensors' names and shapes
otherwise. Whatever cannot be found (a DCP checkpoint's head count, the layout of a model of one's own) is
asked for in one line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from replay.config import ModelConfig
from replay.errors import StoreError, UsageError
from replay.store.foreign import dcp, hf, nanogpt
from replay.store.foreign.base import ForeignCheckpoint, Shape, config_shape, fits, weight_shape
from replay.store.layout import BUILT_IN, FAMILIES, Layout, resolve_layout
from replay.store.location import Location

if TYPE_CHECKING:
    import torch

__all__ = ["ForeignCheckpoint", "ForeignSeries", "open_series", "FORMATS", "TORCHTITAN"]

FORMATS = {"hf-trainer": hf, "dcp": dcp, "nanogpt": nanogpt}

# torchtitan's Llama: nn.Linear projections; its MLP's w3 is the up projection (as hf-llama's "fc"), w1 the gate
TORCHTITAN = {**{role: f"layers.{{layer}}.attention.w{role}.weight" for role in "qkvo"},
              "fc": "layers.{layer}.feed_forward.w3.weight", "proj": "layers.{layer}.feed_forward.w2.weight",
              "orientation": "out_in", "name": "torchtitan"}
_DCP_PREFIXES = ("model.", "")   # {"model": state_dict} saved flattened (torchtitan, OLMo-core), or the bare state dict


@dataclass
class ForeignSeries:
    location: Location                 # the folder or prefix holding the checkpoints (or the one checkpoint)
    format: str                        # a key of FORMATS
    checkpoints: list[ForeignCheckpoint]   # by step
    n_layer: int
    n_head: int
    n_kv_head: int
    n_embd: int
    layout: dict[str, Any]             # as store/layout.py's resolve_layout returns it
    transformers_config: dict[str, Any] | None = None   # an HF checkpoint's config.json, for a probe through the model
    losses: dict[int, float] = field(default_factory=dict)   # training loss by step, where the checkpoints say it
    prefix: str = ""                   # before each model tensor's name in a DCP checkpoint ("model.": under "model")

    def checkpoint(self, step: int) -> ForeignCheckpoint:
        found = next((c for c in self.checkpoints if c.step == step), None)
        if found is None:
            raise UsageError(f"{self.location} has no checkpoint at step {step} "
                             f"(it has {', '.join(str(c.step) for c in self.checkpoints)})")
        return found

    def model_shapes(self, step: int) -> dict[str, list[int]]:
        """Every model tensor's shape at checkpoint `step`, by state-dict name."""
        return _shapes(self.format, self.checkpoint(step).location, self.prefix)

    def read_model(self, step: int, names: list[str]) -> dict[str, torch.Tensor]:
        """The model tensors `names` (state-dict names) at checkpoint `step`, read alone where the format allows."""
        loc = self.checkpoint(step).location
        if self.format == "hf-trainer":
            return hf.read(loc, names)
        if self.format == "dcp":
            return dcp.read(loc, names, self.prefix)
        return nanogpt.read(loc, names)


def open_series(location: Location, heads: int | None = None,
                layout: str | dict[str, Any] | None = None) -> ForeignSeries:
    """The checkpoints at `location`, with the model's shape and layout; `heads` and `layout` where the
    checkpoints do not say them (or to check what they say)."""
    fmt, places = _find(location)
    checkpoints = sorted((FORMATS[fmt].checkpoint(p) for p in places), key=lambda c: c.step)
    for a, b in zip(checkpoints, checkpoints[1:], strict=False):
        if a.step == b.step:
            raise UsageError(f"{a.location} and {b.location} are both checkpoints of step {a.step}: "
                             "give a folder holding one run's")
    last = checkpoints[-1].location
    if fmt == "hf-trainer":
        return _hf(location, checkpoints, last, heads, layout)
    if fmt == "dcp":
        return _dcp(location, checkpoints, last, heads, layout)
    return _nanogpt(location, checkpoints, last, heads, layout)


def _find(loc: Location) -> tuple[str, list[Location]]:
    """The format of the checkpoints at `loc` and where each is, by their names alone."""
    children = loc.children()
    found = {fmt: names for fmt, mod in FORMATS.items() if (names := mod.checkpoint_names(children, loc))}
    own = next((fmt for fmt, mod in FORMATS.items() if mod.is_checkpoint(loc)), None)
    # a Trainer's output folder holds its final save_model beside the checkpoint folders: those are the series
    if own is not None and not (own == "hf-trainer" and "hf-trainer" in found):
        return own, [loc]
    if not found:
        seen = f"it holds {', '.join(children[:5])}{', ...' if len(children) > 5 else ''}" if children \
            else "it is empty or does not exist"
        raise UsageError(f"{loc} holds no checkpoints replay can read ({seen}): give a folder of transformers "
                         "Trainer checkpoint-<step> folders, torch.distributed.checkpoint folders (with .metadata) "
                         "or nanoGPT *.pt files, or one of them")
    if len(found) > 1:
        kinds = "; ".join(f"{fmt}: {names[0]}" for fmt, names in found.items())
        raise UsageError(f"{loc} mixes checkpoint formats ({kinds}): give a folder holding one run's checkpoints")
    fmt, names = next(iter(found.items()))
    return fmt, [loc / n for n in names]


def _layout(layout: str | dict[str, Any]) -> Layout:
    resolved = resolve_layout(layout, ModelConfig())   # a layout does not depend on the model's size
    assert resolved is not None, "a layout was given"
    return Layout.from_dict(resolved)


def _heads(said: int | None, heads: int | None, where: str, how: str) -> int:
    if heads is not None and said is not None and heads != said:
        raise UsageError(f"{where} says the model has {said} heads, not the {heads} given: leave out --heads")
    n = heads if heads is not None else said
    if n is None:
        raise UsageError(f"{where} does not say how many attention heads the model has ({how}): pass --heads N")
    return n


def _check(shape: Shape, said: dict[str, int], where: str) -> None:
    for name, value in said.items():
        if getattr(shape, name) != value:
            raise StoreError(f"{where} says {name}={value}, but its weights have {getattr(shape, name)}")


def _hf(loc: Location, ckpts: list[ForeignCheckpoint], last: Location, heads: int | None,
        layout: str | dict[str, Any] | None) -> ForeignSeries:
    config = hf.json_of(last / hf.CONFIG)
    assert config is not None, "hf.is_checkpoint and checkpoint_names look for config.json"
    where = str(last / hf.CONFIG)
    family = FAMILIES.get(str(config.get("model_type")))
    if layout is None and family is None:
        raise UsageError(f"{where} has model_type {config.get('model_type')!r}, whose weight layout is not built "
                         f"in ({', '.join(FAMILIES)} are): pass --layout NAME or a mapping of its keys")
    said = config_shape(config)
    n_head = _heads(said.get("n_head"), heads, where, "no num_attention_heads")
    lay = _layout(layout if layout is not None else str(family))
    shape = weight_shape(lay, hf.shapes(last), n_head, str(last))
    _check(shape, said, where)
    state = hf.json_of(last / hf.STATE)
    return ForeignSeries(loc, "hf-trainer", ckpts, shape.n_layer, shape.n_head, shape.n_kv_head, shape.n_embd,
                         lay.to_dict(), transformers_config=config, losses=hf.losses(state))


def _dcp(loc: Location, ckpts: list[ForeignCheckpoint], last: Location, heads: int | None,
         layout: str | dict[str, Any] | None) -> ForeignSeries:
    md = dcp.metadata(last)
    candidates = [_layout(layout)] if layout is not None else \
        [_layout(name) for name in BUILT_IN] + [_layout(TORCHTITAN)]
    chosen = next(((lay, prefix) for prefix in _DCP_PREFIXES for lay in candidates
                   if fits(lay, dcp.shapes(md, prefix))), None)
    if chosen is None:
        sample = ", ".join(sorted(dcp.shapes(md, ""))[:3])
        what = f"layout {candidates[0].name} does not fit" if layout is not None else "no built-in layout fits"
        raise UsageError(f"{last}: {what} its tensors' names and shapes (e.g. {sample}): pass --layout NAME or "
                         "a mapping of its keys")
    lay, prefix = chosen
    config = next((c for c in (hf.json_of(last / hf.CONFIG), hf.json_of(loc / hf.CONFIG)) if c), None)
    said = config_shape(config or {})
    n_head = _heads(said.get("n_head"), heads, str(last), "DCP keeps no model config")
    shape = weight_shape(lay, dcp.shapes(md, prefix), n_head, str(last))
    _check(shape, said, f"the config.json beside {last}")
    return ForeignSeries(loc, "dcp", ckpts, shape.n_layer, shape.n_head, shape.n_kv_head, shape.n_embd,
                         lay.to_dict(), prefix=prefix)


def _nanogpt(loc: Location, ckpts: list[ForeignCheckpoint], last: Location, heads: int | None,
             layout: str | dict[str, Any] | None) -> ForeignSeries:
    args = nanogpt.load(last)["model_args"]
    said = {k: v for k in ("n_layer", "n_head", "n_embd") if isinstance(v := args.get(k), int)}
    n_head = _heads(said.get("n_head"), heads, f"{last}'s model_args", "no n_head")
    lay = _layout(layout if layout is not None else "nanogpt")
    shape = weight_shape(lay, nanogpt.shapes(last), n_head, str(last))
    _check(shape, said, f"{last}'s model_args")
    return ForeignSeries(loc, "nanogpt", ckpts, shape.n_layer, shape.n_head, shape.n_kv_head, shape.n_embd,
                         lay.to_dict())


def _shapes(fmt: str, loc: Location, prefix: str) -> dict[str, list[int]]:
    if fmt == "hf-trainer":
        return hf.shapes(loc)
    if fmt == "dcp":
        return dcp.shapes(dcp.metadata(loc), prefix)
    return nanogpt.shapes(loc)
