"""One training step's tensors, in the order the step produces them: what `replay diff` compares
(replay/replayer/diff.py).

`Tracer` hooks a model's modules (every module's output in the forward, the gradient of its output in the
backward); `attention_traced` (a transformers model, through its attention interface) and `sdpa_traced` (a
model whose attention modules call SDPA or `kernels.explicit.causal_attention`) add every attention call's
O and its gradients dO, dQ, dK, dV as (batch, heads, tokens, head dim), the scores S and probabilities P
where the call's backend hands them out (kernels/internals.py), and the input of W_Q's projection for the
per-head signals. Each tensor goes to `see(phase, where, what, tensor)`; an attention call's O, dO, dQ, dK,
dV and its W_Q input also to `keep("CALL|WHAT", tensor)`.

`TraceFile` keeps a step's tensors on disk, one after another in execution order, with an index of each one's
key, CRC-32C, type, shape and place: side A of an in-process diff, and the step a script's replay traces
(`StepTrace`: `replay diff` of a script's run asks for it in the replay's spec, store/manifest.py
`TraceRequest`; the `Loop` begins it when the step begins and ends it when the script asks for the next).
Watching changes no bit of the step: hooks that return nothing, and a TorchFunctionMode that calls through.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import shutil
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from replay.errors import UsageError
from replay.kernels import internals
from replay.kernels.explicit import causal_attention
from replay.kernels.registry import hf_attention_modules, transformers_model_in
from replay.kernels.sdpa_dispatch import attention_modules
from replay.recorder.digest import WORDS
from replay.recorder.overrides import torch_optimizer
from replay.recorder.state import unwrap
from replay.store.integrity import crc32c
from replay.store.manifest import TraceRequest

See = Callable[[str, str, str, torch.Tensor], None]   # (phase, where, what, tensor)
Keep = Callable[[str, torch.Tensor], None]            # ("CALL|WHAT", tensor): an attention call's, for its heads

CALL = ("O", "x", "dO", "dQ", "dK", "dV")   # what a call's per-head signals are computed from
_CALL_KEY = re.compile(r"attention \d+(#\d+)?")
_SDPA = torch.nn.functional.scaled_dot_product_attention
_INDEX = "index.json"


@dataclass(frozen=True)
class Entry:
    """A tensor of a traced step: its key (`phase|where|what`), its CRC-32C, type and shape, and where its bytes
    lie in the trace's file."""

    key: str
    digest: int
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def phase(self) -> str:
        return self.key.split("|", 1)[0]


class TraceFile:
    """A step's tensors on disk in execution order (`see` and `keep` append them) and their index, by key."""

    def __init__(self, file: IO[bytes], entries: dict[str, Entry] | None = None, directory: Path | None = None,
                 owned: bool = False):
        self._file, self._directory, self._owned = file, directory, owned   # owned: the folder goes with it
        self._closed = False
        self.entries: dict[str, Entry] = entries if entries is not None else {}   # in execution order

    def __enter__(self) -> TraceFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def temporary(cls) -> TraceFile:
        """A trace in an unnamed temporary file, gone when closed."""
        return cls(tempfile.TemporaryFile(prefix="replay-diff-"))

    @classmethod
    def create(cls, directory: Path) -> TraceFile:
        """A trace written into `directory` (made), its index once `save` is called."""
        directory.mkdir(parents=True, exist_ok=True)
        return cls(open(directory / "tensors", "w+b"), directory=directory)

    @classmethod
    def open(cls, directory: Path, owned: bool = False) -> TraceFile | None:
        """The trace `create` and `save` wrote into `directory` (`owned`: removed when the trace is closed); None
        where its index was never written."""
        try:
            index = json.loads((directory / _INDEX).read_text())
        except FileNotFoundError:
            return None
        entries = {key: Entry(key, digest, offset, getattr(torch, dtype), tuple(shape))
                   for key, digest, offset, dtype, shape in index["entries"]}
        return cls(open(directory / "tensors", "rb"), entries, directory, owned)

    def save(self) -> None:
        """The index, written whole (renamed into place) once the step is done."""
        assert self._directory is not None, "a trace of a directory"
        self._file.flush()
        rows = [[e.key, e.digest, e.offset, str(e.dtype).removeprefix("torch."), list(e.shape)]
                for e in self.entries.values()]
        part = self._directory / f"{_INDEX}.part"
        part.write_text(json.dumps({"entries": rows}))
        os.replace(part, self._directory / _INDEX)

    def close(self) -> None:
        self._closed = True
        self._file.close()
        if self._owned and self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)

    def see(self, phase: str, where: str, what: str, t: torch.Tensor) -> None:
        """Append a tensor of the step (nothing once the trace is closed: a hook the step left on a tensor that a
        later backward reaches)."""
        if self._closed:
            return
        t = t.detach().contiguous().cpu()
        self._file.seek(0, 2)
        self.entries[f"{phase}|{where}|{what}"] = Entry(f"{phase}|{where}|{what}", digest(t), self._file.tell(),
                                                        t.dtype, tuple(t.shape))
        raw(t).numpy().tofile(self._file)

    def keep(self, key: str, t: torch.Tensor) -> None:
        """An attention call's tensor for its heads: the W_Q input, as `input|CALL|x` (O and the gradients are
        in the trace already)."""
        call, _, what = key.partition("|")
        if what == "x":
            self.see("input", call, what, t)

    def read(self, entry: Entry) -> torch.Tensor:
        self._file.seek(entry.offset)
        values = torch.from_numpy(np.fromfile(self._file, dtype=raw(torch.empty(0, dtype=entry.dtype)).numpy().dtype,
                                              count=math.prod(entry.shape)))
        return (values.view(entry.dtype) if entry.dtype.is_floating_point else values).reshape(entry.shape)

    def tensor(self, key: str) -> torch.Tensor | None:
        """The tensor of `key` (`phase|where|what`), None where the step produced none."""
        entry = self.entries.get(key)
        return None if entry is None else self.read(entry)

    def call_tensor(self, key: str) -> torch.Tensor | None:
        """An attention call's tensor (`CALL|WHAT`, as `keep` is handed it), None where the trace has none."""
        return self.tensor(f"{call_phase(key)}|{key}")

    def play(self, see: See, keep: Keep) -> None:
        """Hand every tensor of the trace to `see` and `keep` in execution order, as the step handed them."""
        for entry in self.entries.values():
            phase, where, what = split_key(entry.key)
            t = self.read(entry)
            if phase != "input":
                see(phase, where, what, t)
            if _CALL_KEY.fullmatch(where) and what in CALL:
                keep(f"{where}|{what}", t)


def split_key(key: str) -> tuple[str, str, str]:
    """A trace's key as (phase, where, what): a module's name may hold '|', the phase and what do not."""
    phase, rest = key.split("|", 1)
    where, what = rest.rsplit("|", 1)
    return phase, where, what


def call_phase(key: str) -> str:
    """The phase `see` hands a kept attention tensor (`CALL|WHAT`) in; the W_Q input is kept only."""
    what = key.rpartition("|")[2]
    return "forward" if what == "O" else "input" if what == "x" else "backward"


def raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers of its width (bfloat16 has no numpy type)."""
    return t.reshape(-1).view(WORDS[t.element_size()]) if t.is_floating_point() else t.reshape(-1)


def digest(t: torch.Tensor) -> int:
    return crc32c(raw(t).numpy())   # in place


class Tracer:
    """Hooks on a model that hand every tensor of a step, in execution order, to `see(phase, where, what, t)`:
    each module's outputs as its forward returns them, and the gradient of each as the backward computes it (a
    hook on the output tensor, which adds no node to the graph: a module's full backward hook would, and can
    change the order in which a tensor's gradients from several consumers are summed, and so their bits)."""

    def __init__(self, model: torch.nn.Module, see: See):
        self.model, self.see = model, see
        self.handles: list[Any] = []
        self.calls: dict[str, int] = defaultdict(int)
        for name, module in model.named_modules():
            if not name or module is model:
                continue
            self.handles.append(module.register_forward_hook(self._forward(name)))

    def _forward(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            n = self.calls[name]
            self.calls[name] += 1
            key = name if n == 0 else f"{name}#{n}"   # its backward's gradients go by its forward's call
            for i, t in enumerate(_tensors(output)):
                self.see("forward", key, "output" if i == 0 else f"output {i}", t)
                if t.requires_grad:
                    t.register_hook(_Numbered(self.see, "backward", key, "grad of output" + (f" {i}" if i else "")))
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@contextlib.contextmanager
def attention_traced(model: torch.nn.Module, see: See, keep: Keep) -> Iterator[None]:
    """Every attention call of a transformers `model` through the implementation it has now, its O and
    gradients (and S and P where they are handed out) to `see`, and to `keep` for the per-head signals with the
    input of W_Q's projection. The implementation keeps its name (transformers' code asks the name: flash
    attention's kernel, GPT-2's eager upcast, the masks), its function swapped in the attention interface for
    the block."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config: Any = model.config
    name = config._attn_implementation
    modules = hf_attention_modules(model)
    inner = ALL_ATTENTION_FUNCTIONS.get(name, sys.modules[type(modules[0]).__module__].eager_attention_forward)
    calls = _Calls()
    inputs: dict[int, torch.Tensor] = {}

    def pre(module: Any, args: Any, kwargs: Any) -> None:
        inputs[module.layer_idx] = _first_tensor(args, kwargs)

    def traced(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
               **kwargs: Any) -> Any:
        layer = module.layer_idx
        where = calls.next(layer)
        with internals.watching(whole_heads(see, where, query.shape[1])):
            if name == "eager":   # the model's own: S is the input of its softmax (kernels/internals.py)
                mask = args[0] if args else kwargs.get("attention_mask")
                out, scores = internals.eager_scores(lambda: inner(module, query, key, value, *args, **kwargs), mask)
            else:
                out, scores = inner(module, query, key, value, *args, **kwargs), None
        o = out[0] if isinstance(out, tuple) else out
        weights = out[1] if isinstance(out, tuple) and len(out) > 1 else None
        if scores is not None and isinstance(weights, torch.Tensor):
            see("forward", where, "S", scores)
        if isinstance(weights, torch.Tensor):   # transformers' eager attention returns its P (after its dropout)
            see("forward", where, "P", weights)
        # an attention function returns (batch, tokens, heads, head dim): O as (batch, heads, tokens, head dim)
        _traced_call(see, keep, where, o.transpose(1, 2), inputs[layer], (query, key, value), o, transposed=True)
        return out

    hooks = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in modules]
    try:
        with _swapped(ALL_ATTENTION_FUNCTIONS, name, traced):
            yield
    finally:
        for h in hooks:
            h.remove()
        inputs.clear()


@contextlib.contextmanager
def _swapped(interface: Any, name: str, function: Callable[..., Any]) -> Iterator[None]:
    """`interface[name]` is `function` for the block, then what it was (or nothing) again: in the mapping that
    answers for the name (an interface's own, else the one its class shares)."""
    mapping = interface._local_mapping if name in interface._local_mapping else type(interface)._global_mapping
    missing = object()
    was = mapping.get(name, missing)
    mapping[name] = function
    try:
        yield
    finally:
        if was is missing:
            del mapping[name]
        else:
            mapping[name] = was


def _first_tensor(args: Any, kwargs: Any) -> torch.Tensor:
    """A module's input: its first tensor argument, positional or by keyword (empty where it has none)."""
    found = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
    return torch.empty(0) if found is None else found.detach()


@contextlib.contextmanager
def sdpa_traced(modules: list[torch.nn.Module], see: See, keep: Keep) -> Iterator[None]:
    """Every call of SDPA (or of `causal_attention`) that the attention `modules` make (layer i is the i-th, as
    kernels/sdpa_dispatch.py counts them; its input is W_Q's), as `attention_traced` traces a transformers
    model's: through whatever routes it (a replay's `sdpa_dispatch`, entered before this, runs inside)."""
    mode = _SdpaCalls(see, keep)
    handles = []
    try:
        for layer, module in enumerate(modules):
            handles.append(module.register_forward_pre_hook(mode.entering(layer), with_kwargs=True))
            handles.append(module.register_forward_hook(mode.leaving(), always_call=True))
        with mode:
            yield
    finally:
        for handle in handles:
            handle.remove()


class _SdpaCalls(TorchFunctionMode):
    def __init__(self, see: See, keep: Keep):
        super().__init__()
        self.see, self.keep = see, keep
        self.active: list[tuple[int, torch.Tensor]] = []   # (layer, its module's input), innermost last
        self.calls = _Calls()

    def entering(self, layer: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
            self.active.append((layer, _first_tensor(args, kwargs)))
        return hook

    def leaving(self) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            self.active.pop()
        return hook

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in (_SDPA, causal_attention) or not self.active:
            return func(*args, **kwargs)
        layer, x = self.active[-1]
        names = ("query", "key", "value") if func is _SDPA else ("q", "k", "v")
        bound = dict(zip(names, args, strict=False)) | kwargs
        q, k, v = (bound[n] for n in names)
        where = self.calls.next(layer)
        with internals.watching(whole_heads(self.see, where, q.shape[1])):
            o = func(*args, **kwargs)
        _traced_call(self.see, self.keep, where, o, x, (q, k, v), o)
        return o


class _Calls:
    """The attention calls of a step by layer: `attention L`, then `attention L#1`, ... for its later calls
    (a layer's second micro-batch)."""

    def __init__(self) -> None:
        self._n: dict[int, int] = defaultdict(int)

    def next(self, layer: int) -> str:
        n = self._n[layer]
        self._n[layer] += 1
        return f"attention {layer}" + (f"#{n}" if n else "")


def _traced_call(see: See, keep: Keep, where: str, heads_o: torch.Tensor, x: torch.Tensor,
                 qkv: tuple[torch.Tensor, ...], o: torch.Tensor, transposed: bool = False) -> None:
    """An attention call's O (as (B, H, T, D)) and W_Q's input `x` handed out now; its dQ, dK, dV and dO once
    the backward has them (`o`: the output the model goes on with, `transposed` against `heads_o`)."""
    see("forward", where, "O", heads_o)
    keep(f"{where}|O", heads_o.detach())
    keep(f"{where}|x", x)
    for what, t in zip(("dQ", "dK", "dV"), qkv, strict=True):
        if t.requires_grad:
            t.register_hook(_grad_hook(see, keep, where, what))
    if o.requires_grad:
        o.register_hook(_grad_hook(see, keep, where, "dO", transposed=transposed))


def whole_heads(see: See, where: str, n_head: int) -> internals.Watcher:
    """Collects the S and P a call's backends hand out (kernels/internals.py), a group of heads at a time, and
    hands them to `see` as (batch, heads, queries, keys) once every head of the layer has given them (a flash
    backend in its backward: forward quantities, recomputed there). A layer with heads on a backend that hands
    out nothing (SDPA, Triton, plug-ins) gives none."""
    got: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}

    def watch(heads: list[int] | None, s: torch.Tensor | None, p: torch.Tensor) -> None:
        for i, head in enumerate(range(n_head) if heads is None else heads):
            got[head] = (None if s is None else s[:, i], p[:, i])
        if len(got) == n_head:
            for j, what in enumerate(("S", "P")):
                parts = [t for h in range(n_head) if (t := got[h][j]) is not None]
                if len(parts) < n_head:   # a backend of the layer kept it
                    continue
                held = functools.reduce(torch.promote_types, (t.dtype for t in parts))
                see("forward", where, what, torch.stack([t.to(held) for t in parts], 1))
            got.clear()
    return watch


def _grad_hook(see: See, keep: Keep, where: str, what: str, transposed: bool = False) -> Callable[[torch.Tensor], None]:
    handed = _Numbered(see, "backward", where, what)

    def hook(grad: torch.Tensor) -> None:
        grad = grad.transpose(1, 2) if transposed else grad
        handed(grad)
        if handed.fired == 1:   # a second backward through the call (a graph kept) is traced, not kept
            keep(f"{where}|{what}", grad.detach())
    return hook


class _Numbered:
    """A gradient hook that hands its gradient to `see`, numbered from its second firing on (`what #1`, ...: a
    second backward through a kept graph), so that no key is seen twice."""

    def __init__(self, see: See, phase: str, where: str, what: str):
        self.see, self.phase, self.where, self.what = see, phase, where, what
        self.fired = 0

    def __call__(self, grad: torch.Tensor) -> None:
        self.see(self.phase, self.where, self.what if self.fired == 0 else f"{self.what} #{self.fired}", grad)
        self.fired += 1


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if hasattr(value, "to_tuple"):   # a transformers ModelOutput
        return _tensors(value.to_tuple())
    return []


class StepTrace:
    """A script's step traced on this rank, as a `replay diff` of its run asks (`TraceRequest`): the model's
    modules and attention calls (a transformers model's through its attention interface, else its attention
    modules' SDPA calls, by `pattern` or by their names), and every parameter's gradient when the optimizer
    first steps (the gradient it steps on: after a script's clipping or unscaling), written into the
    request's directory; its index once `end` is called."""

    def __init__(self, request: TraceRequest, model: torch.nn.Module, optimizer: Any, pattern: str | None):
        self.file = TraceFile.create(Path(request.directory))
        self._module = unwrap(model)
        self._graded = False
        self._exits = contextlib.ExitStack()
        try:
            tracer = Tracer(self._module, self.file.see)
            self._exits.callback(tracer.close)
            inner = transformers_model_in(self._module) if pattern is None else None
            if inner is not None:
                self._exits.enter_context(attention_traced(inner, self.file.see, self.file.keep))
            else:
                self._exits.enter_context(sdpa_traced(_attention_modules(self._module, pattern), self.file.see,
                                                      self.file.keep))
            if optimizer is not None:
                handle = torch_optimizer(optimizer).register_step_pre_hook(lambda *_: self._gradients())
                self._exits.callback(handle.remove)
        except BaseException:
            self._exits.close()
            self.file.close()
            raise

    def _gradients(self) -> None:
        if self._graded:
            return
        self._graded = True
        for name, p in self._module.named_parameters():
            if p.grad is not None:
                self.file.see("gradient", name, "grad", p.grad)

    def end(self) -> None:
        """The step is done: the hooks removed, the gradients (if no optimizer step took them) and the index
        written."""
        try:
            self._exits.close()
            self._gradients()
            self.file.save()
        finally:
            self.file.close()


def _attention_modules(model: torch.nn.Module, pattern: str | None) -> list[torch.nn.Module]:
    """The attention modules whose calls are traced: by `pattern`, or by their names (none found: the modules'
    and the weights' tensors are traced all the same)."""
    try:
        return [module for _, module in attention_modules(model, pattern)]
    except UsageError:
        if pattern is not None:
            raise
        return []
