"""Training-side capture: the loop API, the recorder under it, spike detection, environment and determinism."""

from replay.recorder.loop import Loop
from replay.recorder.recorder import (MODEL_KEYS, Recorder, RecorderConfig, create_run_store, model_key,
                                      resume_run_store)
from replay.recorder.spikes import SpikeDetector, SpikeEvent, detect_spikes

__all__ = ["MODEL_KEYS", "Loop", "Recorder", "RecorderConfig", "SpikeDetector", "SpikeEvent", "create_run_store",
           "detect_spikes", "model_key", "resume_run_store"]
