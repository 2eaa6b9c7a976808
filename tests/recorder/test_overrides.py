"""A replay's overrides as the loop applies them (recorder/overrides.py): read from the replay's spec, and
applied through their hooks on a real optimizer and scheduler."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch

from replay.config import RunConfig
from replay.errors import UsageError
from replay.kernels.plan import AttentionPlan
from replay.recorder.overrides import ReplayOverrides, UnreachedOverride, torch_optimizer
from replay.store.manifest import ReplaySpec
from replay.store.overrides import Overrides


def _spec(**fields) -> ReplaySpec:
    return dataclasses.replace(ReplaySpec("../..", 3, 6, 2, "regular", 0, Overrides()), **fields)


def _sgd(lr: float = 0.1) -> tuple[torch.nn.Parameter, torch.optim.SGD]:
    p = torch.nn.Parameter(torch.zeros(1))
    return p, torch.optim.SGD([p], lr=lr)


def _step(p: torch.nn.Parameter, optimizer: torch.optim.Optimizer) -> float:
    """One optimizer step with gradient 1: how far the parameter moved (the rate it stepped with)."""
    before = p.item()
    p.grad = torch.ones(1)
    optimizer.step()
    return before - p.item()


def test_only_what_the_replay_changes_is_an_override():
    recorded = RunConfig()
    same = ReplayOverrides.read(_spec(), recorded, recorded)
    assert (same.start, same.plan, same.precision, same.lr_scale, same.skip) == (3, None, None, None, frozenset())
    changed = dataclasses.replace(recorded, precision="bf16",
                                  model=dataclasses.replace(recorded.model, attention="sdpa"))
    o = ReplayOverrides.read(_spec(overrides=Overrides(lr_scale=0.5, skip=[4, 5]), skip=[4, 5]), changed, recorded)
    assert (o.plan, o.precision, o.lr_scale, o.skip) == (AttentionPlan.parse("sdpa"), "bf16", 0.5, {4, 5})
    scoped = ReplayOverrides.read(_spec(overrides=Overrides(lr_scale=0.5, layers=[0]), lr_scope={"layers": [0]}),
                                  recorded, recorded)
    assert scoped.lr_scale is None   # a scale of some heads only is the built-in trainer's to apply


def test_precision_changes_from_the_window_on_and_needs_the_loops_autocast():
    o = ReplayOverrides(start=3, precision="bf16")
    assert o.autocast_precision("fp32") == "fp32"
    o.check_step(autocast_used=False)   # before the window: nothing to change
    o.begin(3, _sgd()[1], None, lambda plan, reach: None)
    assert o.autocast_precision("fp32") == "bf16"
    o.check_step(autocast_used=True)
    with pytest.raises(UsageError, match="does not run its forward under loop.autocast"):
        o.check_step(autocast_used=False)


def test_the_attention_plan_goes_in_when_the_window_begins_and_out_at_close():
    events = []

    @contextlib.contextmanager
    def applied(plan, reach):
        events.append(("in", plan))
        yield
        events.append(("out", plan))

    plan = AttentionPlan.parse("eager")
    o = ReplayOverrides(start=3, plan=plan)
    o.begin(3, _sgd()[1], None, applied)
    assert events == [("in", plan)]
    o.close()
    assert events == [("in", plan), ("out", plan)]


def test_a_lambda_schedule_is_scaled_once_at_the_windows_start():
    p, optimizer = _sgd()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    ReplayOverrides(start=3, lr_scale=0.5).begin(3, optimizer, scheduler, lambda plan, reach: None)
    assert scheduler.base_lrs == [0.05]
    assert _step(p, optimizer) == pytest.approx(0.05)
    scheduler.step()
    assert _step(p, optimizer) == pytest.approx(0.05)   # the schedule's rates are the scaled ones


def test_a_replay_resumed_inside_its_window_does_not_scale_its_restored_schedule_again():
    p, optimizer = _sgd(lr=0.05)   # as restored from the replay's own checkpoint: scaled already
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    scheduler.base_lrs = [0.05]
    ReplayOverrides(start=3, lr_scale=0.5).begin(5, optimizer, scheduler, lambda plan, reach: None)
    assert scheduler.base_lrs == [0.05] and _step(p, optimizer) == pytest.approx(0.05)


def test_rates_the_script_sets_are_scaled_for_each_step_and_set_back_after_it():
    p, optimizer = _sgd()
    o = ReplayOverrides(start=3, lr_scale=0.5)
    o.begin(3, optimizer, None, lambda plan, reach: None)
    assert _step(p, optimizer) == pytest.approx(0.05)
    assert optimizer.param_groups[0]["lr"] == 0.1   # what the script set, for it to read and set again
    o.close()
    assert _step(p, optimizer) == pytest.approx(0.1)


def test_each_override_counts_what_it_replaced_in_a_step_and_starts_anew():
    plan = AttentionPlan.parse("sdpa;1=fa2-emu")
    recorded, replay = RunConfig(), RunConfig()
    recorded.model.n_layer = replay.model.n_layer = 2
    recorded.model.n_head = replay.model.n_head = 2
    recorded.model.attention, replay.model.attention = "sdpa", plan.canonical()
    o = ReplayOverrides.read(_spec(overrides=Overrides(attention="fa2-emu", layers=[1], lr_scale=0.5)), replay,
                             recorded)
    assert o.counters == ["attention 1.0 fa2-emu", "attention 1.1 fa2-emu",
                          "optimizer steps at the scaled learning rate"]
    p, optimizer = _sgd()
    o.begin(3, optimizer, None, lambda plan, reach: None)
    o.reach.ran(1, [0, 1], "fa2-emu")
    o.reach.ran(0, [0, 1], "sdpa")     # not an override's: not counted, but on the path
    _step(p, optimizer)
    assert o.counted().tolist() == [1, 1, 1]
    assert o.counted().tolist() == [0, 0, 0]   # the next step's, none yet
    reached = o.reached([3], [[2, 2, 2]])
    assert [(a.layer, a.backend, a.heads, a.calls) for a in reached.path] == [(0, "sdpa", [0, 1], 1),
                                                                              (1, "fa2-emu", [0, 1], 1)]


def test_an_override_that_reached_nothing_in_the_windows_first_step_is_refused_and_later_steps_are_not():
    o = ReplayOverrides(start=3, lr_scale=0.5, given=Overrides(lr_scale=0.5))
    o.begin(3, _sgd()[1], None, lambda plan, reach: None)
    with pytest.raises(UnreachedOverride, match=r"`--lr-scale 0.5` reached no optimizer step in step 3, the window's"):
        o.check(3, o.counted())   # the optimizer never stepped
    o.check(4, o.counted())       # past the first step a step may pass without one (the script's own choice)


def test_a_drop_must_leave_a_sample_out_at_its_own_step():
    o = ReplayOverrides(start=3, drop={5: frozenset({7})}, given=Overrides(drop=[[5, 7]]))
    o.begin(3, _sgd()[1], None, lambda plan, reach: None)
    assert o.kept(4, np.array([7, 8])) is None   # not its step
    o.check(4, o.counted())
    assert o.kept(5, np.array([7, 8])).tolist() == [False, True] and o.loss_weight(5, np.array([7, 8])) == 2.0
    o.check(5, o.counted())
    o.kept(5, np.array([1, 2]))
    with pytest.raises(UnreachedOverride, match="left no sample out in step 5"):
        o.check(5, o.counted())


def test_an_optimizer_wrapper_is_scaled_through_the_torch_optimizer_it_holds():
    p, optimizer = _sgd()
    wrapper = type("Wrapped", (), {"optimizer": optimizer})()
    assert torch_optimizer(wrapper) is optimizer
    with pytest.raises(UsageError, match="not a torch optimizer"):
        torch_optimizer(object())
