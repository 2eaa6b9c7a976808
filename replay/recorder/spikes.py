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
        self.seen = 0
        self.in_spike = False

    def is_spike(self, loss: float) -> tuple[bool, float, float, float]:
        """(fires?, baseline, spread, score) of `loss` against the current history; no state change."""
        if not math.isfinite(loss):
            return True, math.nan, math.nan, math.inf
        if self.seen < max(self.cfg.warmup, 3) or len(self.history) < 3:
            return False, math.nan, math.nan, 0.0
        median = _median(list(self.history))   # robust_z's values, without numpy's cost on 50 numbers every step
        spread = max(1.4826 * _median([abs(x - median) for x in self.history]), 1e-12)
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
            self.history.append(float(loss))
        self.seen += 1
        return event


def robust_z(history: np.ndarray, x: float, relative_floor: float = 0.0,
             floor: float = 0.0) -> tuple[float, float, float]:
    """(z, median, spread) of `x` against `history`: z = (x - median) / spread, where spread = 1.4826 x the
    median absolute deviation (the standard deviation, for normal data), but at least `relative_floor` x
    |median| and `floor`, so that a flat history does not turn a wobble into a large score."""
    median = float(np.median(history))
    spread = max(1.4826 * float(np.median(np.abs(history - median))), relative_floor * abs(median), floor, 1e-12)
    return (x - median) / spread, median, spread


def _median(values: list[float]) -> float:
    """np.median of finite floats, bit for bit: the middle one, or the mean of the middle two."""
    values.sort()
    half = len(values) // 2
    return values[half] if len(values) % 2 else (values[half - 1] + values[half]) / 2


def detect_spikes(losses: np.ndarray, cfg: SpikeConfig, start_step: int = 0) -> list[SpikeEvent]:
    """Run the online rule over a whole loss series (for replays and offline checks)."""
    detector = SpikeDetector(cfg)
    return [e for i, x in enumerate(losses) if (e := detector.update(start_step + i, float(x)))]
