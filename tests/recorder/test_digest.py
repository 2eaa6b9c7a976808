"""The per-step state digest (recorder/digest.py): one checksum per tensor of a rank's model and optimizer state,
in a fixed order of names, that changes when any bit of that tensor changes and only then."""

from __future__ import annotations

import google_crc32c
import numpy as np
import pytest
import torch

from replay.recorder import digest as digest_module
from replay.recorder.digest import LATE, StateDigest, _device_sums, _sum_digests, model_and_optimizer
from replay.recorder.state import TorchTrainState
from replay.store.integrity import crc32c


def _tied_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 11, bias=False))
    model[2].weight = model[0].weight   # tied, as GPT-2's embedding and head
    return model


def _stepped() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _tied_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()
    return model, opt


def test_each_tensor_once_by_name_with_its_optimizer_state():
    model, opt = _stepped()
    names = [name for name, _ in model_and_optimizer(model, opt)]
    assert names == ["model/0.weight", "model/1.weight", "model/1.bias",
                     *[f"optimizer/{p}/{k}" for p in ("0.weight", "1.weight", "1.bias")
                       for k in ("step", "exp_avg", "exp_avg_sq")]]


def test_a_digest_is_the_crc32c_of_the_tensors_bytes():
    model, opt = _stepped()
    digest = StateDigest(TorchTrainState(model, opt), rank=0)
    values = digest()
    assert digest.names is not None and digest.names[-1] == LATE and digest.kind == "crc32c"
    weight = model[1].weight.detach().numpy().tobytes()
    assert values[digest.names.index("model/1.weight")] == google_crc32c.value(weight)
    assert values[-1] == 0   # no tensor appeared late


def test_one_flipped_bit_changes_that_tensors_digest_and_no_other():
    model, opt = _stepped()
    digest = StateDigest(TorchTrainState(model, opt), rank=0)
    before = digest()
    with torch.no_grad():
        bits = opt.state[model[1].bias]["exp_avg"].view(torch.int32)
        bits[2] ^= 1
    after = digest()
    assert digest.names is not None
    assert [digest.names[i] for i in np.flatnonzero(before != after)] == ["optimizer/1.bias/exp_avg"]
    with torch.no_grad():
        bits[2] ^= 1
    assert np.array_equal(digest(), before)


def test_bf16_and_non_contiguous_tensors_are_digested_by_their_bytes():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16)
    model = torch.nn.Module()
    model.register_buffer("b", t)
    model.register_buffer("strided", torch.arange(12.0).reshape(3, 4).t())
    digest = StateDigest(TorchTrainState(model, torch.optim.SGD([torch.zeros(1, requires_grad=True)])), rank=0)
    values = digest()
    assert values[0] == google_crc32c.value(t.view(torch.int16).numpy().tobytes())
    assert values[1] == google_crc32c.value(np.ascontiguousarray(torch.arange(12.0).reshape(3, 4).t().numpy()))


def test_a_tensor_that_appears_after_the_first_step_is_covered_by_the_last_slot():
    model = _tied_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    digest = StateDigest(TorchTrainState(model, opt), rank=0)
    first = digest()   # before any step: AdamW holds no state yet
    model(torch.tensor([[1, 2]])).sum().backward()
    opt.step()
    second = digest()
    assert digest.names is not None and not any(n.startswith("optimizer/") for n in digest.names)
    assert first[-1] == 0 and second[-1] != 0


def test_the_device_digest_is_a_function_of_the_bits_alone():
    """The GPU's digest (integer sums reduced on the device), run here on host tensors: equal bits give equal
    digests, one flipped bit another, whatever tensor holds them."""
    def digest(t):
        return _sum_digests(_device_sums([t]))

    a = torch.randn(1000)
    b = a.clone()
    assert digest(a) == digest(b)
    b.view(torch.int32)[500] ^= 1 << 7
    assert digest(a) != digest(b)
    assert digest(a.to(torch.bfloat16)) != digest(a)
    words = a.view(torch.int32).to(torch.int64)
    pair = np.array([words.sum().item(), (words * words).sum().item()], dtype="<i8")
    assert digest(a) == [google_crc32c.value(pair.tobytes())]   # the CRC-32C of the two sums' 16 bytes


def _reference(names: list[str], model: torch.nn.Module, opt: torch.optim.Optimizer) -> np.ndarray:
    """The digests taken the straightforward way: every tensor named now, the CRC-32C of its bytes one by one."""
    out, late = np.zeros(len(names), dtype=np.uint32), []
    for name, t in model_and_optimizer(model, opt):
        value = crc32c(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        if name in names[:-1]:
            out[names.index(name)] = value
        else:
            late.append(value)
    if late:
        out[-1] = crc32c(np.asarray(late, dtype=np.uint32).tobytes())
    return out


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()


def _changes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list:
    """What a script may do to its state between two digests, each unseen by torch's version counters or
    changing which tensors there are."""
    emb, norm, head = model[0], model[1], model[2]

    def new_storage():
        norm.weight.data = norm.weight.data.clone() + 1

    def same_address_fewer_bytes():
        norm.scratch.data = norm.scratch.data[:2]

    def same_address_transposed():
        norm.scratch.data = norm.scratch.data.t()

    def new_parameter():
        norm.bias = torch.nn.Parameter(torch.ones(4))

    def new_buffer():
        norm.register_buffer("seen", torch.arange(3.0))
        norm.register_buffer("scratch", torch.arange(12.0).reshape(3, 4))

    def replaced_buffer():
        norm.seen = torch.arange(3.0) * 2

    def non_persistent():
        norm.register_buffer("seen", norm.seen, persistent=False)

    def untied():
        head.weight = torch.nn.Parameter(emb.weight.detach().clone())

    def optimizer_reloaded():
        opt.load_state_dict(opt.state_dict())

    def state_replaced():
        opt.state[norm.weight]["exp_avg"] = torch.full_like(norm.weight, 3.0)

    def new_group():
        opt.add_param_group({"params": [head.weight]})

    return [new_storage, new_parameter, new_buffer, same_address_fewer_bytes, same_address_transposed,
            replaced_buffer, non_persistent, untied, optimizer_reloaded, state_replaced, new_group]


@pytest.mark.parametrize("checks", ["C", "Python"])
def test_the_digests_are_the_straightforward_ones_step_after_step_whatever_the_script_changes(monkeypatch, checks):
    """The digest keeps the list of tensors while a watch over the model and optimizer finds nothing changed:
    after each change a script may make (and steps in between), its digests are exactly those of every
    tensor named again and checksummed one by one; with the watch's dict checks in C (recorder/_watch.c) or,
    in a source tree whose C modules are not built, in Python."""
    assert digest_module._watch is not None, "the C modules are built (pip install -e .)"
    if checks == "Python":
        monkeypatch.setattr(digest_module, "same_dicts", digest_module._same_dicts)
        monkeypatch.setattr(digest_module, "same_fields", digest_module._same_fields)
    model, opt = _stepped()
    digest = StateDigest(TorchTrainState(model, opt), rank=0)
    assert np.array_equal(digest(), _reference(digest.names, model, opt))
    assert digest._watch is not None   # a plain model and optimizer: watched
    named = []
    monkeypatch.setattr(digest_module, "model_and_optimizer",
                        lambda *a: named.append(1) or model_and_optimizer(*a))
    for _ in range(3):
        _step(model, opt)
        assert np.array_equal(digest(), _reference(digest.names, model, opt))
    assert not named   # nothing changed: the tensors were not named again
    for change in _changes(model, opt):
        change()
        assert np.array_equal(digest(), _reference(digest.names, model, opt)), change.__name__
        _step(model, opt)
        assert np.array_equal(digest(), _reference(digest.names, model, opt)), change.__name__


def test_an_unwatchable_state_is_named_again_every_step():
    """A module with a state_dict of its own: no watch; the digests are still the straightforward ones."""
    class Own(torch.nn.Linear):
        def state_dict(self, *args, **kwargs):
            return super().state_dict(*args, **kwargs)

    model = torch.nn.Sequential(Own(3, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    digest = StateDigest(TorchTrainState(model, opt), rank=0)
    for _ in range(2):
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        assert np.array_equal(digest(), _reference(digest.names, model, opt))
        assert digest._watch is None


def test_the_watchs_dict_checks_in_c_answer_as_in_python():
    """recorder/_watch.c's same_dicts and same_fields against their Python forms, on each kind of change."""
    from replay.recorder import _watch

    t, u = torch.zeros(1), torch.ones(1)
    leaf, nodes = digest_module._LEAF, digest_module._NODES

    def snapshot(d):
        return [len(d)], [x for k, v in d.items() for x in (k, v if v is None or isinstance(v, nodes) else leaf)]

    changes = [lambda d: None, lambda d: d.update(a=u), lambda d: d.update(step=3), lambda d: d.update(step=u),
               lambda d: d.update(z=None), lambda d: d.pop("none"), lambda d: d.update(none=t),
               lambda d: (d.pop("a"), d.update(a=t))]   # the same entries in another order
    for change in changes:
        d = {"a": t, "step": 2, "none": None}
        sizes, entries = snapshot(d)
        change(d)
        expected = digest_module._same_dicts([d], sizes, entries, leaf, nodes)
        assert _watch.same_dicts([d], sizes, entries, leaf, nodes) is expected
        assert _watch.same_fields([d], ["a"], [t]) is digest_module._same_fields([d], ["a"], [t])
    assert [digest_module._same_dicts([d], *snapshot(d), leaf, nodes) for d in [{"a": t}]] == [True]
