"""Weight layouts: every way a model stores a layer's attention gives the analysis the same (in, out) matrices."""

import numpy as np
import pytest

from replay.config import Launcher, ModelConfig
from replay.errors import UsageError
from replay.store.layout import Layout, layout_of, resolve_layout

D = 8
RNG = np.random.default_rng(0)
# The layer as the analysis takes it: x @ W for each of W_Q, W_K, W_V, W_O, W_fc, W_proj.
TRUE = {"q": RNG.normal(size=(D, D)), "k": RNG.normal(size=(D, D)), "v": RNG.normal(size=(D, D)),
        "o": RNG.normal(size=(D, D)), "fc": RNG.normal(size=(D, 4 * D)), "proj": RNG.normal(size=(4 * D, D))}


def _same(mats):
    assert set(mats) == set(TRUE)
    for name, m in TRUE.items():
        assert np.array_equal(mats[name], m), name


def test_gpt2_conv1d_stores_in_by_out_with_qkv_side_by_side():
    layout = layout_of(Launcher.LOCAL, None)   # the built-in trainer's
    keys = layout.keys(3)
    assert keys["qkv"] == "transformer.h.3.attn.c_attn.weight" and keys["proj"] == "transformer.h.3.mlp.c_proj.weight"
    stored = {"qkv": np.concatenate([TRUE["q"], TRUE["k"], TRUE["v"]], axis=1), "o": TRUE["o"],
              "fc": TRUE["fc"], "proj": TRUE["proj"]}
    _same(layout.matrices(stored))


def test_nanogpt_linear_stores_out_by_in_with_qkv_stacked():
    layout = Layout(**resolve_layout("nanogpt", ModelConfig()))
    stored = {"qkv": np.concatenate([TRUE["q"].T, TRUE["k"].T, TRUE["v"].T], axis=0), "o": TRUE["o"].T,
              "fc": TRUE["fc"].T, "proj": TRUE["proj"].T}
    _same(layout.matrices(stored))


def test_a_mapping_of_separate_projections_without_an_mlp():
    stored = resolve_layout({"q": "b.{layer}.wq", "k": "b.{layer}.wk", "v": "b.{layer}.wv", "o": "b.{layer}.wo"},
                            ModelConfig())
    layout = layout_of(Launcher.CUSTOM, stored)
    assert layout.keys(1) == {"q": "b.1.wq", "k": "b.1.wk", "v": "b.1.wv", "o": "b.1.wo"}
    mats = layout.matrices({name: TRUE[name].T for name in ("q", "k", "v", "o")})
    assert set(mats) == {"q", "k", "v", "o"} and np.array_equal(mats["k"], TRUE["k"])


@pytest.mark.parametrize("bad, message", [
    ("gpt3", "unknown layout 'gpt3'"),
    ({"q": "b.{layer}.wq", "o": "b.{layer}.wo"}, "either one fused 'qkv' key or the three keys"),
    ({"qkv": "b.wqkv", "o": "b.{layer}.wo"}, "has no '{layer}'"),
    ({"qkv": "b.{layer}.wqkv", "o": "b.{layer}.wo", "orientation": "rows"}, "orientation must be"),
    ({"qkv": "b.{layer}.wqkv", "o": "b.{layer}.wo", "gate": "b.{layer}.g"}, "unknown layout keys"),
])
def test_a_wrong_layout_is_named(bad, message):
    with pytest.raises(UsageError, match=message.replace("{", r"\{").replace("}", r"\}").replace("(", r"\(")):
        resolve_layout(bad, ModelConfig())


def test_a_loop_that_named_no_layout_has_none():
    assert layout_of(Launcher.CUSTOM, None) is None
