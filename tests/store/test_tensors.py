import random

import numpy as np
import pytest
import torch

from replay.store.tensors import layout, pack, unpack
from tests.conftest import tensors_equal


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool])
def test_round_trip_keeps_every_bit(dtype):
    src = (torch.randn(5, 7) * 100).to(dtype)
    back = unpack(pack({"x": src}))["x"]
    assert back.dtype == dtype and back.shape == src.shape
    assert torch.equal(back.view(torch.uint8), src.view(torch.uint8))


def test_bfloat16_is_stored_as_its_raw_bits():
    packed = pack({"x": torch.tensor([1.0, -2.5, 3.140625], dtype=torch.bfloat16)})
    stored = packed.view("/x")
    assert packed.index["/x"]["dtype"] == "bfloat16" and stored.dtype == np.uint16
    # 1.0 in bfloat16 is 0x3F80, -2.5 is 0xC020: the top half of the float32 bit patterns
    assert stored.tolist()[:2] == [0x3F80, 0xC020]


def test_the_buffer_is_a_copy_that_later_updates_cannot_reach():
    w = torch.ones(4)
    packed = pack({"w": w})
    w.add_(1)                                        # what an optimizer step does in place
    assert unpack(packed)["w"].tolist() == [1.0] * 4


def test_tied_tensors_are_stored_once_and_read_as_equal():
    emb = torch.randn(16, 8)
    tree = {"wte": emb, "lm_head": emb, "other": emb.clone()}
    packed = pack(tree)
    assert packed.index["/wte"]["offset"] == packed.index["/lm_head"]["offset"]
    assert packed.index["/other"]["offset"] != packed.index["/wte"]["offset"]
    assert len(packed.buffer) == 2 * emb.numel() * 4
    assert tensors_equal(unpack(packed), tree)


def test_zero_dim_and_empty_tensors_keep_their_shape():
    back = unpack(pack({"a": torch.tensor(3.0), "b": torch.zeros(0, 3)}))
    assert back["a"].shape == () and back["a"].item() == 3.0 and back["b"].shape == (0, 3)


def test_state_tree_round_trip_with_int_keys_tuples_and_numpy_state():
    tree = {"state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.ones(3)}},
            "param_groups": [{"betas": (0.9, 0.95), "lr": 1e-3, "params": [0], "foreach": None}],
            "inf": float("inf"), "np": np.random.get_state()[1]}
    restored = unpack(pack(tree))
    assert list(restored["state"]) == [0]                      # int keys stay int
    assert restored["param_groups"][0]["betas"] == (0.9, 0.95)  # tuples stay tuples
    assert restored["inf"] == float("inf")
    assert isinstance(restored["np"], np.ndarray) and np.array_equal(restored["np"], tree["np"])
    assert tensors_equal(restored["state"], tree["state"])


def test_arbitrary_objects_are_refused_rather_than_pickled():
    with pytest.raises(TypeError, match="only tensors, arrays and scalars"):
        pack({"fn": random.Random()})
    with pytest.raises(TypeError, match="object array"):
        pack({"a": np.array([object()])})


def test_pack_reuses_a_buffer_large_enough_and_leaves_a_small_one():
    tree = {"a": torch.arange(10, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16)}
    big = np.full(4096, 7, dtype=np.uint8)
    packed = pack(tree, into=big)
    assert np.shares_memory(packed.buffer, big) and len(packed.buffer) == layout(tree).size
    assert tensors_equal(unpack(packed), tree)
    small = np.zeros(8, dtype=np.uint8)
    assert not np.shares_memory(pack(tree, into=small).buffer, small)


def test_layout_segments_are_the_tensors_own_memory():
    w = torch.randn(6, 5)
    lay = layout({"w": w, "t": w.t(), "n": np.arange(4)})   # a transposed view is not contiguous: copied
    segments = dict((lay.index[k]["offset"], k) for k in lay.index)
    by_key = {segments[o]: a for o, a in lay.segments()}
    assert np.shares_memory(by_key["/w"], w.numpy())
    assert not np.shares_memory(by_key["/t"], w.numpy()) and np.array_equal(
        by_key["/t"].view(np.float32).reshape(5, 6), w.t().numpy())
    assert lay.size == sum(-(-lay.index[k]["nbytes"] // 64) * 64 for k in lay.index)


def test_the_gaps_between_packed_tensors_are_zero_not_leftover_memory():
    tree = {f"t{i}": torch.full((3 + i,), 7, dtype=torch.uint8) for i in range(40)}   # 40 gaps before 64-byte marks
    size = layout(tree).size
    for _ in range(20):   # memory of that size that held ones, freed, for the allocator to hand out again
        dirty = np.full(size, 0xFF, dtype=np.uint8)
        del dirty
        packed = pack(tree)
        spans = np.zeros(size, dtype=bool)
        for entry in packed.index.values():
            spans[entry["offset"]: entry["offset"] + entry["nbytes"]] = True
        assert not packed.buffer[~spans].any()
