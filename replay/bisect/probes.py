"""Probes: the replays a bisect runs, in parallel on Ray actors, or, on one machine where one probe at a time fits
(and always for a script kept up between probes), one after another in the bisect's own process (`LocalProbes`).

Each actor holds one CPU slot and a pool of warm ranks (launch/pool.py) of the record's world size, so
a probe costs its steps rather than a process start-up; for a script of the user's own, the script's ranks,
kept up between its probes (launch/script.py `ScriptServer`: each probe's checkpoint restored in place and
checked against the record; a script whose state is not the record's after a step from there is started
afresh for that probe and every later one, which the probe's line says). A run recorded on several nodes, bisected on
a cluster, keeps its layout instead: each actor sits beside the bisect and holds a placement group of its
own (launch/ray_ranks.py), whose ranks stay warm; a probe that loses a node is run again once, on a new
group. A probe is an ordinary replay, stored in the run store under its usual id
(`steps-A-B-<overrides>`), so a finished probe is never run twice: not by a resumed bisect, not by another
session, not by `replay run` with the same arguments.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from replay.bisect.session import ProbeOutcome
from replay.errors import ReplayError
from replay.launch.forkserver import ForkServer
from replay.launch.pool import RankPool, RankPoolError
from replay.launch.ray_cluster import worker_options
from replay.launch.ray_ranks import NodeLost, Placing, RayRanks
from replay.launch.script import ScriptServer
from replay.replayer.replays import Replay, ReplayRequest, run
from replay.store.location import Location
from replay.store.manifest import CommandInfo, Manifest
from replay.store.overrides import Overrides


def request(start: int, stop: int, overrides: Overrides) -> ReplayRequest:
    # resume: an interrupted probe continues (or, with nothing committed yet, starts anew)
    return ReplayRequest(start, stop, overrides=overrides, resume=True)


class ProbeWorker:
    """A Ray actor: runs probes one at a time on its warm ranks (its CPUs: ranks x threads), or, given the
    record's manifest and a placing, on a placement group of its own."""

    def __init__(self, world_size: int, warm: bool = True, placed: tuple[Manifest, Placing] | None = None,
                 script: CommandInfo | None = None, forks: ForkServer | None = None):
        self.log = log = Path(tempfile.gettempdir()) / f"replay-probe-ranks-{os.getpid()}.log"
        self.cluster = RayRanks(*placed, log=log) if placed else None
        self.script = ScriptServer(script) if script is not None and placed is None else None
        self.pool = RankPool(world_size, log=log, forks=forks) if warm and placed is None and self.script is None \
            else None
        if self.pool is not None:
            self.pool.start()   # every actor's ranks start at once, before the first probe

    def run(self, store: Location, req: ReplayRequest, under: str) -> ProbeOutcome:
        """One probe, written under `under`: the spec of the bisect's lease of the store (store/lease.py)."""
        t0 = time.perf_counter()
        retried = None
        try:
            result = self._run(store, req, under)
        except RankPoolError:   # once more on fresh ranks (the interrupted probe is redone from scratch)
            result = self._run(store, req, under)
        except NodeLost as e:   # once more on a new placement group (the lost one left nothing half-written)
            assert self.cluster is not None, "only a placement group loses nodes"
            self.cluster.close()
            retried = str(e)
            self.cluster.wait_for_room()
            result = self._run(store, req, under)
        assert result.verification is not None, "a replay that ran is verified"
        return ProbeOutcome(id=result.location.name, ran=result.created, seconds=time.perf_counter() - t0,
                            verification=result.verification, environment=result.environment_notes,
                            node=socket.gethostname(), retried_after=retried,
                            started_afresh=self.script.refused if self.script is not None else None)

    def _run(self, store: Location, req: ReplayRequest, under: str) -> Replay:
        return run(store, req, ranks=self.pool or self.cluster or self.script, under=under,
                   command="replay bisect (probe)")

    def close(self) -> None:
        if self.script is not None:
            self.script.close()
        if self.pool is not None:
            self.pool.close()
        if self.cluster is not None:
            self.cluster.close()
        with contextlib.suppress(OSError):   # kept where the ranks said anything
            if self.log.stat().st_size == 0:
                self.log.unlink()


class LocalProbes:
    """Probes one after another in this process, through one `ProbeWorker` (its warm ranks, or the script kept up
    between probes), with no Ray cluster: on one machine where one probe at a time fits (a kept-up script's
    probes take a fraction of a second each, less than starting a second copy of the script would)."""

    def __init__(self, store: Location, world_size: int, lease: str, warm: bool, script: CommandInfo | None,
                 forks: ForkServer | None = None):
        self.store, self.lease = store, lease
        self.worker = ProbeWorker(world_size, warm=warm, script=script, forks=forks)

    def run(self, requests: list[ReplayRequest]) -> list[ProbeOutcome]:
        return [self.worker.run(self.store, req, self.lease) for req in requests]

    def close(self, graceful: bool = True) -> None:
        self.worker.close()

    def __enter__(self) -> LocalProbes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(graceful=exc[0] is None)


class ProbeRunner:
    """Runs batches of probe requests on `slots` actors of `cpus` CPUs each (inside an open ray_session),
    under `lease`, the spec of the bisect's lease; `placed`: on a placement group each instead, the actors
    (which take no CPU themselves) on this node."""

    def __init__(self, store: Location, world_size: int, cpus: int, slots: int, lease: str, warm: bool = True,
                 placed: tuple[Manifest, Placing] | None = None, script: CommandInfo | None = None):
        import ray  # lazy here and below: ray (0.3 s) only where probes run, not in every command's start-up
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.store, self.lease = store, lease
        where: dict[str, Any] = {"num_cpus": cpus}
        if placed is not None:   # beside the bisect, which holds the leases its probes write under
            here = ray.get_runtime_context().get_node_id()
            where = {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=False)}
        actor = ray.remote(max_restarts=1, max_task_retries=1, **where, **worker_options())(ProbeWorker)
        # Ray actor handles: their methods are called as `.remote(...)`, which Ray's types do not model
        self.actors: list[Any] = [actor.remote(world_size, warm, placed, script) for _ in range(slots)]

    def run(self, requests: list[ReplayRequest]) -> list[ProbeOutcome]:
        """Every request's result, in order; the requests run at once, one per actor."""
        import ray

        results: dict[int, ProbeOutcome] = {}
        queue, idle = list(enumerate(requests)), list(self.actors)
        pending: dict[Any, tuple[int, Any]] = {}   # the running probes' object refs -> (request, actor)
        while queue or pending:
            while queue and idle:
                i, req = queue.pop(0)
                worker = idle.pop()
                pending[worker.run.remote(self.store, req, self.lease)] = (i, worker)
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                i, worker = pending.pop(ref)
                idle.append(worker)
                try:
                    results[i] = ray.get(ref)
                except ray.exceptions.RayTaskError as e:
                    if isinstance(e.cause, ReplayError):
                        raise e.cause from None
                    raise
                except ray.exceptions.RayActorError as e:
                    raise ReplayError(f"a probe worker died twice running the replay of steps {requests[i].start}.."
                                      f"{requests[i].stop}: "
                                      f"{str(e).splitlines()[0]}") from None
        return [results[i] for i in range(len(requests))]

    def close(self, graceful: bool = True) -> None:
        """Let the actors stop their ranks, or (after an error) kill them at once: their ranks follow."""
        import ray

        if graceful:
            ray.get([a.close.remote() for a in self.actors])
        for a in self.actors:
            ray.kill(a)

    def __enter__(self) -> ProbeRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(graceful=exc[0] is None)
