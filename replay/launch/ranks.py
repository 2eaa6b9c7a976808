"""Starting a recording: prepare the store once, then run the ranks.

Local ranks are fresh `python -m replay.launch.worker STORE` processes with torchrun's environment (env://
rendezvous on loopback), started here so that each one dies with this process (launch/lifeline.py). Under an outer `torchrun`/`deepspeed` launcher (multi-node),
`replay record` is itself a rank: rank 0 prepares the store and the other ranks wait for its go.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from replay.config import RunConfig
from replay.errors import ReplayError, StoreError, UsageError
from replay.launch.lifeline import child_env
from replay.store import RunStore
from replay.store.lease import ENV as LEASE_ENV
from replay.store.lease import writing
from replay.store.run_store import is_empty_dir
from replay.train.model import check_attention
from replay.train.data import (builtin_corpus, cpu_count, fingerprint_file, fingerprint_tokens, make_data,
                               open_token_file)


def record_new(store_path: str, cfg: RunConfig, command: str = "replay record") -> None:
    """Record a new run on this machine's ranks, holding the store's lease throughout."""
    with writing(store_path, command) as lease:
        prepare_new(store_path, cfg, world_size=cfg.nproc, local_world=cfg.nproc)
        run_ranks(store_path, cfg, cfg.nproc, False, lease.spec)


def record_resume(store_path: str, world_size: int, command: str = "replay record --resume",
                  progress: Callable[[str], None] = lambda m: None) -> None:
    """Continue a stopped or crashed run on this machine's ranks, holding the store's lease throughout."""
    with writing(store_path, command) as lease:
        store, cfg = prepare_resume(store_path, world_size)
        progress(f"resuming {store_path} from step {store.n_steps} of {cfg.steps}")
        run_ranks(store_path, cfg, cfg.nproc, True, lease.spec)


def under_outer_launcher() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def prepare_new(store_path: str, cfg: RunConfig, world_size: int, local_world: int) -> RunStore:
    """Validate everything a rank would trip over, then create the store: nothing is written on error."""
    if cfg.threads == 0:
        cfg.threads = max(1, cpu_count() // local_world)
    path = Path(store_path)
    if not is_empty_dir(path):
        RunStore.create(path, {})  # raises the "not empty" error
    if cfg.data.path:
        tokens = open_token_file(cfg)
        make_data(cfg, tokens)
        data_meta = {**fingerprint_file(Path(cfg.data.path)), "embedded": False, "dtype": cfg.data.dtype}
    else:
        tokens = builtin_corpus(cfg.data.corpus_bytes)
        make_data(cfg, tokens)
        data_meta = {**fingerprint_tokens(tokens), "embedded": True, "dtype": "uint8",
                     "source": "python stdlib *.py files (built-in corpus)"}
    _check_deepspeed(cfg)
    cfg.model.attention = check_attention(cfg.model, cfg.numerics)
    store = RunStore.create(path, {
        "config": cfg.to_dict(), "data": data_meta, "world_size": world_size, "launcher": cfg.launcher,
        "created": time.time(), "status": "running", "resumes": [],
    })
    if data_meta["embedded"]:
        store.write_tokens(tokens)
    return store


def prepare_resume(store_path: str, world_size: int) -> tuple[RunStore, RunConfig]:
    """Check the store can be resumed by this launch, then cut it back to its last committed checkpoint."""
    path = Path(store_path)
    if not path.exists():
        raise StoreError(f"--resume: {path} does not exist; record without --resume to start a run")
    store = RunStore.open(path, mode="a")
    cfg = RunConfig.from_dict(store.manifest["config"])
    recorded = store.manifest["world_size"]
    if world_size != recorded:
        raise UsageError(f"--resume with {world_size} ranks, but {path} was recorded with {recorded}; "
                         f"resume with --nproc {recorded} (bitwise continuation needs the same world size)")
    if cfg.data.path:
        now = fingerprint_file(Path(cfg.data.path)) if Path(cfg.data.path).is_file() else None
        if now is None or now["digest"] != store.manifest["data"]["digest"]:
            raise UsageError(f"data file {cfg.data.path} is missing or changed since the run was recorded; "
                             "restore the original file to resume")
    last = store.rewind(verify_world_size=world_size)
    store.update_manifest(status="running", resumes=[*store.manifest["resumes"],
                                                     {"from_step": last, "time": time.time()}])
    return store, cfg


def _check_deepspeed(cfg: RunConfig) -> None:
    if cfg.launcher != "deepspeed":
        return
    try:
        import deepspeed  # noqa: F401
    except Exception as e:
        raise UsageError(f"--launcher deepspeed needs DeepSpeed importable here: {e}") from None


def run_ranks(store_path: str, cfg: RunConfig, nproc: int, resume: bool, lease: str) -> None:
    """Run the ranks on this machine, writing under `lease` (store/lease.py), and wait; a failing rank
    fails the whole recording."""
    if nproc == 1 and cfg.launcher == "local":
        from replay.train.trainer import train

        train(store_path, lease, resume=resume)
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if cfg.device == "cpu" or not _cuda() else "cuda")
    port = free_port()
    args = [sys.executable, "-m", "replay.launch.worker", str(store_path)] + (["--resume"] if resume else [])
    procs = [subprocess.Popen(args, env={**rank_env(rank, nproc, port), LEASE_ENV: lease}) for rank in range(nproc)]
    failures = wait_for_ranks(procs)
    if failures:
        raise ReplayError(f"{failures}; their own messages are above (committed checkpoints are intact: "
                          f"`replay record --store {store_path} --resume` continues)")


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """What torchrun gives a rank on one machine (env:// rendezvous on loopback), and the lifeline."""
    env = child_env({**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                     "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    env.pop("TORCHELASTIC_RUN_ID", None)
    return env


def wait_for_ranks(procs: list[subprocess.Popen], grace: float = 5.0) -> str | None:
    """Wait for every rank. When one fails, the others get `grace` seconds to fail on their own (a peer
    stuck in a collective with the dead rank usually errors out at once), then are killed. Returns the
    failures in words, the first one first, or None. Whatever ends the wait, no rank outlives it."""
    failed: list[tuple[int, int]] = []
    deadline = None
    try:
        while any(p.poll() is None for p in procs):
            new = [(rank, p.returncode) for rank, p in enumerate(procs)
                   if p.returncode not in (None, 0) and rank not in dict(failed)]
            failed += sorted(new, key=lambda f: f[1] >= 0)   # in one pass, a rank killed outright came first
            if failed and deadline is None:
                deadline = time.monotonic() + grace
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    for rank, p in enumerate(procs):
        if p.returncode != 0 and rank not in dict(failed):
            failed.append((rank, p.returncode))
    if not failed:
        return None
    return ", then ".join(f"rank {rank} {_how(code)}" for rank, code in failed)


def _how(code: int) -> str:
    if code < 0:
        return f"was killed by signal {-code} ({signal.Signals(-code).name})"
    return f"exited with code {code}"


def wait_for_prepared(store_path: str, launch_id: str, timeout: float = 600) -> None:
    """Ranks > 0 under an outer launcher: wait until rank 0 has prepared the store for this launch."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if RunStore.open(store_path).manifest.get("launch_id") == launch_id:
                return
        except ReplayError:
            pass
        time.sleep(0.2)
    raise StoreError(f"rank 0 did not prepare {store_path} within {timeout:.0f}s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
