"""The localisation rule on tables built by hand, where the right answer is planted."""

from __future__ import annotations

import numpy as np
import pytest

from replay.analysis.localise import WARN_Z, departure, localise, robust_z
from replay.analysis.results import METRICS


def _table(n_ckpt: int = 8, n_layer: int = 3, n_head: int = 4, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    sizes = {"matrix": 6, "head_matrix": 4, "head": n_head}
    table = {"step": np.arange(n_ckpt) * 10, "attrs": {"probe": {"rows": 252}}}
    for name, dims in METRICS.items():
        shape = (n_ckpt, n_layer, *(sizes[d] for d in dims))
        table[name] = 1.0 + 0.01 * rng.standard_normal(shape)   # every signal: a noisy flat history
    return table


def test_robust_z_follows_the_mad_rule():
    z, med = robust_z(np.array([1.0, 2.0, 3.0, 4.0, 100.0]), 10.0)
    assert med == 3.0 and z == pytest.approx((10 - 3) / (1.4826 * 1.0))
    z, _ = robust_z(np.array([5.0, 5.0, 5.0]), 5.2)              # no spread: 1% of the median
    assert z == pytest.approx(0.2 / 0.05)


def test_a_planted_head_is_ranked_first_and_its_layer_too():
    table = _table()
    table["spectral_qk"][6, 2, 3] = 1.5        # layer 2 head 3 grows at the last checkpoint before step 65
    found = localise(table, spike=65)
    assert (found.heads[0].layer, found.heads[0].head) == (2, 3)
    assert found.heads[0].signal == "spectral_qk" and found.heads[0].value == 1.5
    assert found.layers[0].layer == 2 and found.layers[0].signal == "head 3 spectral_qk"
    assert found.checkpoint == 60 and found.history == [0, 10, 20, 30, 40, 50]
    assert found.heads[0].score > 10 * found.heads[1].score


def test_only_checkpoints_before_the_spike_count():
    table = _table()
    table["max_logit"][7, 0, 1] = 50.0         # after the spike: must not be blamed
    table["update_rel"][5, 1, 4] = 3.0         # layer 1's MLP moved at checkpoint 50, the last before step 55
    found = localise(table, spike=55)
    assert found.checkpoint == 50
    assert found.layers[0].layer == 1 and found.layers[0].signal == "update_rel[fc]"
    assert all(a.signal != "max_logit" or a.score < 10 for a in found.heads)


def test_one_probe_row_of_tied_maxima_is_within_resolution():
    table = _table()
    table["tie_rate"][...] = 4 / 252
    table["tie_rate"][6, 0, 0] = 5 / 252       # one more tied row out of 252: noise, not a signal
    found = localise(table, spike=60)
    tie = [a for a in found.heads if a.signal == "tie_rate"]
    assert all(a.score <= 1.0 + 1e-9 for a in tie)


def test_too_few_checkpoints_before_the_spike():
    found = localise(_table(), spike=15)             # checkpoints 0 and 10 only: no history to speak of
    assert not found.found and found.spike == 15 and not found.heads
    assert found.lines(5) == ["spike at step 15: too few analysed checkpoints before it to localise"]


def test_a_signal_that_drifts_away_before_the_spike_has_its_lead_time():
    table = _table(n_ckpt=12)
    table["attn_entropy"][8:, 1, 2] = [0.8, 0.6, 0.4, 0.2]     # layer 1 head 2 collapses from checkpoint 80 on
    table["log_z"][10:, 0] = [2.0, 3.0]                        # layer 0's log Z from checkpoint 100 on
    found = localise(table, spike=115)
    first = found.leads[0]
    assert (first.layer, first.head, first.signal, first.since, first.lead) == (1, 2, "attn_entropy", 80, 35)
    assert first.z < -WARN_Z
    z_leads = [w for w in found.leads if w.signal == "log_z"]
    assert [(w.layer, w.head, w.since, w.lead) for w in z_leads] == [(0, None, 100, 15)]
    noise = [w for w in found.leads if (w.layer, w.head, w.signal) not in {(1, 2, "attn_entropy"), (0, None, "log_z")}]
    assert not noise, noise


def test_a_departure_that_comes_back_is_no_warning():
    flat = 1.0 + 0.01 * np.random.default_rng(1).standard_normal(10)
    series = flat.copy()
    series[6] = 2.0                          # out at one checkpoint, back in before the last
    since, z = departure(series)
    assert since is None and np.isnan(z)
    series[8:] = [2.0, 2.5]                  # out for the last two: the run starts at index 8
    since, z = departure(series)
    assert since == 8 and z == pytest.approx(robust_z(series[:8], 2.5)[0])
