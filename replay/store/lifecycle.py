"""A run store's life, written once for every way of recording (`replay record`, a `Loop` of the user's own,
the Python `Recorder` API): created, resumed after a stop, told where it ran, completed.

    store = create_run(path, cfg, world_size=2, launcher="local", data=data)
    ... the ranks record; the run stops ...
    start = resume_run(RunStore.open(path, mode="a"), world_size=2)   # its last committed checkpoint's step
    note_environment(store, fingerprint, resumed=True)
    ... the ranks record to the end ...
    complete_run(store)

The caller holds the store's lease throughout (store/lease.py) and checks what its launcher needs first.
"""

from __future__ import annotations

import dataclasses
import shlex
import time
from typing import Any

from replay.config import Launcher, RunConfig
from replay.store.location import Location, Where
from replay.store.manifest import CommandInfo, DataInfo, Manifest, ModelInfo, ResumeInfo
from replay.store.run_store import RunStore, check_outside_stores


def no_data(source: str) -> DataInfo:
    """A run whose samples the store neither holds nor fingerprints (a loop of the user's own): `source` says
    in words what they were."""
    return DataInfo(embedded=False, path=None, bytes=0, method="none", digest="", source=source)


def create_run(path: Where, config: RunConfig, *, world_size: int, launcher: Launcher, data: DataInfo,
               command: CommandInfo | None = None, layout: dict[str, Any] | None = None,
               model: ModelInfo | None = None, init_from: str | None = None) -> RunStore:
    """A new run's store, "running" from now on; refused (untouched) where `path` holds anything already, or
    lies inside another store."""
    check_outside_stores(Location.parse(path))
    return RunStore.create(path, Manifest(kind="run", config=config, world_size=world_size, launcher=launcher,
                                          data=data, created=time.time(), command=command, layout=layout,
                                          model=model, init_from=init_from))


def resume_run(store: RunStore, world_size: int) -> int | None:
    """Cut a stopped run (opened for writing) back to its last committed checkpoint and note the resume;
    returns that checkpoint's step, or None when nothing was committed (the run starts over at step 0)."""
    last = store.rewind(verify_world_size=world_size)
    store.update_manifest(status="running",
                          resumes=[*store.manifest.resumes, ResumeInfo(from_step=last or 0, time=time.time())])
    return last


def note_environment(store: RunStore, environment: dict[str, Any], resumed: bool) -> None:
    """Where the run runs now (recorder/environment.py's fingerprint): the run's own, or its last resume's."""
    resumes = store.manifest.resumes
    if resumed and resumes:
        store.update_manifest(resumes=[*resumes[:-1], dataclasses.replace(resumes[-1], environment=environment)])
    else:
        store.update_manifest(environment=environment)


def complete_run(store: RunStore) -> None:
    """Every step is recorded: the run (or replay) is complete."""
    store.update_manifest(status="complete", steps_recorded=store.n_steps)


def continue_command(store: RunStore) -> str | None:
    """The command that continues a stopped run or replay from its last committed checkpoint, as typed (None:
    a run of the user's own script, which continues by running it again with Loop(..., resume=True))."""
    m = store.manifest
    if m.replay is not None:
        spec = m.replay
        options = [f"--from {spec.start} --to {spec.stop} --name {shlex.quote(store.location.name)}",
                   spec.overrides.as_args()]
        options += [f"--checkpoint-every {spec.checkpoint_every}"] if spec.checkpoint_every else []
        options += [f"--ranks {spec.processes}"] if spec.processes else []
        parent = shlex.quote(str(store.location.resolve(spec.parent)))
        return f"replay run {parent} {' '.join(o for o in options if o)} --resume"
    if store.capabilities.builtin:
        return f"replay record --store {shlex.quote(str(store.location))} --resume"
    return None
