"""Starting a recording: prepare the store once, then run the ranks; and the one place that decides how a run's
ranks start (`choose_launcher`, for recordings and replays alike).

Local ranks have torchrun's environment (env:// rendezvous on loopback) and die with this process
(lifeline.py): forked from a fork server of this command's (forkserver.py), or fresh `python -m
replay.launch.worker STORE` processes (fresh.py), or the warm ranks a caller passes (pool.py).
Under an outer `torchrun`/`deepspeed` launcher (multi-node), `replay record` is itself a rank: rank 0
prepares the store and the other ranks wait for its go. A rank's variables without their launcher (left in a
shell by another job) are refused in one line (`outer_launcher`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from replay.config import Launcher, RunConfig
from replay.errors import ChecksumError, ReplayError, StoreError, UsageError
from replay.kernels.plan import check_attention
from replay.launch.forkserver import ForkServer
from replay.launch.fresh import FreshRanks
from replay.launch.job import RankJob, RankLauncher, continued_by, fresh_ranks
from replay.launch.local import collector_paused
from replay.launch.script import ScriptRanks, ScriptServer
from replay.recorder.host import environment_notes
from replay.store import RunStore
from replay.store.capabilities import Capabilities
from replay.store.lease import writing
from replay.store.lifecycle import continue_command, create_run, resume_run
from replay.store.location import Location, Where
from replay.store.manifest import CommandInfo, DataInfo, Manifest
from replay.store.run_store import check_empty, check_outside_stores
from replay.train.data import (
    DataOrder,
    TokenData,
    builtin_corpus,
    cpu_count,
    fingerprint_file,
    fingerprint_tokens,
    load_data,
    make_data,
    open_token_file,
)


def record_new(store: Where, cfg: RunConfig, command: str = "replay record",
               progress: Callable[[str], None] = lambda m: None, ranks: RankLauncher | None = None) -> None:
    """Record a new run on this machine's ranks (on `ranks` where it takes them: `choose_launcher`), holding
    the store's lease throughout."""
    store = Location.parse(store)
    check_outside_stores(store)   # before the lease: a location inside a store would take that store's
    with writing(store, command) as lease:
        prepare_new(store, cfg, world_size=cfg.nproc, local_world=cfg.nproc)
        zero = f", ZeRO-{cfg.zero_stage}" if cfg.launcher is Launcher.DEEPSPEED else ""
        progress(f"recording preset {cfg.preset!r}: {cfg.steps} steps on {cfg.nproc} rank(s) ({cfg.launcher}{zero}, "
                 f"{cfg.precision}) into {store}")
        run_ranks(store, cfg, cfg.nproc, False, lease.spec, ranks)


def record_resume(store: Where, world_size: int, command: str = "replay record --resume",
                  progress: Callable[[str], None] = lambda m: None, ranks: RankLauncher | None = None) -> None:
    """Continue a stopped or crashed run on this machine's ranks (on `ranks` where it takes them), holding the
    store's lease throughout."""
    store = Location.parse(store)
    with writing(store, command, report=lambda m: progress(f"note: {m}")) as lease:
        r = prepare_resume(store, world_size)
        for note in r.notes:
            progress(f"warning: the environment differs from the recording's: {note} (bitwise continuation is "
                     "not guaranteed)")
        progress(f"resuming {store} from step {r.start} of {r.cfg.steps}" if r.start is not None else
                 f"{store} has no committed checkpoint (it stopped while starting): recording it from step 0")
        run_ranks(store, r.cfg, r.cfg.nproc, r.start is not None, lease.spec, ranks)


# What each outer launcher sets in every rank's environment besides RANK and WORLD_SIZE
LAUNCHERS = {"torchrun": ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                          "MASTER_PORT"),
             "deepspeed": ("LOCAL_RANK", "CROSS_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")}
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_RUN_ID")


def outer_launcher(nproc: int | None = None) -> str | None:
    """The launcher that started this process as one of its ranks ("torchrun", "deepspeed"), or None where this
    process starts the ranks itself (`nproc`: the --nproc it was given). A rank's variables left in the
    environment without their launcher would make it wait for ranks that never come: refused in one line."""
    if not any(name in os.environ for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")):
        return None
    if nproc is not None:
        raise _stray_ranks(f"but --nproc {nproc} starts this machine's ranks", "leave out --nproc under a launcher "
                           "(it says how many ranks), or unset them ({unset}) to start the ranks here")
    launcher = next((name for name, markers in LAUNCHERS.items() if all(k in os.environ for k in markers)), None)
    if launcher is None or not _rank_numbers_agree():
        raise _stray_ranks("but no launcher started this process as one of its ranks (torchrun sets "
                           f"{', '.join(LAUNCHERS['torchrun'][:3])} as well)", _UNSET)
    if launcher == "torchrun" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and not _reachable(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])):
        raise _stray_ranks(f"but no torchrun agent answers at {os.environ['MASTER_ADDR']}:"
                           f"{os.environ['MASTER_PORT']} (its launch has ended)", _UNSET)
    return launcher


_UNSET = "unset them ({unset}) to record on this machine's ranks, or start the command under torchrun"


def refuse_rank_variables() -> None:
    """Refuse a rank's variables in a command that starts its ranks itself (or trains in this process)."""
    if any(name in os.environ for name in ("RANK", "WORLD_SIZE")):
        raise _stray_ranks("but this command starts its ranks itself", "unset them ({unset})")


def _stray_ranks(why: str, remedy: str) -> UsageError:
    """The rank variables set here, why they are wrong, and `remedy` (its {unset}: the command that unsets them)."""
    names = [name for name in RANK_VARIABLES if name in os.environ]
    found = " ".join(f"{name}={os.environ[name]}" for name in names)
    return UsageError(f"{found} {'is' if len(names) == 1 else 'are'} set in the environment, {why}: "
                      + remedy.format(unset=f"`unset {' '.join(names)}`"))


def _rank_numbers_agree() -> bool:
    try:
        rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        port = int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError):
        return False
    return 0 <= rank < world and 0 <= local <= rank and 0 < port < 65536


def _reachable(host: str, port: int, timeout: float = 5.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def prepare_new(path: Location, cfg: RunConfig, world_size: int, local_world: int) -> RunStore:
    """Validate everything a rank would trip over, then create the store: nothing is written on error."""
    if cfg.threads == 0:
        cfg.threads = max(1, cpu_count() // local_world)
    check_empty(path)
    if cfg.data.path:
        tokens = open_token_file(cfg)
        make_data(cfg, tokens)
        data = DataInfo(embedded=False, dtype=cfg.data.dtype, **fingerprint_file(Path(cfg.data.path)))
    else:
        tokens = builtin_corpus(cfg.data.corpus_bytes)
        make_data(cfg, tokens)
        data = DataInfo(embedded=True, dtype="uint8", source="python stdlib *.py files (built-in corpus)",
                        **fingerprint_tokens(tokens))
    _check_deepspeed(cfg)
    _check_device(cfg, local_world)
    cfg.model.attention = check_attention(cfg.model, cfg.numerics)
    store = create_run(path, cfg, world_size=world_size, launcher=cfg.launcher, data=data)
    if data.embedded:
        store.write_tokens(tokens)
    return store


@dataclass
class Resume:
    store: RunStore
    cfg: RunConfig
    start: int | None   # the committed checkpoint the run continues from; None: nothing was committed, start over
    notes: list[str]    # how this machine differs from the recording's (bitwise continuation not guaranteed)


def prepare_resume(path: Location, world_size: int) -> Resume:
    """Check the store can be continued bit for bit by this launch (refusing, untouched, where it cannot),
    then cut it back to its last committed checkpoint, or to its start if nothing was committed."""
    if not path.children():
        raise StoreError(f"--resume: {path} does not exist; record without --resume to start a run")
    store = RunStore.open(path, mode="a")
    _check_resumable(store)
    m = store.manifest
    cfg = m.config
    if world_size != m.world_size:
        raise UsageError(f"--resume with {world_size} ranks, but {path} was recorded with {m.world_size}; "
                         f"resume with --nproc {m.world_size} (bitwise continuation needs the same world size)")
    if cfg.data.path:
        now = fingerprint_file(Path(cfg.data.path)) if Path(cfg.data.path).is_file() else None
        if now is None or now["digest"] != m.data.digest:
            raise UsageError(f"data file {cfg.data.path} is missing or changed since the run was recorded; "
                             "restore the original file to resume")
    notes = _environment_check(m)
    committed = store.checkpoints()
    start = committed[-1].step if committed else None
    data = _data(store, cfg, m.data, start)
    if start:
        _check_data_order(store, cfg, data, start)
    rewound = resume_run(store, world_size)
    assert rewound == start, "the lease keeps the store still while it is resumed"
    return Resume(store, cfg, start, notes)


def _check_resumable(store: RunStore) -> None:
    """Refuse, untouched, what `record --resume` does not continue: a replay, a run of the user's own or of an
    older replay, or a run recorded to its end."""
    m = store.manifest
    if m.kind == "replay" and m.status != "complete":
        raise UsageError(f"{store.location} is a replay: continue it with `{continue_command(store)}`")
    if m.kind != "run":
        raise UsageError(f"{store.location} is a {'complete replay' if m.kind == 'replay' else m.kind}, not a "
                         "run: nothing to resume")
    store.check_rebuildable("replay record --resume")
    store.check_writable()
    if m.status == "complete":
        raise UsageError(f"{store.location} is complete: all {m.config.steps} steps are recorded and there is "
                         "nothing to resume; to train longer, record a new run with more --steps in a new --store")


def _environment_check(m: Manifest) -> list[str]:
    """What differs from the environment the run last ran in; a refusal where the run cannot go on here."""
    recorded = m.last_environment
    if not recorded:   # killed before its ranks had started: nothing ran anywhere yet
        return []
    if recorded.get("device", "cpu").startswith("cuda") and not _cuda():
        raise UsageError(f"the run was recorded on {recorded['device']} ({recorded.get('cuda', {}).get('gpu')}) and "
                         "this machine has no CUDA device: resume it on a machine like the one it ran on")
    return environment_notes(recorded)


def _data(store: RunStore, cfg: RunConfig, meta: DataInfo, start: int | None) -> TokenData:
    """The run's data, checked. Embedded data a crash cut short before the first commit is written again
    (the built-in corpus is rebuilt and must match the recorded digest)."""
    if cfg.data.path or start is not None:
        return load_data(cfg, store)
    try:
        return load_data(cfg, store)
    except ChecksumError:
        tokens = builtin_corpus(cfg.data.corpus_bytes)
        if fingerprint_tokens(tokens)["digest"] != meta.digest:
            raise UsageError("the built-in corpus embedded in the store was cut short, and this Python's standard "
                             "library gives other bytes than the recording's: record the run anew") from None
        store.write_tokens(tokens)
        return make_data(cfg, tokens)


def _check_data_order(store: RunStore, cfg: RunConfig, data: TokenData, start: int) -> None:
    """The samples of steps 0..start-1 recomputed here must be the recorded ones: the same order is what
    the steps from `start` on will be drawn from."""
    recorded = store.read_steps(["sample_ids"])["sample_ids"][:start]             # (step, rank, micro, sample)
    order = DataOrder(data.n_samples, cfg.batch_size, cfg.seed).steps_ids(0, start)   # (step, batch)
    world, accum, micro = recorded.shape[1:]
    now = order.reshape(start, accum, world, micro).transpose(0, 2, 1, 3)
    if not np.array_equal(now, recorded):
        step, rank = (int(x) for x in np.argwhere(now != recorded)[0][:2])
        raise UsageError(f"the data order recomputed here differs from the recorded one at step {step} (rank {rank}: "
                         f"{recorded[step, rank].ravel().tolist()} recorded, {now[step, rank].ravel().tolist()} "
                         "now; a different numpy?): resuming could not continue the run bit for bit")


def _check_deepspeed(cfg: RunConfig) -> None:
    if cfg.launcher is not Launcher.DEEPSPEED:
        return
    try:   # lazy: whether DeepSpeed (optional, 1.3 s) imports, under --launcher deepspeed only
        import deepspeed  # noqa: F401
    except Exception as e:
        raise UsageError(f"--launcher deepspeed needs DeepSpeed importable here: {e}") from None


def _check_device(cfg: RunConfig, local_world: int) -> None:
    """A run on CUDA needs a CUDA device for each of this node's ranks."""
    if cfg.device != "cuda":
        return
    # lazy: torch (1 s), for a run that asks for CUDA only
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have == 0:
        raise UsageError(f"device cuda: this machine has no CUDA device (torch {torch.__version__}); record on the "
                         "CPU with --set device=cpu (or device=auto, which takes CUDA where there is one)")
    if have < local_world:
        raise UsageError(f"device cuda: {local_world} ranks on this machine need a CUDA device each, and it has "
                         f"{have}; record with --nproc {have} or fewer")


def choose_launcher(launcher: Launcher, world_size: int, command: CommandInfo | None = None,
                    given: RankLauncher | None = None) -> RankLauncher:
    """How the ranks of a run of `launcher` on `world_size` processes start: the one place this is decided.
    On `given` (the caller's warm ranks, fork server or Ray placement group) where it takes them; a script of
    the user's own as `command` recorded it; one local rank in this process; several local ranks forked from a
    fork server of their own, unless REPLAY_RANKS=fresh; otherwise (DeepSpeed) fresh processes."""
    if given is not None and given.takes(launcher, world_size):
        return given
    if launcher is Launcher.CUSTOM:
        assert command is not None, "a script's run is replayed from its recorded command"
        return ScriptRanks(command)
    if launcher is Launcher.LOCAL and world_size == 1:
        return InProcess()
    fork = ForkServer()
    return fork if fork.takes(launcher, world_size) and not fresh_ranks() else FreshRanks()


def kept_up(manifest: Manifest) -> ScriptServer | ForkServer | None:
    """Ranks kept up across the replays of one session (`replay session`) of the run recorded as `manifest`: a
    script's ranks on one machine, each next replay served in place (launch/script.py); the built-in trainer's
    local ranks, forked from one fork server. None where every replay starts its own anyway (one rank in the
    command's process, DeepSpeed, a script over several nodes) or REPLAY_RANKS=fresh asks for fresh ranks."""
    caps = Capabilities.of(manifest)
    if fresh_ranks():
        return None
    if caps.relaunches_script:
        return ScriptServer(manifest.command) if caps.serves_replays and manifest.command is not None else None
    fork = ForkServer()
    return fork if fork.takes(caps.launcher, caps.world_size) else None


@contextlib.contextmanager
def launching(launcher: Launcher, world_size: int, command: CommandInfo | None = None,
              given: RankLauncher | None = None) -> Iterator[RankLauncher]:
    """`choose_launcher`'s launcher for the block; a fork server it started ends with the block."""
    chosen = choose_launcher(launcher, world_size, command, given)
    try:
        yield chosen
    finally:
        if isinstance(chosen, ForkServer) and chosen is not given:
            chosen.close()


def run_ranks(store: Location, cfg: RunConfig, nproc: int, resume: bool, lease: str,
              given: RankLauncher | None = None) -> None:
    """Run the built-in trainer's ranks on this machine (`choose_launcher`), writing under `lease`
    (store/lease.py), and wait; a failing rank fails the whole recording."""
    with launching(cfg.launcher, nproc, given=given) as launcher:
        launcher.run(RankJob(store, lease, resume, nproc, env=launcher_env(cfg)))


def launcher_env(cfg: RunConfig) -> dict[str, str]:
    """The variables the ranks of a run of `cfg` get from their launcher besides torchrun's."""
    if cfg.launcher is not Launcher.DEEPSPEED:
        return {}
    # the ranks', not this process's (its next command's, in a session)
    return {"DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR") or ("cpu" if cfg.device == "cpu" or not _cuda()
                                                                   else "cuda")}


class InProcess:
    """A launcher (launch/job.py) of the one rank of a local single-rank run: it trains in this process."""

    def takes(self, launcher: Launcher, world_size: int) -> bool:
        return launcher is Launcher.LOCAL and world_size == 1

    def run(self, job: RankJob) -> None:
        # lazy: the launcher never loads torch and transformers (2 s); its one rank does, here
        with collector_paused():
            from replay.train.trainer import train

        refuse_rank_variables()   # the rank reads them
        try:
            train(job.store, job.lease, resume=job.resume)
        except OSError as e:   # the disk filled up, the store's filesystem went away: as a rank process says it
            raise ReplayError(f"rank 0 failed: {type(e).__name__}: {e} (committed checkpoints are intact"
                              f"{continued_by(job.store)})") from e


def wait_for_prepared(store: Location, launch_id: str, timeout: float = 600) -> None:
    """Ranks > 0 under an outer launcher: wait until rank 0 has prepared the store for this launch."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if RunStore.open(store).manifest.launch_id == launch_id:
                return
        except ReplayError:
            pass
        time.sleep(0.2)
    raise StoreError(f"rank 0 did not prepare {store} within {timeout:.0f}s")


def _cuda() -> bool:
    # lazy: torch (1 s), for a CUDA or DeepSpeed run only
    import torch

    return torch.cuda.is_available()
