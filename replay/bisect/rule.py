"""When does a probe "prevent the spike"? The recording's own detector rule (recorder/spikes.py), run
over the probe's losses.

The detector is fed the record's global losses before the probe's window (so its history at the first
probed step is exactly the recording's), then the probe's losses from its window's first step to the
spike step + `horizon`. The probe prevents the spike when the detector fires nowhere in that range.
Skipped steps (no loss) are left out, and a probe that skips batches runs as many steps longer, so
that it trains as far past the spike as the plain replay (a spike delayed by the skipped steps is not
prevented). A counterfactual that only delays the spike beyond the horizon counts as preventing it; a
larger horizon is stricter.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from replay.config import SpikeConfig
from replay.recorder.spikes import SpikeDetector
from replay.store import RunStore


@dataclass(frozen=True)
class Rule:
    spike: SpikeConfig
    horizon: int   # steps after the spike that must stay quiet

    def describe(self) -> str:
        c = self.spike
        floor = f" and > median + {c.min_delta:g}" if c.min_delta else ""
        return (f"the spike is prevented when no step up to {self.horizon} steps after it has loss > median + "
                f"{c.threshold:g} x 1.4826 x MAD of the previous {c.window} steps and > median x {1 + c.min_rise:g}"
                f"{floor} (the recording's detector)")


@dataclass
class Judgement:
    prevented: bool
    spike_at: int | None      # first step the detector fired on in the window
    peak: float               # largest loss in the window
    baseline: float           # the detector's median when the window starts

    def to_dict(self) -> dict[str, Any]:
        return {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in asdict(self).items()}


def judge(record: RunStore, probe: RunStore, rule: Rule, start: int, stop: int) -> Judgement:
    """Did the probe (a replay of `record` covering steps start..stop) prevent the spike in start..stop?"""
    recorded = record.read_steps(["loss"])["loss"]
    rows = probe.read_steps(["loss"])
    skipped = set(probe.manifest.replay_spec.skip)
    detector = SpikeDetector(rule.spike)
    first = int(rows["step"][0]) if len(rows["step"]) else start
    for step in range(first):
        detector.update(step, float(recorded[step]))
    baseline = float(np.median(np.fromiter(detector.history, dtype=np.float64))) if detector.history else math.nan
    fired, peak = None, -math.inf
    for step, loss in zip(rows["step"].tolist(), rows["loss"].tolist(), strict=True):
        if step in skipped or step > stop:
            continue
        fires = detector.is_spike(float(loss))[0]   # any firing step counts, also one of a spike under way
        detector.update(step, float(loss))
        if step >= start:
            peak = max(peak, float(loss)) if math.isfinite(loss) else math.inf
            if fires and fired is None:
                fired = step
    return Judgement(fired is None, fired, peak, baseline)
