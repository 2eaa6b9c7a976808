"""Backend specs and per-layer / per-head plans: parsed, and named when wrong."""

import pytest

from replay.errors import UsageError
from replay.kernels.plan import AttentionPlan, BackendSpec


def test_specs_parse_to_options_and_back():
    spec = BackendSpec.parse("reference-emu:fix=safe-softmax,beta=2,tie=1e-3,br=32,bc=64,hp-delta")
    o = spec.options
    assert (o.placement, o.fix.beta, o.fix.tie_tol, o.block_r, o.block_c, o.hp_delta, o.hp_pv) == \
        ("reference", 2.0, 1e-3, 32, 64, True, False)
    assert BackendSpec.parse(spec.canonical()) == spec
    assert BackendSpec.parse("fa2-emu:fix=safe-softmax").options.fix.beta == 7.0   # the paper's stabilising beta


@pytest.mark.parametrize("text, match", [
    ("flash", "unknown attention backend 'flash'"),
    ("eager:fix=safe-softmax", "takes no options"),
    ("fa2-emu:beta=3", "beta and tie go with fix=safe-softmax"),
    ("fa2-emu:speed=11", "unknown option 'speed'"),
    ("fa2-emu:fix=magic", "unknown fix 'magic'"),
    ("fa2-emu:br=many", "bad option value"),
    ("baseline:dtype=fp8", "unknown precision 'fp8'"),
    ("fa2-emu;sdpa", "two defaults"),
])
def test_bad_specs_are_named(text, match):
    with pytest.raises(UsageError, match=match):
        AttentionPlan.parse(text)


def test_plan_resolves_most_specific_entry():
    plan = AttentionPlan.parse("eager;1=fa2-emu;1.7-8=reference-emu:fix=safe-softmax;0.3=sdpa")
    assert plan.backend_for(0, 0).name == "eager" and plan.backend_for(0, 3).name == "sdpa"
    assert plan.backend_for(1, 6).name == "fa2-emu"
    assert [plan.backend_for(1, h).name for h in (7, 8)] == ["reference-emu"] * 2
    assert AttentionPlan.parse(plan.canonical()) == plan
    with pytest.raises(UsageError, match="layer 1 head 7, but the model has layers 0..1 with heads 0..3"):
        plan.validate(n_layer=2, n_head=4)

