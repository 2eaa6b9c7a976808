import random

import numpy as np
import pytest
import torch

from replay.store.tensors import checksum, flatten, numpy_to_tensor, tensor_to_numpy, unflatten


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool])
def test_tensor_round_trip_keeps_every_bit(dtype):
    src = (torch.randn(5, 7) * 100).to(dtype)
    a, name = tensor_to_numpy(src)
    back = numpy_to_tensor(a, name)
    assert back.dtype == dtype and back.shape == src.shape
    assert torch.equal(back.view(torch.uint8), src.view(torch.uint8))


def test_bfloat16_is_stored_as_its_raw_bits():
    x = torch.tensor([1.0, -2.5, 3.140625], dtype=torch.bfloat16)
    a, name = tensor_to_numpy(x)
    assert name == "bfloat16" and a.dtype == np.uint16
    # 1.0 in bfloat16 is 0x3F80, -2.5 is 0xC020: the top half of the float32 bit patterns
    assert a.tolist()[:2] == [0x3F80, 0xC020]


def test_zero_dim_tensor_keeps_its_shape():
    back = numpy_to_tensor(*tensor_to_numpy(torch.tensor(3.0)))
    assert back.shape == () and back.item() == 3.0


def test_state_tree_round_trip_with_int_keys_tuples_and_rng_states():
    opt_like = {"state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.ones(3)}},
                "param_groups": [{"betas": (0.9, 0.95), "lr": 1e-3, "params": [0], "foreach": None}],
                "inf": float("inf"), "np": np.random.get_state()[1]}
    skeleton, arrays = flatten(opt_like)
    restored = unflatten(skeleton, {k: (a if d == "numpy" else numpy_to_tensor(a, d)) for k, (a, d) in arrays.items()})
    assert list(restored["state"]) == [0]                      # int keys stay int
    assert restored["param_groups"][0]["betas"] == (0.9, 0.95)  # tuples stay tuples
    assert restored["inf"] == float("inf")
    assert np.array_equal(restored["np"], opt_like["np"])
    assert torch.equal(restored["state"][0]["exp_avg"], torch.ones(3))


def test_arbitrary_objects_are_refused_rather_than_pickled():
    with pytest.raises(TypeError, match="only tensors, arrays and scalars"):
        flatten({"fn": random.Random()})


def test_checksum_sees_a_single_flipped_bit_and_a_reshape():
    a = np.arange(12, dtype=np.float32)
    b = a.copy()
    b.view(np.uint32)[5] ^= 1
    assert checksum(a) != checksum(b)
    assert checksum(a) != checksum(a.reshape(3, 4))
    assert checksum(a) == checksum(a.copy())
