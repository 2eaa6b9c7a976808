"""Fakes for the recorder's unit tests: a train state of one number, and a loop body that drives it."""

from __future__ import annotations

from typing import Any

import torch


class Counter:
    """A TrainState (recorder/recorder.py) of one number, which the script sets as it likes: a checkpoint
    holds the number as it was when the checkpoint was taken."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self, rank: int) -> dict[str, Any]:
        return {"replicated": {"value": torch.tensor(self.value)}, "local": {}}

    def load_state_dict(self, replicated: dict[str, Any], local: dict[str, Any], read_local: Any = None) -> None:
        self.value = int(replicated["value"])


def parts() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model and optimizer the loop asks about (device, learning rate); a Counter is what it checkpoints."""
    model = torch.nn.Linear(2, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def checkpointed(store: Any) -> dict[int, tuple[str, int]]:
    """Each committed checkpoint's step: (kind, the Counter's value in it)."""
    return {c.step: (c.kind, int(store.read_shard(c.step, 0)["state"]["replicated"]["value"]))
            for c in store.checkpoints()}
