import numpy as np

from replay.config import SpikeConfig
from replay.recorder.spikes import detect_spikes


def _noisy_decay(n, seed=0):
    rng = np.random.default_rng(seed)
    return 2.0 * np.exp(-np.arange(n) / 80) + 0.1 + rng.normal(0, 0.01, n)


def test_noisy_but_healthy_curve_fires_nothing():
    assert detect_spikes(_noisy_decay(400), SpikeConfig()) == []


def test_a_jump_fires_once_at_its_first_step():
    losses = _noisy_decay(300)
    losses[200:204] = [1.5, 2.5, 2.0, 1.0]   # four spiking steps: one event
    events = detect_spikes(losses, SpikeConfig())
    assert [e.step for e in events] == [200]
    assert events[0].loss == 1.5
    assert events[0].baseline == np.median(losses[150:200])   # the 50-step window before the jump


def test_threshold_is_a_setting():
    losses = _noisy_decay(300)
    losses[200] *= 2.0                      # a modest bump: robust z about 6
    assert [e.step for e in detect_spikes(losses, SpikeConfig(threshold=3, min_rise=0.2))] == [200]
    assert detect_spikes(losses, SpikeConfig(threshold=30, min_rise=0.2)) == []
    assert detect_spikes(losses, SpikeConfig(threshold=3, min_rise=2.0)) == []


def test_min_delta_ignores_wobbles_of_a_loss_memorised_near_zero():
    rng = np.random.default_rng(0)
    losses = np.abs(rng.normal(1e-8, 2e-9, 300))   # a memorised loss: a relative rule sees noise as rises
    losses[100] = 5e-8                             # a wobble: 5x the median, but 4e-8 nats
    losses[200] = 0.3                              # the loss breaks
    assert [e.step for e in detect_spikes(losses, SpikeConfig())] == [100, 200]
    assert [e.step for e in detect_spikes(losses, SpikeConfig(min_delta=0.1))] == [200]
    assert detect_spikes(losses, SpikeConfig(min_delta=0.5)) == []


def test_non_finite_loss_always_fires():
    losses = _noisy_decay(100)
    losses[60] = np.nan
    assert [e.step for e in detect_spikes(losses, SpikeConfig())] == [60]


def test_nothing_fires_during_warmup():
    losses = np.r_[np.full(10, 1.0), [50.0], np.full(10, 1.0)]
    assert detect_spikes(losses, SpikeConfig(warmup=20)) == []


def test_the_detectors_baseline_is_robust_z_bit_for_bit():
    import numpy as np

    from replay.config import SpikeConfig
    from replay.recorder.spikes import SpikeDetector, robust_z

    rng = np.random.default_rng(0)
    for window in (49, 50):   # an odd and an even history
        detector = SpikeDetector(SpikeConfig(window=window, warmup=3))
        for step, loss in enumerate(rng.normal(3.0, 0.01, 200).tolist()):
            if len(detector.history) >= 3:
                fires, median, spread, score = detector.is_spike(loss)
                z, m, s = robust_z(np.fromiter(detector.history, dtype=np.float64), loss)
                assert (median, spread, score) == (m, s, z)
            detector.update(step, loss)


def test_the_kept_order_gives_robust_z_bit_for_bit_with_ties_and_evictions():
    """The detector keeps its window in order across appends and evictions; its median and spread stay
    robust_z's, with repeated values, and values on both sides of the median at equal distances."""
    from replay.recorder.spikes import SpikeDetector, robust_z

    rng = np.random.default_rng(1)
    for window, losses in ((7, np.round(rng.normal(2.0, 0.5, 300), 1)), (8, rng.integers(0, 4, 300) * 0.5),
                           (50, rng.normal(3.0, 0.01, 300))):
        detector = SpikeDetector(SpikeConfig(window=window, warmup=3, threshold=1e9))
        for step, loss in enumerate(losses.tolist()):
            if len(detector.history) >= 3:
                _, median, spread, score = detector.is_spike(loss)
                z, m, s = robust_z(np.fromiter(detector.history, dtype=np.float64), loss)
                assert (median, spread) == (m, s) and (score == z or np.isnan(z)), (window, step)
            detector.update(step, loss)
            assert detector._sorted == sorted(detector.history)
