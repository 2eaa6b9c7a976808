"""The "prevents the spike" rule on probes with planted loss curves (real Zarr stores on disk)."""

from __future__ import annotations

import math

import numpy as np

from replay.bisect.rule import Rule, judge
from replay.config import SpikeConfig
from replay.store.manifest import ReplaySpec
from replay.store.overrides import Overrides
from tests.conftest import new_store

RULE = Rule(SpikeConfig(window=10, threshold=6.0, min_rise=0.5, warmup=5), horizon=5)


def _store(path, losses, first_step=0, skip=()):
    spec = ReplaySpec(parent="../..", start=first_step, stop=first_step + len(losses) - 1, start_checkpoint=first_step,
                      start_checkpoint_kind="regular", checkpoint_every=0, overrides=Overrides(), skip=list(skip))
    store = new_store(path, replay=spec if first_step else None, first_step=first_step)
    k = len(losses)
    store.append_steps(first_step, {
        "loss": np.asarray(losses, dtype=np.float64), "rank_loss": np.zeros((k, 1)), "grad_norm": np.zeros(k),
        "lr": np.zeros(k), "tokens": np.zeros(k, dtype=np.int64), "step_time": np.zeros(k),
        "sample_ids": np.zeros((k, 1, 1, 1), dtype=np.int64)})
    return store


def _flat(n, noise_seed=0):
    return list(1.0 + 0.01 * np.random.default_rng(noise_seed).standard_normal(n))


def test_a_rise_inside_the_horizon_is_a_spike_and_one_after_it_is_not(tmp_path):
    record = _store(tmp_path / "run", _flat(40))
    window = (20, 25)   # spike step 20, horizon 5
    inside = _flat(10, 1)
    inside[25 - 20] = 3.0
    after = _flat(10, 1)
    after[26 - 20] = 3.0
    j_inside = judge(record, _store(tmp_path / "a", inside, first_step=20), RULE, *window)
    j_after = judge(record, _store(tmp_path / "b", after, first_step=20), RULE, *window)
    assert (j_inside.prevented, j_inside.spike_at, j_inside.peak) == (False, 25, 3.0)
    assert j_after.prevented and j_after.spike_at is None and j_after.peak < 1.1
    assert abs(j_after.baseline - 1.0) < 0.02


def test_non_finite_losses_are_spikes_and_skipped_steps_are_left_out(tmp_path):
    record = _store(tmp_path / "run", _flat(40))
    nan = _flat(10, 2)
    nan[3] = math.nan
    assert judge(record, _store(tmp_path / "a", nan, first_step=20), RULE, 20, 25).spike_at == 23
    assert judge(record, _store(tmp_path / "b", nan, first_step=20, skip=[23]), RULE, 20, 25).prevented


def test_the_history_before_the_window_comes_from_the_record(tmp_path):
    """A probe starting at its checkpoint (18) before the window (20): steps 18, 19 are its own and are
    judged as history only; a rise relative to the *record's* level is what counts."""
    record = _store(tmp_path / "run", [5.0] * 40)
    probe = _store(tmp_path / "a", [5.0, 5.0] + [5.1] * 8, first_step=18)
    assert judge(record, probe, RULE, 20, 25).prevented   # 5.1 < 5.0 x 1.5
    low = _store(tmp_path / "run2", [1.0] * 40)
    assert not judge(low, _store(tmp_path / "b", [1.0, 1.0] + [5.1] * 8, first_step=18), RULE, 20, 25).prevented


def test_a_spike_already_under_way_when_the_window_opens_counts(tmp_path):
    """--spike on the second step of a spike: the detector fired at 20 (before the window) and still fires."""
    record = _store(tmp_path / "run", _flat(40))
    probe = _store(tmp_path / "a", _flat(2, 3) + [3.0] * 8, first_step=18)
    found = judge(record, probe, RULE, 21, 25)
    assert not found.prevented and found.spike_at == 21


def test_min_delta_judges_a_memorised_loss_by_its_real_rises(tmp_path):
    """On a loss memorised near 0, a wobble of 1e-7 is a 'spike' by the relative rule alone; with
    min_delta (the recording's spike.min_delta, or bisect --min-delta) only a rise of that many nats is."""
    def tiny(n: int, seed: int) -> list[float]:
        return list(1e-8 * (1 + 0.1 * np.random.default_rng(seed).standard_normal(n)))

    record = _store(tmp_path / "run", tiny(40, 0))
    wobble = tiny(10, 1)
    wobble[3] = 1e-7
    probe = _store(tmp_path / "a", wobble, first_step=20)
    floored = Rule(SpikeConfig(window=10, threshold=6.0, min_rise=0.5, warmup=5, min_delta=0.1), horizon=5)
    assert not judge(record, probe, RULE, 20, 25).prevented
    assert judge(record, probe, floored, 20, 25).prevented
    assert "and > median + 0.1 (" in floored.describe() and "and > median +" not in RULE.describe()
