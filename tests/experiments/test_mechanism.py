"""Qiu & Yao's mechanism, reduced: the tied-maxima bias of the reference placement, its removal by the
safe-softmax fix, and the files it writes."""

from __future__ import annotations

import csv

import pytest

from replay.experiments.mechanism import MechanismConfig, run_mechanism
from tests.experiments.conftest import assert_png

SMALL_MECHANISM = MechanismConfig(trials=4000, n_tied=(1, 2), betas=(7.0, 1.0001, 1000.0))



@pytest.fixture(scope="module")
def mechanism(tmp_path_factory):
    return run_mechanism(SMALL_MECHANISM, tmp_path_factory.mktemp("mechanism"), progress=lambda line: None)


def test_reference_placement_tied_maxima_bias_and_the_fix(mechanism):
    biased = mechanism.row("reference-emu", 2).o_rel
    assert biased[0] + biased[1] < 0            # negative, and the 95% CI excludes 0
    fixed = mechanism.row("reference-emu", 2, 7.0).o_rel
    assert abs(fixed[0]) <= fixed[1] or abs(fixed[0]) * 5 <= abs(biased[0])
    delta = mechanism.row("reference-emu", 2).delta_rel   # dO > 0, so the O bias carries over to delta
    assert delta[0] + delta[1] < 0


def test_fa2_placement_bias_is_much_smaller(mechanism):
    fa2 = mechanism.row("fa2-emu", 2).o_rel[0]
    reference = mechanism.row("reference-emu", 2).o_rel[0]
    assert abs(fa2) * 3 < abs(reference)


def test_fix_is_inert_without_ties_and_at_tiny_beta(mechanism):
    assert mechanism.row("reference-emu", 1, 7.0).same_as_no_fix          # one maximum: the fix does not trigger
    assert mechanism.row("fa2-emu", 1, 7.0).same_as_no_fix
    assert mechanism.row("reference-emu", 2, 1.0001).same_as_no_fix       # 1.0001 * r rounds back to r in BF16


def test_huge_beta_is_reported_not_hidden(mechanism):
    for kernel in ("fa2-emu", "reference-emu"):
        row = mechanism.row(kernel, 2, 1000.0)
        assert row.status == "refused" or row.zero_rows > 0.99 or row.nan_rows > 0.99
    assert any(line.startswith("edge beta=1000") for line in mechanism.summary_lines())


def test_mechanism_writes_csv_and_plot(mechanism):
    with open(mechanism.csv_path) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * (1 + 2 * (1 + 3))    # n values x (baseline + 2 placements x (no fix + 3 betas))
    assert {r["kernel"] for r in rows} == {"baseline", "fa2-emu", "reference-emu"}
    assert_png(mechanism.plot_path)
