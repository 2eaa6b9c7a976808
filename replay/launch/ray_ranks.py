"""A replay's ranks on a Ray cluster: one placement group, with the recorded rank-to-node layout.

Ray's placement strategies cannot keep some bundles together and others apart, so each recorded node is
one bundle (its ranks' CPUs, and GPUs where it ran on CUDA) and the group is STRICT_SPREAD: every recorded
node on a cluster node of its own, its ranks together. Packed (`--pack`), each rank is a bundle and the
group is PACK: ranks share nodes wherever the cluster has room. On every bundle one actor (`NodeRanks`)
starts that bundle's ranks as torchrun would (RANK, LOCAL_RANK, GROUP_RANK, MASTER_ADDR/PORT of rank 0's
node: launch/local.py Node), and they rendezvous among themselves. A run of the built-in trainer keeps its
ranks warm between replays (launch/pool.py); a script of the user's own starts afresh for each.

Every rank is a child of its actor and dies with it (lifeline.py); the actors die with the process that
made them (a Ray job's actors do), when the group is closed, or with their node. A node lost in the middle
of a replay fails it with `NodeLost`, naming the node.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replay.config import Launcher
from replay.errors import ReplayError, UsageError
from replay.launch.fresh import run_node
from replay.launch.job import RankJob
from replay.launch.local import Node, free_port
from replay.launch.pool import RankPool
from replay.launch.ray_cluster import worker_options
from replay.launch.script import ScriptRanks
from replay.lifeline import follow_library_parent
from replay.store.capabilities import Capabilities
from replay.store.location import Location
from replay.store.manifest import CommandInfo, Manifest

LOST_GRACE = 60.0   # seconds a failed replay waits for the cluster to say whether a node of it died


class NodeLost(ReplayError):
    """A node holding ranks of the replay died: the replay is lost, a rerun (on another group) completes."""


@dataclass(frozen=True)
class Placing:
    """How a replay's ranks are placed on the cluster."""

    pack: bool = False      # let ranks share nodes where the recording spread them over several
    wait: float = 120.0     # seconds to wait for the cluster to have room for them


class NodeRanks:
    """A Ray actor on one bundle: that bundle's ranks, started as torchrun would start them on its node."""

    def __init__(self, world: int, warm: bool, log: str | None, script: CommandInfo | None = None):
        follow_library_parent()   # a raylet killed takes its node's ranks with it, as a lost node does
        self.world, self.warm, self.log, self.script = world, warm, log, script
        self.node: Node | None = None
        self.pool: RankPool | None = None

    def where(self) -> dict[str, str]:
        # lazy, as every ray import here: ray (0.3 s) only once Ray work starts
        import ray

        return {"id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "host": socket.gethostname()}

    def port(self) -> int:
        """A port free on this node, for rank 0's rendezvous."""
        return free_port("")

    def meet(self, node: Node) -> None:
        """Take the ranks and rendezvous of this node; warm ranks start at once (they join their group at
        their first replay)."""
        if self.pool is not None:
            self.pool.close()
        self.node = node
        self.pool = RankPool(self.world, log=self.log, node=node) if self.warm else None
        if self.pool is not None:
            self.pool.start()

    def run(self, job: RankJob) -> None:
        """This node's ranks of `job`: the script's, warm ones, or fresh ones (as RayRanks decided)."""
        assert self.node is not None, "meet() came first"
        job = dataclasses.replace(job, node=self.node)
        if self.script is not None:
            ScriptRanks(self.script).run(job)
        elif self.pool is not None:
            self.pool.run(job)
        else:
            failures = run_node(job, self.node)
            if failures:
                raise ReplayError(failures)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


class RayRanks:
    """The ranks of one replay at a time (a `replay run`, or a bisect's probe slot) on a placement group of an
    open Ray session (launch/ray_cluster.py ray_session)."""

    def __init__(self, manifest: Manifest, placing: Placing, log: str | Path | None = None):
        caps = Capabilities.of(manifest)
        self.world, self.placing = manifest.world_size, placing
        self.log = str(log) if log else None
        self.groups = ([[rank] for rank in range(self.world)] if placing.pack else
                       [caps.placement.ranks_of(node) for node in range(caps.nodes)])
        threads = max(1, manifest.config.threads)
        gpus = str(manifest.last_environment.get("device", "cpu")).startswith("cuda")
        self.bundles = [{"CPU": float(threads * len(g)), **({"GPU": float(len(g))} if gpus else {})}
                        for g in self.groups]
        self.script = manifest.command if caps.relaunches_script else None
        self.warm = caps.warm_ranks and self.script is None
        self.group: Any = None
        self.actors: list[Any] = []             # Ray actor handles (their methods are called as `.remote(...)`)
        self.nodes: list[dict[str, str]] = []   # where each actor runs: Ray node id, IP, hostname
        self.nodes_used: list[str] = []         # the cluster nodes, by node rank

    def describe(self) -> str:
        how = "packed" if self.placing.pack else f"as recorded, {len(self.groups)} node(s)"
        return f"{self.world} rank(s) on a Ray placement group ({how}: bundles {self._bundle_words()})"

    def _no_room(self, when: str) -> None:
        import ray

        alive = [n for n in ray.nodes() if n.get("Alive")]
        apart = "" if self.placing.pack else ", each on a node of its own,"
        raise UsageError(f"the Ray cluster has no room for the replay's ranks{when}: they need {len(self.bundles)} "
                         f"bundle(s) ({self._bundle_words()}){apart} and it has {len(alive)} node(s); add nodes, or "
                         "pass --pack to let ranks share nodes")

    def fits(self) -> int:
        """How many groups like this one the connected cluster holds at once (its alive nodes' CPUs and GPUs;
        0: it cannot hold one)."""
        import ray

        free = [{k: float(v) for k, v in n.get("Resources", {}).items()} for n in ray.nodes() if n.get("Alive")]
        count = 0
        while True:
            used: set[int] = set()
            for bundle in sorted(self.bundles, key=lambda b: -b["CPU"]):
                room = [i for i, node in enumerate(free) if (self.placing.pack or i not in used)
                        and all(node.get(k, 0.0) >= v for k, v in bundle.items())]
                if not room:
                    return count
                best = max(room, key=lambda i: free[i].get("CPU", 0.0))
                for k, v in bundle.items():
                    free[best][k] -= v
                used.add(best)
            count += 1

    def wait_for_room(self) -> None:
        """After a node of the group was lost: wait, up to the placing's `wait`, for the cluster to hold the group
        again (a node restarting or its replacement joining takes seconds), so that the retry's `open` does not
        refuse a cluster that is still filling."""
        deadline = time.monotonic() + self.placing.wait
        while not self.fits() and time.monotonic() < deadline:
            time.sleep(0.5)

    def _bundle_words(self) -> str:
        return ", ".join("+".join(f"{v:g} {k}" for k, v in b.items()) for b in self.bundles)

    def open(self) -> RayRanks:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not self.fits():
            self._no_room("")
        self.group = placement_group(self.bundles, strategy="PACK" if self.placing.pack else "STRICT_SPREAD")
        ready, _ = ray.wait([self.group.ready()], timeout=self.placing.wait)
        if not ready:
            self.close()
            self._no_room(f" within {self.placing.wait:.0f} s")
        actor = ray.remote(max_restarts=0, **worker_options())(NodeRanks)
        self.actors = [actor.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                                     scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, i)
                                     ).remote(self.world, self.warm, self.log, self.script)
                       for i, bundle in enumerate(self.bundles)]
        self.nodes = ray.get([a.where.remote() for a in self.actors])
        self.nodes_used = list(dict.fromkeys(n["id"] for n in self.nodes))
        if self.warm:
            self._meet()
        return self

    def _meet(self) -> None:
        """Tell every actor its ranks and where rank 0 listens (a fresh port for every meeting)."""
        import ray

        first = next(i for i, g in enumerate(self.groups) if 0 in g)
        port = ray.get(self.actors[first].port.remote())
        master = (self.nodes[first]["ip"], port)
        ray.get([a.meet.remote(self._node(i, master)) for i, a in enumerate(self.actors)])

    def _node(self, i: int, master: tuple[str, int]) -> Node:
        where = self.nodes[i]
        rank = self.nodes_used.index(where["id"])
        return Node(tuple(self.groups[i]), self.world, master, rank=rank, name=f"{where['host']}/{where['id'][:12]}")

    def takes(self, launcher: Launcher, world_size: int) -> bool:
        """A placement group made for a run's manifest takes that run's replays (RayRanks.__init__ decided how
        its ranks start from the run's capabilities)."""
        return True

    def run(self, job: RankJob) -> None:
        """A launcher (launch/job.py): run the replay of `job` (prepared) on the group's ranks, and wait (the
        group is made at the first replay); warm ranks keep their rendezvous, other ranks meet afresh."""
        if self.group is None:
            self.open()
        if not self.warm:
            self._meet()
        self._wait([a.run.remote(job) for a in self.actors], job.store)

    def _wait(self, refs: list[Any], store: Location) -> None:
        """Every actor's outcome. After the first failure the others get LOST_GRACE seconds (and an actor's death
        waits that long for the cluster's word on its node), during which a node of the group reported dead
        ends the wait: a node lost is the cause the user is told."""
        import ray

        pending = dict(zip(refs, range(len(refs)), strict=True))
        failures: list[str] = []
        died: list[int] = []
        deadline: float | None = None
        while pending or died:
            done: list[Any] = []
            if pending:
                done, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
            else:   # an actor died: most likely with its node, which the cluster declares dead a little later
                time.sleep(0.5)
            for ref in done:
                i = pending.pop(ref)
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError:
                    died.append(i)
                except ray.exceptions.RayTaskError as e:
                    failures.append(str(e.cause) if isinstance(e.cause, ReplayError) else
                                    (str(e.cause).strip().splitlines() or [type(e.cause).__name__])[0])
            if (failures or died) and deadline is None:
                deadline = time.monotonic() + LOST_GRACE
            lost = self._lost_nodes() if deadline is not None else []
            if lost:
                self.close()
                raise NodeLost(f"lost node {', '.join(lost)} in the middle of {store}")
            if deadline is not None and (time.monotonic() > deadline or not (pending or died)):
                break
        if failures or died:
            self.close()
            words = failures + [f"the Ray actor of rank(s) {', '.join(map(str, self.groups[i]))} on "
                                f"{self._name(i)} died" for i in died]
            raise ReplayError("; ".join(words))

    def _lost_nodes(self) -> list[str]:
        """The group's nodes the cluster reports dead, with the ranks they held."""
        import ray

        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        return [self._name(i, f", rank(s) {', '.join(map(str, g))}") for i, g in enumerate(self.groups)
                if self.nodes[i]["id"] not in alive]

    def _name(self, i: int, more: str = "") -> str:
        where = self.nodes[i]
        return f"{where['ip']} (Ray node {where['id'][:12]}{more})"

    def close(self) -> None:
        """Kill the actors (their ranks follow them) and give the group's resources back."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for a in self.actors:
            ray.kill(a)
        self.actors = []
        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None

    def __enter__(self) -> RayRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
