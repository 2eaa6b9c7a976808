"""Online loss-spike detection: a robust rule over the recent loss history.

A step's global loss is a spike when, over the last `window` steps before it,

    loss > median + threshold * 1.4826 * MAD      (a robust z-score above `threshold`)
    loss > median * (1 + min_rise)                 (and a real rise, not noise on a flat curve)
    loss > median + min_delta                      (and by at least min_delta nats: 0 by default; a loss
                                                    memorised to 1e-8 otherwise "spikes" on wobbles of 1e-8)

once at least `warmup` steps have been seen. Consecutive spiking steps are one event (reported at the
first); the detector re-arms when the loss falls back below the rule. Non-finite losses always fire.
The same rule judges replays (bisect's "prevents the spike"), so it lives here, free of training code.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

from replay.config import SpikeConfig


@dataclass
class SpikeEvent:
    step: int
    loss: float
    baseline: float   # median of the window
    spread: float     # 1.4826 * MAD of the window
    score: float      # (loss - baseline) / spread

    def to_dict(self) -> dict:
        return {k: (v if math.isfinite(v) else str(v)) if isinstance(v, float) else v
                for k, v in asdict(self).items()}


class SpikeDetector:
    def __init__(self, cfg: SpikeConfig):
        self.cfg = cfg
        self.history: deque[float] = deque(maxlen=cfg.window)
        self._sorted: list[float] = []   # the history in order of value
        self.seen = 0
        self.in_spike = False

    def is_spike(self, loss: float) -> tuple[bool, float, float, float]:
        """(fires?, baseline, spread, score) of `loss` against the current history; no state change."""
        if not math.isfinite(loss):
            return True, math.nan, math.nan, math.inf
        if self.seen < max(self.cfg.warmup, 3) or len(self.history) < 3:
            return False, math.nan, math.nan, 0.0
        median = _median(self._sorted)   # robust_z's values, without numpy's cost on 50 numbers every step
        spread = max(1.4826 * _median_deviation(self._sorted, median), 1e-12)
        score = (loss - median) / spread
        fires = (score > self.cfg.threshold and loss > median * (1 + self.cfg.min_rise)
                 and loss > median + self.cfg.min_delta)
        return fires, median, spread, score

    def update(self, step: int, loss: float) -> SpikeEvent | None:
        fires, median, spread, score = self.is_spike(loss)
        event = None
        if fires and not self.in_spike:
            event = SpikeEvent(step, float(loss), median, spread, float(score))
        self.in_spike = fires
        if not fires:  # a spiking loss would poison its own baseline
            self._remember(float(loss))
        self.seen += 1
        return event


    def _remember(self, loss: float) -> None:
        if len(self.history) == self.history.maxlen:
            del self._sorted[bisect.bisect_left(self._sorted, self.history[0])]
        self.history.append(loss)
        bisect.insort(self._sorted, loss)


def robust_z(history: np.ndarray, x: float, relative_floor: float = 0.0,
             floor: float = 0.0) -> tuple[float, float, float]:
    """(z, median, spread) of `x` against `history`: z = (x - median) / spread, where spread = 1.4826 x the
    median absolute deviation (the standard deviation, for normal data), but at least `relative_floor` x
    |median| and `floor`, so that a flat history does not turn a wobble into a large score."""
    median = float(np.median(history))
    spread = max(1.4826 * float(np.median(np.abs(history - median))), relative_floor * abs(median), floor, 1e-12)
    return (x - median) / spread, median, spread


def _median(ordered: list[float]) -> float:
    """np.median of finite floats in order, bit for bit: the middle one, or the mean of the middle two."""
    half = len(ordered) // 2
    return ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) / 2


def _median_deviation(ordered: list[float], median: float) -> float:
    """`_median` of |x - median| over finite floats in order: the smallest deviations, taken outwards from the
    median (m - x below it is |x - m| bit for bit: rounding is symmetric), up to the middle one or two."""
    below = bisect.bisect_right(ordered, median) - 1
    above, smallest = below + 1, []
    for _ in range(len(ordered) // 2 + 1):
        if above == len(ordered) or (below >= 0 and median - ordered[below] <= ordered[above] - median):
            smallest.append(median - ordered[below])
            below -= 1
        else:
            smallest.append(ordered[above] - median)
            above += 1
    return smallest[-1] if len(ordered) % 2 else (smallest[-2] + smallest[-1]) / 2


def detect_spikes(losses: np.ndarray, cfg: SpikeConfig, start_step: int = 0) -> list[SpikeEvent]:
    """Run the online rule over a whole loss series (for replays and offline checks)."""
    detector = SpikeDetector(cfg)
    return [e for i, x in enumerate(losses) if (e := detector.update(start_step + i, float(x)))]
