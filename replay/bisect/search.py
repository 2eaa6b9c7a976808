"""The two searches of a bisect, over a `test` that runs a batch of candidates at once (in parallel).

`last_true`: over candidates where the test holds for a prefix and fails after it (applying a
counterfactual earlier prevents more), the last one it holds for. Each round tests up to `width`
points spread over the open interval, so it takes ceil(log_{width+1}(n + 1)) rounds, at most
width x that many tests.

`ddmin`: Zeller's delta debugging, for a set whose whole passes the test: a 1-minimal subset that
still passes (removing any one element makes it fail). Each round tests every part of the current
split and, past two parts, every complement, all at once. At most N^2 + 3N tests for N elements;
about 2 k log2(N) when k elements matter. Repeated candidates are the caller's to cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")
Test = Callable[[list[T]], list[bool]]   # one answer for each of the candidates (or sets) it is given


def last_true_bound(n: int, width: int) -> int:
    return width * math.ceil(math.log(n + 1, width + 1) - 1e-9) if n else 0


def last_true(candidates: Sequence[T], test: Test[T], width: int) -> tuple[int, bool]:
    """(index of the last candidate the test holds for, or -1; whether the answers were monotone)."""
    lo, hi, monotone = -1, len(candidates), True
    while hi - lo > 1:
        inside = range(lo + 1, hi)
        k = min(width, len(inside))
        points = sorted({inside[(i + 1) * len(inside) // (k + 1)] for i in range(k)})
        results = test([candidates[p] for p in points])
        passed = [p for p, ok in zip(points, results, strict=True) if ok]
        failed = [p for p, ok in zip(points, results, strict=True) if not ok]
        if passed and failed and min(failed) < max(passed):
            monotone = False
        lo = max(passed, default=lo)
        hi = min([p for p in failed if p > lo], default=hi)
    return lo, monotone


def ddmin_bound(n: int) -> int:
    return n * n + 3 * n


def ddmin(items: Sequence[T], test: Test[list[T]],
          exhausted: Callable[[], bool] = lambda: False) -> tuple[list[T], bool]:
    """A subset of `items` (which passes the test as a whole) that passes the test, and whether it is
    1-minimal: `exhausted()` (a probe budget) can end the search early with a passing, larger set."""
    chosen, n = list(items), 2
    while len(chosen) >= 2:
        if exhausted():
            return chosen, False
        n = min(n, len(chosen))
        parts = [chosen[i * len(chosen) // n:(i + 1) * len(chosen) // n] for i in range(n)]
        complements = [[x for x in chosen if x not in part] for part in parts] if n > 2 else []
        results = test(parts + complements)
        passing_part = next((p for p, ok in zip(parts, results[:len(parts)], strict=True) if ok), None)
        passing_complement = next((c for c, ok in zip(complements, results[len(parts):], strict=True) if ok), None)
        if passing_part is not None:
            chosen, n = passing_part, 2
        elif passing_complement is not None:
            chosen, n = passing_complement, max(n - 1, 2)
        elif n < len(chosen):
            n = min(2 * n, len(chosen))
        else:
            break
    return chosen, True
