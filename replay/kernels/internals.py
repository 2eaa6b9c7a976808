"""An attention call's scores S and probabilities P, handed out by the backends that compute them whole, for
`replay diff` (replay/replayer/diff.py), which watches a step while it runs.

S is the scaled scores Q K^T * scale, -inf where a query does not attend; P the normalised probabilities, 0
there; both [..., N, M] for the heads of the call, in the type the backend holds them in. Who hands them out:
- `baseline` (kernels/baseline.py): its S and P as its forward computes them;
- the flash emulation (kernels/flash_emu.py): the S and P its backward recomputes from the forward's log-sum-exp,
  tile by tile, assembled (the forward never holds a whole row's P); for the `fa2` placement, whose S is the
  unscaled FP32 Q K^T (the scale is folded into its exponent), S is that times the scale, in FP32.
- transformers' eager attention (a model's own, or run for some heads of a plan): the P it returns (after its
  dropout), and as S the input of its softmax (`eager_scores`: the scaled scores plus the additive mask, which
  is where S is -inf).
The other backends (SDPA, Triton, plug-ins) hand out nothing.

Nothing is computed unless a watcher is set for the calls (`watching`), and what is handed out is never fed
back: a call computes the same bits watched or not.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# (heads of the layer the call covers, or None for all; S, or None where the backend keeps none; P)
Watcher = Callable[[list[int] | None, torch.Tensor | None, torch.Tensor], None]

_watcher: contextvars.ContextVar[Watcher | None] = contextvars.ContextVar("replay_attention_internals", default=None)


@contextlib.contextmanager
def watching(watcher: Watcher) -> Iterator[None]:
    """Hand the S and P of the attention calls made inside the block to `watcher` (a flash backend's after its
    backward: it keeps the watcher it was called under)."""
    token = _watcher.set(watcher)
    try:
        yield
    finally:
        _watcher.reset(token)


def watcher() -> Watcher | None:
    """The watcher of the call being made, if any."""
    return _watcher.get()


class _SoftmaxInput(TorchFunctionMode):
    """Notes the input of the first softmax called inside it, as it is: an attention written as scores, mask,
    softmax (transformers' eager attention) computes nothing else for it."""

    def __init__(self) -> None:
        super().__init__()
        self.scores: torch.Tensor | None = None

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.scores is None and func in (torch.nn.functional.softmax, torch.softmax, torch.Tensor.softmax):
            self.scores = args[0].detach().clone()
        return func(*args, **(kwargs or {}))


def eager_scores(call: Callable[[], Any], mask: torch.Tensor | None) -> tuple[Any, torch.Tensor | None]:
    """What `call` (an eager attention with the additive `mask`: 0 where a query attends) returns, and S: the
    input of its softmax, -inf where the mask is not 0 (None if it called no softmax)."""
    noted = _SoftmaxInput()
    with noted:
        out = call()
    scores = noted.scores
    if scores is not None and mask is not None:
        scores = scores.masked_fill(mask != 0, float("-inf"))
    return out, scores
