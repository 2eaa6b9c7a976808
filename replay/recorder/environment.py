"""What can break bitwise replay, controlled and written down: threads, kernels, RNG states."""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch

from replay.recorder.command import ENV, ENV_PREFIXES, tracked
from replay.recorder.host import host


def configure_determinism(threads: int) -> list[str]:
    """Fixed thread count, deterministic kernels, no TF32: the same inputs give the same bits. Returns what
    this changed that a run can see, as settings (none when the process had them already; the CUDA ones
    only where CUDA is)."""
    cuda = torch.cuda.is_available()
    changed = [setting for setting, was in [
        (f"torch.set_num_threads({threads})", torch.get_num_threads() != threads),
        ("torch.use_deterministic_algorithms(True)", not torch.are_deterministic_algorithms_enabled()
         or torch.is_deterministic_algorithms_warn_only_enabled()),
        ("cudnn.deterministic", cuda and not torch.backends.cudnn.deterministic),
        ("no cudnn.benchmark", cuda and torch.backends.cudnn.benchmark),
        ("no TF32", cuda and (torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32)),
        ("CUBLAS_WORKSPACE_CONFIG=:4096:8", cuda and "CUBLAS_WORKSPACE_CONFIG" not in os.environ),
    ] if was]
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (before CUDA init)
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return changed


def determinism_notice(changed: list[str]) -> str:
    """The line a recording prints when `configure_determinism` changed something."""
    return (f"replay: this recording runs with {', '.join(changed)}, which the script had not set: operations "
            "with a deterministic implementation run it rather than their default, and an operation without one "
            "raises (docs/your-loop.md, \"What changes when a run is recorded\")")


def fingerprint(device: torch.device) -> dict[str, Any]:
    """The host (recorder/host.py) and how torch computes on it."""
    fp = {
        **host(),
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "tf32": torch.backends.cuda.matmul.allow_tf32,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),   # the vector width torch's own kernels chose
        "env": tracked(os.environ),
        "env_covers": {"names": list(ENV), "prefixes": list(ENV_PREFIXES)},   # what `env` holds, set or not
    }
    if device.type == "cuda":
        fp["cuda"] = {"version": torch.version.cuda, "gpu": torch.cuda.get_device_name(device),
                      "capability": list(torch.cuda.get_device_capability(device))}
    return fp


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's global generators from the run's seed: two recordings with one seed
    hold the same RNG states, whatever a training step draws from."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def cpu_rng_state() -> dict[str, Any]:
    """Python's, numpy's and torch's CPU generators, as a storable tree."""
    version, mt, gauss = random.getstate()
    return {
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": dict(zip(("kind", "keys", "pos", "has_gauss", "cached_gaussian"), np.random.get_state(), strict=True)),
        "torch": torch.get_rng_state(),
    }


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from, as a storable tree."""
    state = cpu_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    np_state = state["numpy"]
    np.random.set_state((np_state["kind"], np_state["keys"], np_state["pos"], np_state["has_gauss"],
                         np_state["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class AutocastSeen:
    """The autocast in effect at the model's first training forward, however it was set (`loop.autocast`, a
    launcher's mixed precision wrapping the model's forward, the script's own `torch.autocast`): taken by a
    pre-hook on every leaf module (a wrapped forward enters its autocast after its module's own hooks, and
    the wrapped module may be inside another: accelerate's under DDP), all removed once it is seen. `value`:
    "off", or the autocast dtype and device ("bf16 on cpu")."""

    def __init__(self, model: torch.nn.Module):
        self.value: str | None = None
        modules = [m for m in model.modules() if next(m.children(), None) is None] or [model]
        self._handles = [m.register_forward_pre_hook(self._seen) for m in modules]

    def _seen(self, module: torch.nn.Module, args: Any) -> None:
        if self.value is not None or not module.training or not torch.is_grad_enabled():
            return
        device = next(module.parameters(), torch.empty(0)).device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            self.value = f"{_SHORT.get(dtype, str(dtype))} on {device}"
        else:
            self.value = "off"
        self.close()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
