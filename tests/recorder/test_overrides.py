"""A replay's overrides as the loop applies them (recorder/overrides.py): read from the replay's spec, and
applied through their hooks on a real optimizer and scheduler."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from replay.config import RunConfig
from replay.errors import UsageError
from replay.kernels.plan import AttentionPlan
from replay.recorder.overrides import ReplayOverrides
from replay.store.manifest import ReplaySpec


def _spec(**fields) -> ReplaySpec:
    return dataclasses.replace(ReplaySpec("../..", 3, 6, 2, "regular", 0, {}), **fields)


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
    o = ReplayOverrides.read(_spec(overrides={"lr_scale": 0.5}, skip=[4, 5]), changed, recorded)
    assert (o.plan, o.precision, o.lr_scale, o.skip) == (AttentionPlan.parse("sdpa"), "bf16", 0.5, {4, 5})
    scoped = ReplayOverrides.read(_spec(overrides={"lr_scale": 0.5}, lr_scope={"layers": [0]}), recorded, recorded)
    assert scoped.lr_scale is None   # a scale of some heads only is the built-in trainer's to apply


def test_precision_changes_from_the_window_on_and_needs_the_loops_autocast():
    o = ReplayOverrides(start=3, precision="bf16")
    assert o.autocast_precision("fp32") == "fp32"
    o.check_step(autocast_used=False)   # before the window: nothing to change
    o.begin(3, _sgd()[1], None, lambda plan: None)
    assert o.autocast_precision("fp32") == "bf16"
    o.check_step(autocast_used=True)
    with pytest.raises(UsageError, match="does not run its forward under loop.autocast"):
        o.check_step(autocast_used=False)


def test_the_attention_plan_goes_in_when_the_window_begins_and_out_at_close():
    events = []

    @contextlib.contextmanager
    def applied(plan):
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
    ReplayOverrides(start=3, lr_scale=0.5).begin(3, optimizer, scheduler, lambda plan: None)
    assert scheduler.base_lrs == [0.05]
    assert _step(p, optimizer) == pytest.approx(0.05)
    scheduler.step()
    assert _step(p, optimizer) == pytest.approx(0.05)   # the schedule's rates are the scaled ones


def test_a_replay_resumed_inside_its_window_does_not_scale_its_restored_schedule_again():
    p, optimizer = _sgd(lr=0.05)   # as restored from the replay's own checkpoint: scaled already
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    scheduler.base_lrs = [0.05]
    ReplayOverrides(start=3, lr_scale=0.5).begin(5, optimizer, scheduler, lambda plan: None)
    assert scheduler.base_lrs == [0.05] and _step(p, optimizer) == pytest.approx(0.05)


def test_rates_the_script_sets_are_scaled_for_each_step_and_set_back_after_it():
    p, optimizer = _sgd()
    o = ReplayOverrides(start=3, lr_scale=0.5)
    o.begin(3, optimizer, None, lambda plan: None)
    assert _step(p, optimizer) == pytest.approx(0.05)
    assert optimizer.param_groups[0]["lr"] == 0.1   # what the script set, for it to read and set again
    o.close()
    assert _step(p, optimizer) == pytest.approx(0.1)
