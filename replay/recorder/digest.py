"""A digest of a rank's training state, taken after every optimizer step: one 32-bit checksum per tensor of
its model (parameters and persistent buffers) and of its optimizer state, in a fixed order of names.

A replay takes the same digests, so "bit for bit" covers the whole state after every update, not only the
losses and the gradient norm: in FP32 a changed attention often moves the loss by less than its last bit
for a step or two while the weights have parted already (replayer/replays.py compares them).

- A tensor in host memory: the CRC-32C of its bytes (store/_crc32c.c: 30-60 GB/s on one core with AVX-512).
- A tensor on a GPU: two wrapping 64-bit integer sums of its words (the words, and their squares) reduced
  on the device, every tensor of a word width in one Triton launch (kernels/word_sums.py), so that only 16
  bytes per tensor cross to the host; their CRC-32C is the digest. Integer
  sums wrap modulo 2**64 whatever their order, so the digest is the same on every run of the same bits.

The names are the first step's; a tensor that appears later (an optimizer state created late) is folded
into the last slot, `LATE`, so nothing of the state goes unchecked.

Every step reads every byte of every tensor again, the host tensors' in one C call (store/integrity.py's
crc32c_spans). What it keeps from the step before is only the list of tensors and where their memory is, while
a `Watch` over everything that list was read from (each dict, list, set and field of the model and optimizer
that `model_and_optimizer` reads, and each tensor's address, size and contiguity) finds it unchanged; a state
that offers no watch (`tensors_watch`: recorder/state.py's TorchTrainState does) is named again every step.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from itertools import chain
from typing import Any

import numpy as np
import torch

from replay.store.integrity import crc32c, crc32c_spans

try:
    from replay.recorder import _watch
except ImportError:   # a source tree whose C modules are not built (`pip install -e .` builds them)
    _watch = None  # type: ignore[assignment]

LATE = "(tensors that appeared after the first step)"
WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}   # an element width -> the integers of it


def named_tensors(state: Any, rank: int) -> list[tuple[str, torch.Tensor]]:
    """The tensors a train state (recorder/state.py) holds on rank `rank`, by name: its own
    `named_tensors()`, else every tensor of that rank's checkpoint tree."""
    own = getattr(state, "named_tensors", None)
    if own is not None:
        return list(own())
    return list(_walk(state.state_dict(rank), ""))


def _walk(tree: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        yield path or "/", tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from _walk(value, f"{path}/{key}")
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from _walk(value, f"{path}/{i}")


def model_and_optimizer(model: torch.nn.Module, optimizer: Any) -> list[tuple[str, torch.Tensor]]:
    """A plain (or DDP's inner) model's parameters and persistent buffers, each stored tensor once (tied
    weights share one), and the optimizer's state of each parameter, by the parameter's name."""
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[tuple[int, torch.dtype, tuple[int, ...]]] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        local = _local(t)
        key = (local.data_ptr(), local.dtype, tuple(local.shape))
        if key not in seen:
            seen.add(key)
            out.append((f"model/{name}", local))
    names: dict[int, str] = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    for g, group in enumerate(getattr(optimizer, "param_groups", [])):
        for i, p in enumerate(group["params"]):
            param = names.get(id(p), f"group{g}.{i}")
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    out.append((f"optimizer/{param}/{key}", _local(value)))
    return out


# what a module may override, or hold, that would make its state dict other than its parameters and buffers
_OWN = ("state_dict", "_save_to_state_dict", "get_extra_state", "named_parameters", "named_modules", "_named_members")
_MODULE_FIELDS = ("_modules", "_parameters", "_buffers", "_state_dict_hooks", "_state_dict_pre_hooks",
                  "_non_persistent_buffers_set")
_OPTIMIZER_FIELDS = operator.attrgetter("param_groups", "state")
_NBYTES = operator.attrgetter("nbytes")
_NODES = (torch.Tensor, dict, list, set, torch.nn.Module)   # what a watch holds by identity (None too)
_LEAF = object()   # in a watch's snapshot: a value that need only still not be a node


class Watch:
    """What a list of tensors was read from, as it was then: dicts (their keys, in order, and values), fields
    (an object's __dict__ entry), lists, sets, other objects' fields by a getter, and the tensors' memory
    (address, size in bytes, contiguity). `unchanged()` says whether all of it still is; a value that was not
    None, a tensor, dict, list, set or module (a step count, a learning rate) need only still not be one. The
    dicts and fields are checked in C (recorder/_watch.c): after a training step most of them are out of the
    cache, and one tight loop waits for many of their misses at once."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors
        self.dicts: list[dict[Any, Any]] = []
        self.fields: list[tuple[dict[str, Any], str]] = []   # (an object's __dict__, a name)
        self.lists: list[list[Any]] = []
        self.sets: list[set[Any]] = []
        self.getters: list[tuple[Callable[[Any], tuple[Any, ...]], list[Any]]] = []   # (a getter of 2+ names, objects)

    def freeze(self) -> Watch:
        """Take the snapshot `unchanged` compares with."""
        self._sizes = list(map(len, self.dicts))
        self._entries = [x for d in self.dicts for k, v in dict.items(d) for x in (k, v if _is_node(v) else _LEAF)]
        self._at, self._names = [d for d, _ in self.fields], [k for _, k in self.fields]
        self._objects = [d.get(k) for d, k in self.fields]
        self._lengths = list(map(len, self.lists))
        self._items = list(chain.from_iterable(self.lists))
        self._set_copies = [set(s) for s in self.sets]
        self._held = self._got()
        self._pointers, self._bytes = self._memory()
        return self

    def unchanged(self) -> bool:
        return (same_dicts(self.dicts, self._sizes, self._entries, _LEAF, _NODES)
                and same_fields(self._at, self._names, self._objects)
                and list(map(len, self.lists)) == self._lengths
                and all(map(operator.is_, chain.from_iterable(self.lists), self._items))
                and all(map(operator.is_, self._got(), self._held))
                and self.sets == self._set_copies
                and self._memory() == (self._pointers, self._bytes)
                and all(map(torch.Tensor.is_contiguous, self.tensors)))

    def _got(self) -> list[Any]:
        return [*chain.from_iterable(chain.from_iterable(map(get, objects) for get, objects in self.getters))]

    def _memory(self) -> tuple[list[int], list[int]]:
        return list(map(torch.Tensor.data_ptr, self.tensors)), list(map(_NBYTES, self.tensors))


def _is_node(value: Any) -> bool:
    return value is None or isinstance(value, _NODES)


def _same_dicts(dicts: list[dict[Any, Any]], sizes: list[int], entries: list[Any], leaf: object,
                nodes: tuple[type, ...]) -> bool:
    """recorder/_watch.c's same_dicts, for a source tree whose C modules are not built."""
    if list(map(len, dicts)) != sizes:
        return False
    now = [x for d in dicts for kv in dict.items(d) for x in kv]
    return len(now) == len(entries) and all(
        now[i] is entries[i] and (now[i + 1] is entries[i + 1] if entries[i + 1] is not leaf
                                  else not isinstance(now[i + 1], nodes)) for i in range(0, len(now), 2))


def _same_fields(dicts: list[dict[str, Any]], names: list[str], objects: list[Any]) -> bool:
    """recorder/_watch.c's same_fields, for a source tree whose C modules are not built."""
    return all(map(operator.is_, map(dict.get, dicts, names), objects))


same_dicts, same_fields = (_watch.same_dicts, _watch.same_fields) if _watch else (_same_dicts, _same_fields)


def watch_model_and_optimizer(model: torch.nn.Module, optimizer: Any,
                              tensors: list[tuple[str, torch.Tensor]]) -> Watch | None:
    """A watch over what `model_and_optimizer(model, optimizer)` read, having given `tensors`: while it holds, that
    call would give the same tensors again. None where a watch could not vouch for that: a module with a state
    dict of its own or a hook on it, a sharded (DTensor) or non-contiguous tensor, two tensors over the same
    memory, an optimizer not kept in plain dicts and lists."""
    modules = list(model.modules())
    if any(getattr(type(m), name) is not getattr(torch.nn.Module, name) for m in modules for name in _OWN) \
            or any(m._state_dict_hooks or m._state_dict_pre_hooks for m in modules):
        return None
    held = list(model.state_dict(keep_vars=True).values())
    own = [t for _, t in tensors]
    if any(hasattr(t, "to_local") or not t.is_contiguous() for t in held + own):
        return None
    by_address = {t.data_ptr(): t for t in held + own}
    if len({id(t) for t in by_address.values()}) != len({id(t) for t in held + own}):
        return None   # two tensor objects share an address: which of them counts once may change unseen
    watch = Watch(list({id(t): t for t in held + own}.values()))
    for m in modules:
        watch.fields += [(vars(m), name) for name in _MODULE_FIELDS]
        watch.dicts += [m._modules, m._parameters, m._buffers, m._state_dict_hooks, m._state_dict_pre_hooks]
        watch.sets.append(m._non_persistent_buffers_set)
    return watch.freeze() if _watch_optimizer(watch, optimizer) else None


def _watch_optimizer(watch: Watch, optimizer: Any) -> bool:
    """Watch the optimizer's param groups (each one's parameters) and its state (each parameter's); False for
    an optimizer not kept in plain dicts and lists."""
    groups = getattr(optimizer, "param_groups", None)
    state = getattr(optimizer, "state", None)
    if not isinstance(groups, list) or not isinstance(state, dict) \
            or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        return False
    watch.getters.append((_OPTIMIZER_FIELDS, [optimizer]))
    watch.lists += [groups, *(g["params"] for g in groups)]
    watch.dicts += [*groups, state, *(s for s in state.values() if isinstance(s, dict))]
    return True


def _local(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) tensor's piece on this rank."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


class StateDigest:
    """Call it after each optimizer step: this rank's digests, in the order of `names` (fixed at the first
    call). `kind` says how they were taken ("crc32c" in host memory, "crc32c+sum64" with tensors on a GPU):
    digests of two kinds are not compared."""

    def __init__(self, state: Any, rank: int):
        self.state, self.rank = state, rank
        self.names: list[str] | None = None
        self.kind: str | None = None
        self._index: dict[str, int] = {}
        self._plan: _Plan | None = None
        self._watch: Watch | None = None

    def __call__(self) -> np.ndarray:
        if self._plan is None or self._watch is None or not self._watch.unchanged():
            self._plan = self._new_plan()
        return self._plan.digests()

    def _new_plan(self) -> _Plan:
        tensors = named_tensors(self.state, self.rank)
        if self.names is None:
            self.names = [name for name, _ in tensors] + [LATE]
            self._index = {name: i for i, name in enumerate(self.names)}
            self.kind = "crc32c+sum64" if any(t.is_cuda for _, t in tensors) else "crc32c"
        watch = getattr(self.state, "tensors_watch", None)
        self._watch = watch(tensors) if watch is not None else None
        return _Plan(tensors, self._index)


class _Plan:
    """How the digests of `tensors` are taken: the host ones' CRC-32Cs in one call over their memory (a
    non-contiguous one's copied first), the GPU ones' sums on the device; each into its name's slot (`index`),
    those without one folded into the last. `direct`: every tensor is in host memory, contiguous, in its slot's
    place, and the call writes the slots itself."""

    def __init__(self, tensors: list[tuple[str, torch.Tensor]], index: dict[str, int]):
        self.tensors, self.index, self.width = tensors, index, len(index)
        self.host = [i for i, (_, t) in enumerate(tensors) if not t.is_cuda]
        self.strided = [row for row, i in enumerate(self.host) if not tensors[i][1].is_contiguous()]
        self.spans = np.array([(t.data_ptr(), t.nbytes) for _, t in (tensors[i] for i in self.host)],
                              dtype=np.int64).reshape(-1, 2)
        self.direct = (not self.strided and len(self.host) == len(tensors) == self.width - 1
                       and all(index.get(name) == i for i, (name, _) in enumerate(tensors)))
        self.on_device = [i for i, (_, t) in enumerate(tensors) if t.is_cuda]
        self.device_sums = _fused_sums([tensors[i][1] for i in self.on_device])

    def digests(self) -> np.ndarray:
        out = np.zeros(self.width, dtype=np.uint32)
        if self.direct:
            crc32c_spans(self.spans, out[:-1])
            return out
        copies = [self.tensors[self.host[row]][1].contiguous() for row in self.strided]
        for row, copy in zip(self.strided, copies, strict=True):
            self.spans[row] = (copy.data_ptr(), copy.nbytes)
        host = np.zeros(len(self.host), dtype=np.uint32)
        crc32c_spans(self.spans, host)
        values = dict(zip(self.host, host.tolist(), strict=True))
        sums = (self.device_sums() if self.device_sums is not None
                else _device_sums([self.tensors[i][1] for i in self.on_device]))
        values.update(zip(self.on_device, _sum_digests(sums), strict=True))
        late: list[int] = []
        for i, (name, _) in enumerate(self.tensors):
            slot = self.index.get(name)
            if slot is None:
                late.append(values[i])
            else:
                out[slot] = values[i]
        if late:
            out[-1] = crc32c(np.asarray(late, dtype=np.uint32))
        return out


def _fused_sums(tensors: list[torch.Tensor]) -> Callable[[], torch.Tensor] | None:
    """The GPU tensors' sums in one Triton launch per word width (kernels/word_sums.py), where every one is
    contiguous on one CUDA device and Triton runs there; else None, and `_device_sums` takes them one by one.
    Both give the same sums."""
    if not tensors or any(not t.is_contiguous() or t.device != tensors[0].device or t.element_size() not in WORDS
                          for t in tensors):
        return None
    if torch.cuda.get_device_capability(tensors[0].device)[0] < 7:
        return None   # Triton's oldest target
    from replay.kernels.word_sums import WordSums

    return WordSums([t.detach() for t in tensors])


def _device_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's two sums, int64 of shape (len(tensors), 2), tensor by tensor with torch's reductions."""
    rows = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        if flat.element_size() not in WORDS:
            flat = flat.contiguous().view(torch.uint8)
        words = flat.view(WORDS[flat.element_size()]).to(torch.int64)
        rows.append(torch.stack([words.sum(), (words * words).sum()]))
    return torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.int64)


def _sum_digests(sums: torch.Tensor) -> list[int]:
    """The digest of each row of two sums: the CRC-32C of its 16 bytes (two little-endian int64), in one call."""
    host = np.ascontiguousarray(sums.cpu().numpy(), dtype="<i8")
    spans = np.stack([host.ctypes.data + 16 * np.arange(len(host), dtype=np.int64),
                      np.full(len(host), 16, dtype=np.int64)], axis=1)
    out = np.zeros(len(host), dtype=np.uint32)
    crc32c_spans(spans, out)
    return out.tolist()
