"""Training-side capture: the recorder API, spike detection, environment and determinism control."""

from replay.recorder.recorder import Recorder, RecorderConfig, create_run_store, resume_run_store
from replay.recorder.spikes import SpikeDetector, SpikeEvent, detect_spikes

__all__ = ["Recorder", "RecorderConfig", "SpikeDetector", "SpikeEvent", "create_run_store", "detect_spikes", "resume_run_store"]
