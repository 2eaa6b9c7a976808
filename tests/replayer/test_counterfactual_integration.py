"""The overrides a bisect probes with: learning rates scaled on one layer or one head, and samples left
out of a step. One-step replays on warm ranks, checked against an independent computation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from replay.errors import UsageError
from replay.replayer.overrides import parse_drop, parse_heads
from replay.replayer.replays import ReplayRequest, prepare, run
from replay.store import RunStore
from replay.store.overrides import Overrides
from replay.train.data import load_data
from replay.train.model import build_model
from tests.conftest import error_line, replay_cli, tree_snapshot

D = 32   # head width of the tiny model: 64 wide, 2 heads


def _model(store: RunStore, step: int) -> dict[str, torch.Tensor]:
    return store.read_shard(step, 0)["state"]["replicated"]["model"]


def _scaled(name: str, unit: tuple[int, int] | None, layer: int | None) -> torch.Tensor | None:
    """The mask of the entries of parameter `name` the scope scales, or None for none of them."""
    if layer is not None:
        return True if name.startswith(f"transformer.h.{layer}.") else None
    lyr, head = unit
    cols = [part * 64 + head * D + i for part in range(3) for i in range(D)]
    if name == f"transformer.h.{lyr}.attn.c_attn.weight":
        m = torch.zeros(64, 192, dtype=torch.bool)
        m[:, cols] = True
        return m
    if name == f"transformer.h.{lyr}.attn.c_attn.bias":
        m = torch.zeros(192, dtype=torch.bool)
        m[cols] = True
        return m
    if name == f"transformer.h.{lyr}.attn.c_proj.weight":
        m = torch.zeros(64, 64, dtype=torch.bool)
        m[head * D:(head + 1) * D] = True
        return m
    return None


def test_scoped_lr_scale_halves_only_that_layers_or_heads_update(store_copy, rank_pool):
    # on the worker's warm ranks (tests/conftest.py): the subject is what the replays compute, not how ranks start
    plain = run(store_copy, ReplayRequest(10, 10), ranks=rank_pool)
    layer = run(store_copy, ReplayRequest(10, 10, overrides=Overrides(lr_scale=0.5, layers=[1])), ranks=rank_pool)
    head = run(store_copy, ReplayRequest(10, 10, overrides=Overrides(lr_scale=0.5, units=[[1, 0]])), ranks=rank_pool)
    before = _model(RunStore.open(store_copy), 10)
    after = _model(RunStore.open(plain.location), 11)
    for result, scope in ((layer, {"layer": 1, "unit": None}), (head, {"layer": None, "unit": (1, 0)})):
        got = _model(RunStore.open(result.location), 11)
        n_scaled = 0
        for name, p0 in before.items():
            mask = _scaled(name, scope["unit"], scope["layer"])
            half = p0 + 0.5 * (after[name] - p0)
            if mask is None:
                assert torch.equal(got[name], after[name]), name     # outside the scope: the plain update
                continue
            expected = torch.where(torch.as_tensor(mask), half, after[name])
            torch.testing.assert_close(got[name], expected, rtol=0, atol=1e-7)
            n_scaled += int(torch.as_tensor(mask).expand_as(p0).sum())
        assert n_scaled > 0 and not torch.equal(got["transformer.h.1.attn.c_attn.weight"],
                                                after["transformer.h.1.attn.c_attn.weight"])


def test_a_dropped_sample_leaves_the_step_the_mean_loss_of_the_rest(store_copy, rank_pool):
    record = RunStore.open(store_copy)
    ids = np.asarray(record.read_steps(["sample_ids"])["sample_ids"][10])   # (rank, micro, sample)
    dropped = int(ids[0, 0, 1])
    result = run(store_copy, ReplayRequest(10, 10, overrides=Overrides(drop=[[10, dropped]])), ranks=rank_pool)
    replayed = RunStore.open(result.location).read_steps(["loss", "rank_loss"])
    recorded = record.read_steps(["rank_loss"])["rank_loss"][10]

    # every sample's loss at checkpoint 10, computed here with transformers' GPT-2 on the stored weights
    cfg = record.manifest.config
    data = load_data(cfg, record)
    model = build_model(cfg.model, data.vocab_size, cfg.seed)
    model.load_state_dict(_model(record, 10))
    x, y = data.batch(ids.reshape(-1))
    with torch.no_grad():
        logits = model(input_ids=x).logits
    per_sample = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="none")
    per_sample = per_sample.view(len(x), -1).mean(dim=1).numpy()
    kept = ids.reshape(-1) != dropped
    assert replayed["loss"][0] == pytest.approx(per_sample[kept].mean(), rel=1e-5)   # the step: the 7 kept
    assert per_sample[kept].mean() != pytest.approx(per_sample.mean(), rel=1e-5)
    # rank 1 kept all its samples: its share is its recorded loss on the step's scale (8 samples / 7 kept)
    assert replayed["rank_loss"][0][1] == pytest.approx(recorded[1] * 8 / 7, rel=1e-6)


@pytest.mark.parametrize("text, parse, expected", [
    ("13:x", parse_drop, "--drop expects step:sample pairs"),
    ("1.x", parse_heads, "--heads expects heads like 7,8"),
])
def test_malformed_scopes_and_drops_are_named(text, parse, expected):
    with pytest.raises(UsageError, match=expected):
        parse(text)
    assert parse_heads("1.0,0.1") == (None, [[0, 1], [1, 0]]) and parse_drop("9:2,8:4") == [[8, 4], [9, 2]]


@pytest.mark.parametrize("overrides, expected", [
    (Overrides(drop=[[3, 1]]), "--drop step 3 is outside the window 12..14"),
    (Overrides(skip=[13], drop=[[13, 1]]), "step 13 is both skipped and has samples dropped"),
    (Overrides(lr_scale=0.5, layers=[1], units=[[1, 0]]), "layer.head pairs name their layers"),
    (Overrides(layers=[1]), "add --attention, --fix, --hp-delta or --lr-scale"),
])
def test_bad_counterfactuals_are_refused_before_anything_is_written(store_copy, overrides, expected):
    before = tree_snapshot(store_copy)
    with pytest.raises(UsageError, match=expected):
        prepare(RunStore.open(store_copy), ReplayRequest(12, 14, overrides=overrides))
    assert tree_snapshot(store_copy) == before


def test_a_sample_not_trained_at_that_step_is_one_line(store_copy):
    line = error_line(replay_cli("run", str(store_copy), "--from", "12", "--to", "14", "--drop", "13:99999"))
    assert "sample 99999 was not trained on at step 13" in line and "replay batch" in line
