"""What a recorded run can do, read once from its manifest: the one place that knows what each launcher
(config.Launcher) and a script's recorded command allow. The replayer, bisect, the views and the store
ask it by name; where a capability is missing it gives the one line a user is told.

- built in (`local`, `deepspeed`): the built-in trainer ran it; its config rebuilds the run and its data
- a script of the user's own (`custom`): `replay run` starts the script again from its recorded command
  (replay.recorder.Loop keeps it; the Recorder API does not, and such a run cannot be started again)
"""

from __future__ import annotations

from dataclasses import dataclass

from replay.config import Launcher
from replay.store.manifest import Manifest, Placement


@dataclass(frozen=True)
class Capabilities:
    launcher: Launcher
    builtin: bool                  # the built-in trainer ran it: its config rebuilds it, replay knows its data
    relaunches_script: bool        # `replay run` starts the user's script again, from its recorded command
    relaunchable: bool             # replays and bisect can start it again (built in, or a script with its command)
    warm_ranks: bool               # its replays can run on warm ranks (launch/pool.py): bisect keeps a pool
    serves_replays: bool           # its script's ranks can be kept up between replays (launch/script.py)
    world_size: int
    placement: Placement           # the nodes its ranks ran on
    zero_stage: int                # DeepSpeed's ZeRO stage (0: every rank holds the whole optimizer state)
    # Why an override cannot be replayed on this run, in the words a user gets (None: it can).
    drop_refusal: str | None       # --drop (samples left out of a step's loss)
    scoped_lr_refusal: str | None  # --lr-scale on --layers/--heads
    precision_refusal: str | None  # --precision other than the recorded one
    attention_refusal: str | None  # attention overrides, where the recorded attention is no plan of replay's
    fewer_ranks_refusal: str | None   # `replay run --ranks N` on fewer processes than the recorded ranks

    @classmethod
    def of(cls, manifest: Manifest) -> Capabilities:
        launcher, command = manifest.launcher, manifest.command
        builtin = launcher is not Launcher.CUSTOM
        placement = manifest.placement or _placement_of(manifest)
        drop = scoped_lr = precision = attention = None
        fewer = None
        if launcher is Launcher.DEEPSPEED:
            drop = "--drop needs the local launcher (DeepSpeed scales the loss itself); use --skip"
            scoped_lr = ("--lr-scale on --layers/--heads needs the local launcher: DeepSpeed partitions the "
                         "optimizer's updates")
            precision = "--precision cannot change under DeepSpeed: its optimizer state layout depends on it"
            fewer = ("--ranks needs the local launcher: DeepSpeed reduces the gradients in buckets and partitions "
                     "of its own, which replay does not play on fewer processes")
        elif launcher is Launcher.CUSTOM:
            drop = ("--drop needs the built-in trainer (it reweights the loss over the kept samples, which replay "
                    "cannot do inside your script); use --skip")
            scoped_lr = ("--lr-scale on --layers/--heads needs the built-in trainer (it knows which parameters hold "
                         "a head); use --lr-scale on the whole model")
            attention = (f"attention overrides: the recording ran transformers' {manifest.config.model.attention!r} "
                         "attention, which replay's plans do not run per head; record with "
                         "attn_implementation='sdpa' or 'eager' to override it")
            fewer = ("--ranks needs the built-in trainer: replay cannot run several recorded ranks' micro-batches "
                     "inside your script")
        return cls(launcher=launcher, builtin=builtin, relaunches_script=command is not None,
                   relaunchable=builtin or command is not None, warm_ranks=launcher is Launcher.LOCAL,
                   serves_replays=command is not None and len(placement.nodes) == 1,
                   world_size=manifest.world_size, placement=placement,
                   zero_stage=manifest.config.zero_stage,
                   drop_refusal=drop, scoped_lr_refusal=scoped_lr, precision_refusal=precision,
                   attention_refusal=attention, fewer_ranks_refusal=fewer)

    @property
    def nodes(self) -> int:
        return len(self.placement.nodes)

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1

    @property
    def sharded(self) -> bool:
        """Its optimizer state is partitioned over the ranks (ZeRO-1/2)."""
        return self.zero_stage > 0

    @property
    def can_drop_samples(self) -> bool:
        return self.drop_refusal is None

    @property
    def can_scope_lr(self) -> bool:
        return self.scoped_lr_refusal is None

    @property
    def can_change_precision(self) -> bool:
        return self.precision_refusal is None


def _placement_of(manifest: Manifest) -> Placement:
    """A store written before placements were recorded: a script's command knew its ranks per node (torchrun
    numbers them node by node); a built-in run counts as one node."""
    command, world = manifest.command, manifest.world_size
    local = command.local_world_size if command is not None and command.local_world_size else world
    nodes = -(-world // local)
    return Placement(nodes=[f"node {n}" for n in range(nodes)], rank_nodes=[rank // local for rank in range(world)])
