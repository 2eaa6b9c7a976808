"""Start a recording from a `torch.distributed.checkpoint` (DCP) directory: torchtitan's, OLMo-core's, or one
`replay export` wrote (store/dcp.py).

    from replay.recorder.dcp import load_dcp

    load_dcp("ckpt/step-1000", model, optimizer)     # before the Loop: its checkpoint 0 holds these weights
    with Loop("runs/mine", model, optimizer, total_steps=...) as loop:
        ...

The model's tensors are found under "model" (`dcp.save({"model": model.state_dict()})`, OLMo-core) or at
the top level (torchtitan); the optimizer's, when an optimizer is given, under "optimizer" or "optim", in
the layout of `torch.distributed.checkpoint.state_dict.get_state_dict`. Every rank calls it (with a process
group, DCP reads each rank's part; without one, this process reads it all). The run's manifest then names
the directory in `init_from`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from replay.errors import UsageError
from replay.recorder.state import note_origin
from replay.store.dcp import METADATA, SafeReader, quiet_single_process

_OPTIMIZER_KEYS = ("optimizer", "optim")      # torchtitan's and replay export's, OLMo-core's


@dataclass
class Loaded:
    path: Path
    tensors: int          # the model's
    optimizer: bool       # whether the optimizer's state was loaded too


def load_dcp(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Loaded:
    """Load the DCP checkpoint at `path` into `model` (and `optimizer`, when given), in place."""
    path = Path(path)
    if not (path / METADATA).is_file():
        raise UsageError(f"{path} is not a DCP checkpoint directory (it has no {METADATA})")
    reader = SafeReader(path)
    saved = set(reader.read_metadata().state_dict_metadata)
    model_state = get_model_state_dict(model)
    prefix = _model_prefix(path, saved, list(model_state))
    state: dict[str, Any] = {"model": model_state} if prefix else dict(model_state)
    key = None
    if optimizer is not None:
        key = next((k for k in _OPTIMIZER_KEYS if any(s.startswith(k + ".") for s in saved)), None)
        if key is None:
            raise UsageError(f"{path} holds no optimizer state (under {' or '.join(_OPTIMIZER_KEYS)}): "
                             "call load_dcp without the optimizer to load the model only")
        state[key] = get_optimizer_state_dict(model, optimizer)
    with contextlib.nullcontext() if dist.is_initialized() else quiet_single_process():
        dcp.load(state, storage_reader=reader)
    set_model_state_dict(model, state["model"] if prefix else {k: state[k] for k in model_state})
    if key is not None:
        assert optimizer is not None, "an optimizer state is loaded only for an optimizer"
        set_optimizer_state_dict(model, optimizer, state[key])
    note_origin(model, str(path.resolve()))
    return Loaded(path, len(model_state), optimizer is not None)


def _model_prefix(path: Path, saved: set[str], names: list[str]) -> bool:
    """Whether the model's tensors are saved under "model." (else at the top level); refused where some are
    not saved at all."""
    for prefix in ("model.", ""):
        missing = [n for n in names if prefix + n not in saved]
        if not missing:
            return bool(prefix)
    missing = [n for n in names if "model." + n not in saved]
    raise UsageError(f"{path} does not hold the model's {missing[0]}"
                     + (f" and {len(missing) - 1} more of its tensors" if len(missing) > 1 else "")
                     + " (under model. or at the top level): is it a checkpoint of this model?")
