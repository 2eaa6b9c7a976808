import numpy as np
import pytest

from replay.config import build_config
from replay.errors import UsageError
from replay.train.data import DataOrder, builtin_corpus, make_data


def test_global_order_does_not_depend_on_world_size():
    order = DataOrder(n_samples=1000, batch_size=16, seed=7)
    for step in (0, 3, 70):   # step 70 is in the second epoch
        batch = order.step_ids(step)
        for world, mbs in [(1, 4), (2, 4), (4, 2), (8, 1)]:
            per_rank = [order.rank_ids(step, r, world, mbs) for r in range(world)]
            assert sorted(np.concatenate([p.ravel() for p in per_rank])) == sorted(batch)


def test_each_epoch_visits_every_sample_once():
    order = DataOrder(n_samples=64, batch_size=8, seed=1)
    first_epoch = np.concatenate([order.step_ids(s) for s in range(8)])
    assert sorted(first_epoch) == list(range(64))
    second = np.concatenate([order.step_ids(s) for s in range(8, 16)])
    assert sorted(second) == list(range(64)) and not np.array_equal(first_epoch, second)


def test_byte_corpus_samples_decode_to_the_source_text():
    cfg = build_config("tiny")
    tokens = builtin_corpus(1 << 16)
    data = make_data(cfg, tokens)
    x, y = data.batch(np.array([3]))
    T = cfg.model.block_size
    assert x.shape == (1, T) and y.shape == (1, T)
    assert bytes(tokens[3 * T: 3 * T + T + 1]).decode("utf-8", "replace") == data.describe(3)
    assert x[0, 1:].tolist() == y[0, :-1].tolist()   # targets are the inputs shifted by one


def test_too_short_data_is_refused(tmp_path):
    cfg = build_config("tiny", sets=["batch_size=8"])
    with pytest.raises(UsageError, match="too short"):
        make_data(cfg, np.zeros(200, dtype=np.uint16))


def test_token_ids_beyond_the_vocabulary_are_refused(tmp_path):
    cfg = build_config("tiny", sets=["model.vocab_size=100"])
    cfg.data.path = "train.bin"
    with pytest.raises(UsageError, match="token id 300"):
        make_data(cfg, np.full(10_000, 300, dtype=np.uint16))


def test_many_steps_at_once_are_the_steps_one_by_one():
    order = DataOrder(n_samples=50, batch_size=8, seed=3)   # step 6 (positions 48..55) straddles two epochs
    many = order.steps_ids(0, 13)
    perms = [np.random.default_rng([3, epoch]).permutation(50) for epoch in range(3)]   # the documented order
    expected = [[perms[p // 50][p % 50] for p in range(s * 8, s * 8 + 8)] for s in range(13)]
    assert many.tolist() == expected
    assert np.array_equal(order.step_ids(6), many[6]) and np.array_equal(order.steps_ids(5, 7), many[5:7])
