"""The manifest: what a run store says about its run, typed. Every component reads the run through it.

Stored as the root group's JSON attributes (store/run_store.py). A replay's manifest also carries its
`ReplaySpec`: written by the replayer, read by the trainer, defined here once. Schema 2 seals the
document with a checksum (store/integrity.py); schema 1 (stores written before that) reads the same way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any

from replay.config import Launcher, RunConfig, unknown_keys
from replay.store.overrides import Overrides, Reached
from replay.store.sharding import Sharding
from replay.store.verification import Verification

SCHEMA = 2
READABLE = (1, 2)


@dataclass
class DataInfo:
    """Where the samples come from, and a fingerprint to tell whether they changed."""

    embedded: bool                 # the built-in corpus, stored in data/tokens
    path: str | None               # a token file of the user's (not copied)
    bytes: int
    method: str                    # how the digest was taken: "sha256", "sha256-sampled-64x1MiB", "none"
    digest: str
    source: str | None = None      # in words
    dtype: str | None = None       # of the token file


@dataclass
class ResumeInfo:
    from_step: int
    time: float
    environment: dict[str, Any] | None = None   # where the resumed run ran (recorder/environment.py)


@dataclass
class CommandInfo:
    """How a training script of the user's own was started, so that a replay can start it again."""

    argv: list[str]                # the interpreter's arguments (sys.orig_argv without the executable)
    cwd: str
    launcher: str                  # "torchrun" (torch.distributed's environment) or "python" (one process)
    world_size: int
    files: dict[str, str]          # the script and the local modules it imported: path -> sha256
    env: dict[str, str] = field(default_factory=dict)   # the variables that change what runs (recorder/command.py)
    env_prefixes: list[str] = field(default_factory=list)   # the prefixes `env` was taken by (a launcher's settings)
    local_world_size: int = 0      # ranks on the recording's node (< world_size: it ran on several nodes)
    imports: list[str] = field(default_factory=list)   # installed packages it had imported (launch/script.py forks
                                                       # its replays' ranks from a server that imported them)


@dataclass(frozen=True)
class TraceRequest:
    """A replay asked to trace one step on one rank (`replay diff` of a script's run, recorder/step_trace.py):
    every tensor of that step written into `directory`, a folder of the machine the rank runs on."""

    step: int
    rank: int
    directory: str


@dataclass
class ReplaySpec:
    """What makes a store a replay of its parent run's steps `start`..`stop`."""

    parent: str                    # the run store, relative to the replay's directory ("../..")
    start: int                     # the window's first step
    stop: int                      # its last step (inclusive)
    start_checkpoint: int          # the parent's committed checkpoint the replay restores
    start_checkpoint_kind: str
    checkpoint_every: int          # 0: only the checkpoint at the end
    overrides: Overrides           # what the replay changes (store/overrides.py)
    skip: list[int] = field(default_factory=list)
    drop: list[list[int]] = field(default_factory=list)   # [step, sample id] pairs left out
    lr_scope: dict[str, Any] | None = None                # a scoped lr scale (recorder/overrides.py)
    processes: int | None = None   # --ranks: processes that played the recorded ranks (None: one per rank)
    verification: Verification | None = None              # written when the replay has run
    reached: Reached | None = None                        # what its overrides reached (recorder/overrides.py)
    trace: TraceRequest | None = None                     # a step to trace (replay diff of a script's run)


_TYPED_SPEC_FIELDS = ("parent", "start", "stop", "overrides", "verification", "reached", "trace")   # read by hand below

PROBE_SAMPLES = 4                  # the analysis probe's batch: this many samples ...
PROBE_TOKENS = 256                 # ... and at most this many of their tokens


@dataclass
class ModelInfo:
    """A transformers model trained by a loop of the user's own: its config (`config.to_dict()`, which
    rebuilds it without a download) and the probe batch, the first PROBE_SAMPLES rows of the first
    training forward's input_ids, cut to PROBE_TOKENS (taken then: the store does not hold the data)."""

    transformers_config: dict[str, Any]
    probe: list[list[int]] | None = None


@dataclass
class Placement:
    """The nodes a run's ranks ran on (torchrun's node rank, GROUP_RANK, tells them apart on one host):
    the layout a replay on a cluster keeps (launch/ray_ranks.py)."""

    nodes: list[str]               # each node's name, by node rank: its hostname (on a Ray cluster, with its node id)
    rank_nodes: list[int]          # each rank's node: an index into `nodes`

    def ranks_of(self, node: int) -> list[int]:
        return [rank for rank, n in enumerate(self.rank_nodes) if n == node]


@dataclass
class SeriesInfo:
    """Checkpoints replay did not record (store/foreign/), whose analysis a store of kind "series" holds."""

    location: str                  # their folder or prefix, as seen from the store (store/location.py `relative`)
    format: str                    # "hf-trainer", "dcp" or "nanogpt"
    heads: int
    layout: dict[str, Any]         # store/layout.py
    losses: list[list[float]] = field(default_factory=list)   # [step, training loss] where the checkpoints say it


@dataclass
class Manifest:
    kind: str                      # "run", "replay" or "series"
    config: RunConfig
    world_size: int
    launcher: Launcher             # what it can do: store/capabilities.py
    data: DataInfo
    created: float
    status: str = "running"        # "running" until the last step is recorded, then "complete"
    resumes: list[ResumeInfo] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)   # recorder/environment.py fingerprint()
    launch_id: str | None = None   # under an outer launcher: the launch that prepared the store
    steps_recorded: int | None = None
    replay: ReplaySpec | None = None
    command: CommandInfo | None = None   # a loop of the user's own (recorder/loop.py): how to start it again
    layout: dict[str, Any] | None = None  # where its attention weights live (store/layout.py)
    model: ModelInfo | None = None       # a transformers model of the user's own: what the analysis probe needs
    sharding: Sharding | None = None     # a model sharded across ranks: each rank's pieces (store/sharding.py)
    init_from: str | None = None         # the DCP directory its initial state was loaded from (recorder/dcp.py)
    series: SeriesInfo | None = None     # kind "series": the checkpoints it analyses
    placement: Placement | None = None   # the nodes its ranks ran on (recorder/placement.py)
    schema: int = SCHEMA

    def __post_init__(self) -> None:
        self.launcher = Launcher(self.launcher)   # given as its string too ("custom")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"replay": {"schema": self.schema, "kind": self.kind}, "config": self.config.to_dict(),
                               "world_size": self.world_size, "launcher": self.launcher.value,
                               "data": asdict(self.data), "created": self.created, "status": self.status,
                               "resumes": [asdict(r) for r in self.resumes], "environment": self.environment}
        if self.launch_id is not None:
            out["launch_id"] = self.launch_id
        if self.steps_recorded is not None:
            out["steps_recorded"] = self.steps_recorded
        if self.command is not None:
            out["command"] = asdict(self.command)
        if self.layout is not None:
            out["layout"] = self.layout
        if self.model is not None:
            out["model"] = asdict(self.model)
        if self.sharding is not None:
            out["sharding"] = self.sharding.to_dict()
        if self.init_from is not None:
            out["init_from"] = self.init_from
        if self.series is not None:
            out["series"] = asdict(self.series)
        if self.placement is not None:
            out["placement"] = asdict(self.placement)
        if self.replay is not None:
            spec = asdict(self.replay)
            if spec["trace"] is None:
                del spec["trace"]
            out.update({"parent": spec.pop("parent"), "window": {"from": spec.pop("start"), "to": spec.pop("stop")},
                        **spec, "overrides": self.replay.overrides.to_dict()})
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        """The manifest a store holds; a ValueError names a field this version does not know (a newer one's)."""
        unknown = sorted(set(d) - _STORED_FIELDS) + [f"config.{key}" for key in unknown_keys(d.get("config", {}))]
        if unknown:
            raise ValueError(f"field {unknown[0]!r}, unknown to this version")
        meta = d["replay"]
        replay = None
        if meta["kind"] == "replay":
            replay = ReplaySpec(parent=d["parent"], start=d["window"]["from"], stop=d["window"]["to"],
                                **{f.name: d[f.name] for f in dataclasses.fields(ReplaySpec) if f.name in d
                                   and f.name not in _TYPED_SPEC_FIELDS},
                                overrides=Overrides.from_dict(d["overrides"]),
                                verification=Verification.from_dict(d["verification"]) if d.get("verification")
                                else None,
                                reached=Reached.from_dict(d["reached"]) if d.get("reached") else None,
                                trace=TraceRequest(**d["trace"]) if d.get("trace") else None)
        data = {f.name: d["data"].get(f.name) for f in dataclasses.fields(DataInfo)}
        return cls(kind=meta["kind"], schema=meta["schema"], config=RunConfig.from_dict(d["config"]),
                   world_size=d["world_size"], launcher=d["launcher"], data=DataInfo(**data), created=d["created"],
                   status=d.get("status", "unknown"), resumes=[ResumeInfo(**r) for r in d.get("resumes", [])],
                   environment=d.get("environment") or {}, launch_id=d.get("launch_id"),
                   steps_recorded=d.get("steps_recorded"), replay=replay,
                   command=CommandInfo(**d["command"]) if d.get("command") else None, layout=d.get("layout"),
                   model=ModelInfo(**d["model"]) if d.get("model") else None,
                   sharding=Sharding.from_dict(d["sharding"]) if d.get("sharding") else None,
                   init_from=d.get("init_from"), series=SeriesInfo(**d["series"]) if d.get("series") else None,
                   placement=Placement(**d["placement"]) if d.get("placement") else None)

    @property
    def replay_spec(self) -> ReplaySpec:
        """What makes this store a replay (of kind "replay")."""
        assert self.replay is not None, "the store is a run, not a replay"
        return self.replay

    @property
    def last_environment(self) -> dict[str, Any]:
        """Where the run last ran: its latest resume's machine, else its recording's."""
        return next((r.environment for r in reversed(self.resumes) if r.environment), self.environment)


# The top-level fields `Manifest.to_dict` writes (a replay's spec flattened into them, its window as one field)
_STORED_FIELDS = ({f.name for f in dataclasses.fields(Manifest)} - {"kind", "schema"}
                  | {"window"} | {f.name for f in dataclasses.fields(ReplaySpec)} - {"start", "stop"})
