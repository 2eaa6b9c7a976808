"""The run store: the one data model every component reads and writes (see run_store.py)."""

from replay.store.run_store import STEP_FIELDS, CheckpointInfo, RunStore

__all__ = ["STEP_FIELDS", "CheckpointInfo", "RunStore"]
