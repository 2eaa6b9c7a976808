"""Training-side capture: the loop API, the recorder under it, spike detection, environment and determinism.

The names below load on first use, so that the launchers and replays, which import only the light modules
of this package (the recorded command's check), never load torch."""

import importlib

_HOME = {"Loop": "loop", "Recorder": "recorder", "RecorderConfig": "recorder", "create_run_store": "recorder",
         "resume_run_store": "recorder",
         "SpikeDetector": "spikes", "SpikeEvent": "spikes", "detect_spikes": "spikes"}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'replay.recorder' has no attribute {name!r}")
    return getattr(importlib.import_module(f"replay.recorder.{_HOME[name]}"), name)
