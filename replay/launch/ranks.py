"""Starting a recording: prepare the store once, then run the ranks.

Local ranks are started with PyTorch's own elastic launcher (what `torchrun` runs), each rank a fresh
`python -m replay.launch.worker STORE` process. Under an outer `torchrun`/`deepspeed` launcher (multi-node),
`replay record` is itself a rank: rank 0 prepares the store and the other ranks wait for its go.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import uuid
from pathlib import Path

from replay.config import RunConfig
from replay.errors import ReplayError, StoreError, UsageError
from replay.store import RunStore
from replay.train.model import check_attention
from replay.train.data import (builtin_corpus, cpu_count, fingerprint_file, fingerprint_tokens, make_data,
                               open_token_file)


def under_outer_launcher() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def prepare_new(store_path: str, cfg: RunConfig, world_size: int, local_world: int) -> RunStore:
    """Validate everything a rank would trip over, then create the store: nothing is written on error."""
    if cfg.threads == 0:
        cfg.threads = max(1, cpu_count() // local_world)
    path = Path(store_path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
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


def run_ranks(store_path: str, cfg: RunConfig, nproc: int, resume: bool) -> None:
    """Run the ranks on this machine and wait; a failing rank fails the whole recording."""
    if nproc == 1 and cfg.launcher == "local":
        from replay.train.trainer import train

        train(store_path, resume=resume)
        return
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("DS_ACCELERATOR", "cpu" if cfg.device == "cpu" or not _cuda() else "cuda")
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"replay-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}", max_restarts=0, monitor_interval=0.1,
    )
    args = ["-m", "replay.launch.worker", str(store_path)] + (["--resume"] if resume else [])
    try:
        elastic_launch(config, entrypoint=sys.executable)(*args)
    except ChildFailedError as e:
        raise ReplayError(f"{_describe_failures(e.failures)}; their own messages are above (committed "
                          f"checkpoints are intact: `replay record --store {store_path} --resume` continues)") from None


def _describe_failures(failures: dict) -> str:
    """Every failed rank, the likely cause first: the earliest, and among equals (timestamps are whole
    seconds) a rank killed outright or exiting with its own error before one that aborted after it."""
    import signal

    def how(f) -> str:
        if f.exitcode < 0:
            return f"was killed by signal {-f.exitcode} ({signal.Signals(-f.exitcode).name})"
        return f"exited with code {f.exitcode}"

    order = sorted(failures.items(), key=lambda kv: (kv[1].timestamp, kv[1].exitcode in (-6, -15)))
    first_rank, first = order[0]
    text = f"rank {first_rank} {how(first)}"
    others = [f"rank {r} {how(f)}" for r, f in order[1:]]
    return text + (f", then {', '.join(others)}" if others else "")


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
