"""The two searches, on predicates whose answer is known, with every probe counted."""

from __future__ import annotations

import itertools
import random

import pytest

from replay.bisect.search import ddmin, ddmin_bound, last_true, last_true_bound


class Counting:
    def __init__(self, holds):
        self.holds, self.calls, self.rounds = holds, 0, 0

    def __call__(self, candidates):
        self.calls += len(candidates)
        self.rounds += 1
        return [self.holds(c) for c in candidates]


@pytest.mark.parametrize("width", [1, 2, 3])
def test_last_true_finds_every_boundary_within_its_bound(width):
    for n in range(0, 20):
        for boundary in range(-1, n):
            test = Counting(lambda c, b=boundary: c <= b)
            found, monotone = last_true(list(range(n)), test, width)
            assert (found, monotone) == (boundary, True), (n, boundary)
            assert test.calls <= last_true_bound(n, width), (n, boundary, test.calls)


def test_last_true_with_more_workers_takes_fewer_rounds():
    rounds = {}
    for width in (1, 2):
        test = Counting(lambda c: c <= 40)
        last_true(list(range(100)), test, width)
        rounds[width] = test.rounds
    assert rounds[2] < rounds[1]


def test_last_true_reports_answers_that_are_not_monotone():
    test = Counting(lambda c: c in (0, 1, 2, 7))   # holds again after failing at 3..6
    _, monotone = last_true(list(range(10)), test, 3)
    assert not monotone


def test_ddmin_returns_exactly_the_culprits_that_are_all_needed():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 16)
        culprits = set(rng.sample(range(n), rng.randint(1, min(3, n))))
        test = Counting(lambda subset, c=culprits: c <= set(subset))
        found, minimal = ddmin(list(range(n)), test)
        assert set(found) == culprits and minimal
        assert test.calls <= ddmin_bound(n)


def test_ddmin_returns_one_culprit_when_any_one_suffices():
    for n, culprits in itertools.product(range(2, 12), [{0}, {1, 5}, {3, 4, 9}]):
        culprits = {c for c in culprits if c < n} or {0}
        test = Counting(lambda subset, c=culprits: bool(c & set(subset)))
        found, minimal = ddmin(list(range(n)), test)
        assert len(found) == 1 and found[0] in culprits and minimal


def test_ddmin_stops_at_its_budget_with_a_passing_set():
    test = Counting(lambda subset: {3, 11} <= set(subset))
    found, minimal = ddmin(list(range(16)), test, exhausted=lambda: test.calls >= 4)
    # a passing set, smaller than the start; the budget is overshot by at most one round (2N probes)
    assert not minimal and {3, 11} <= set(found) and len(found) < 16 and test.calls <= 4 + 2 * 16
