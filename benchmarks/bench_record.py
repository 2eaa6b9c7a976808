"""Benchmark the recorder: what recording costs a training step, and how fast the store moves checkpoints.

1. Recording overhead. Two identical GPT-2 models (same seed, same data order; 4 layers x 128, seq 128,
   batch 16) train side by side with the built-in trainer's step (`_torch_step`): one plain, one followed
   by `Recorder.record_step` with a checkpoint every 50 steps and a snapshot every 10. After 10 warm-up
   steps the variants alternate step by step (A B, B A, A B, ...) so machine noise hits both alike.
   A step time is the median over 10-step windows of the window's mean: each window holds exactly one
   in-memory copy of the state (a snapshot or a checkpoint), so its cost counts at the real cadence,
   while steps slowed by other load on the machine do not. The background writer is drained after every
   step, untimed, so that a checkpoint's write cannot slow the next plain step; a second line adds that
   time (the view for a machine whose cores the training already fills). The final wait in
   `Recorder.close()` is reported apart.
2. Checkpoint throughput. The state {"model": ..., "optimizer": ...} after one AdamW step, written and read
   through the run store (write_shard + commit_checkpoint; read_shard, which verifies checksums) and
   through torch.save / torch.load(weights_only=True), in the same temporary directory, 3 times each,
   alternating; median MB/s (10^6 bytes of state tensors per second). Neither side fsyncs (zarr's local
   store does not, nor does torch.save), and reads come right after writes, so mostly from the page cache.

Run from the repository root; the full run takes a few minutes, --quick (50 steps at batch 4, no GPT-2
small) under a minute:

    .venv/bin/python benchmarks/bench_record.py [--quick] [--dir DIR]
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from replay.config import build_config
from replay.launch.ranks import prepare_new
from replay.recorder.environment import configure_determinism
from replay.recorder.recorder import Recorder, RecorderConfig
from replay.store import RunStore
from replay.train.data import DataOrder
from replay.train.model import build_model, lr_factor
from replay.train.state import TorchTrainState
from replay.train.trainer import Rank, _torch_step, load_data

SMALL = ["model.n_layer=4", "model.n_head=4", "model.n_embd=128", "model.block_size=128"]
LARGE = ["model.n_layer=12", "model.n_head=12", "model.n_embd=768", "model.block_size=1024",
         "model.vocab_size=50304"]  # GPT-2 small
CHECKPOINT_EVERY, SNAPSHOT_EVERY = 50, 10
MB = 1e6


def hardware() -> str:
    cpu = platform.processor() or "unknown CPU"
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return f"hardware: {cpu}, {os.cpu_count()} cores; torch {torch.__version__}"


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# -- 1. recording overhead ---------------------------------------------------------------------------------

def bench_overhead(workdir: Path, timed_steps: int, batch: int, warmup: int = 10) -> None:
    steps = warmup + timed_steps + 1   # the run goes on past the timed window: its final checkpoint is not in it
    cfg = build_config("tiny", None, [*SMALL, f"batch_size={batch}", f"micro_batch_size={batch}", f"steps={steps}",
                                      f"checkpoint_every={CHECKPOINT_EVERY}", f"snapshot_every={SNAPSHOT_EVERY}"])
    store = prepare_new(str(workdir / "run"), cfg, world_size=1, local_world=1)
    data = load_data(cfg, store)
    r = Rank(rank=0, world=1, local_rank=0, device=torch.device("cpu"))
    order = DataOrder(data.n_samples, cfg.batch_size, cfg.seed)

    def make_step():   # as the trainer's _train wires them
        model = build_model(cfg.model, data.vocab_size, cfg.seed)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, functools.partial(lr_factor, cfg=cfg.optim, total_steps=cfg.steps))
        return functools.partial(_torch_step, model, opt, sched, cfg, data, r), TorchTrainState(model, opt, sched)

    plain_step, _ = make_step()
    rec_step, state = make_step()
    recorder = Recorder(str(store.path), state, cfg=RecorderConfig(
        total_steps=cfg.steps, checkpoint_every=CHECKPOINT_EVERY, snapshot_every=SNAPSHOT_EVERY,
        snapshot_ring=cfg.snapshot_ring, spike=cfg.spike))
    recorder.start()   # writes checkpoint 0 during the warm-up

    def step(s: int, recorded: bool) -> tuple[float, float]:
        """Seconds for training step s (and recording it), then seconds waiting for the background writer
        to finish, so that a checkpoint's write cannot slow the plain step that follows."""
        ids = order.rank_ids(s, 0, 1, cfg.micro_batch_size)
        t0 = time.perf_counter()
        if recorded:
            loss, grad_norm, lr = rec_step(ids)
            recorder.record_step(s, sample_ids=ids, loss=loss, grad_norm=grad_norm, lr=lr,
                                 tokens=ids.size * cfg.model.block_size)
        else:
            plain_step(ids)
        t1 = time.perf_counter()
        recorder.writer.flush()
        return t1 - t0, time.perf_counter() - t1

    for s in range(warmup):
        for recorded in (False, True):
            step(s, recorded)
    times: dict[bool, list[float]] = {False: [], True: []}
    waited = 0.0
    for s in range(warmup, warmup + timed_steps):
        for recorded in ((False, True) if s % 2 == 0 else (True, False)):   # A B, B A, ...: drift cancels
            t, w = step(s, recorded)
            times[recorded].append(t)
            waited += w
    t0 = time.perf_counter()
    recorder.close()
    close_s = time.perf_counter() - t0

    # Every 10 steps hold one in-memory copy (a snapshot or a checkpoint: the same copy on this thread), so
    # medians of 10-step means keep its cost while shrugging off steps hit by other load on the machine.
    windows = {k: [statistics.fmean(v[i:i + SNAPSHOT_EVERY]) for i in range(0, len(v), SNAPSHOT_EVERY)]
               for k, v in times.items()}
    plain, rec = statistics.median(windows[False]), statistics.median(windows[True])
    writing = waited / timed_steps
    print(f"recording overhead: {100 * (rec / plain - 1):.1f}% (median step {1e3 * rec:.1f} ms recorded vs "
          f"{1e3 * plain:.1f} ms plain; checkpoint every {CHECKPOINT_EVERY}, snapshot every {SNAPSHOT_EVERY}; "
          f"target <= 3%)", flush=True)
    print(f"recording overhead if the background writer's work ran on the training thread: "
          f"{100 * ((rec + writing) / plain - 1):.1f}% (+{1e3 * writing:.1f} ms per step: "
          f"{1e3 * waited:.0f} ms writing {timed_steps // CHECKPOINT_EVERY} checkpoints and the step log; "
          f"the final Recorder.close() {1e3 * close_s:.0f} ms, not counted)", flush=True)
    print(f"  ({timed_steps} steps per variant, alternating step by step after {warmup} warm-up steps; "
          f"{n_params(state.model) / 1e6:.2f}M params, {cfg.model.n_layer} layers x {cfg.model.n_embd}, "
          f"seq {cfg.model.block_size}, batch {cfg.batch_size})", flush=True)


# -- 2. checkpoint throughput ------------------------------------------------------------------------------

def trained_state(sets: list[str]) -> tuple[dict, int]:
    """{"model", "optimizer"} state after one AdamW step (random gradients), and the parameter count."""
    cfg = build_config("tiny", None, sets)
    model = build_model(cfg.model, cfg.model.vocab_size or 256, cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}, n_params(model)


def tree_bytes(tree) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.nbytes
    if isinstance(tree, dict):
        return sum(tree_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tree_bytes(v) for v in tree)
    return 0


def disk_bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_throughput(workdir: Path, sets: list[str], label: str, repeats: int = 3) -> None:
    tree, params = trained_state(sets)
    nbytes = tree_bytes(tree)
    store = RunStore.create(workdir / f"store-{label}", {})
    torch_file = workdir / f"torch-{label}.pt"
    secs = {name: [] for name in ("store write", "store read", "torch write", "torch read")}
    on_disk = {}

    def store_round(step: int) -> None:
        secs["store write"].append(timed(lambda: (store.write_shard(step, 0, tree),
                                                  store.commit_checkpoint(step, "regular", 1))))
        secs["store read"].append(timed(lambda: store.read_shard(step, 0)))
        shard = store.path / "checkpoints" / f"{step:08d}"
        on_disk["store"] = disk_bytes(shard)
        shutil.rmtree(shard)

    def torch_round(_step: int) -> None:
        secs["torch write"].append(timed(lambda: torch.save(tree, torch_file)))
        secs["torch read"].append(timed(lambda: torch.load(torch_file, weights_only=True)))
        on_disk["torch"] = disk_bytes(torch_file)
        torch_file.unlink()

    for rep in range(repeats):   # alternate which goes first
        for fn in ((store_round, torch_round) if rep % 2 == 0 else (torch_round, store_round)):
            fn(rep + 1)

    rate = {name: nbytes / MB / statistics.median(s) for name, s in secs.items()}
    size = f"{params / 1e6:.0f}M params" if params >= 10e6 else f"{params / 1e6:.1f}M params"
    for op, torch_op in (("write", "torch.save"), ("read", "torch.load")):
        print(f"checkpoint {op}, {size}: store {rate[f'store {op}']:.0f} MB/s vs {torch_op} "
              f"{rate[f'torch {op}']:.0f} MB/s ({rate[f'store {op}'] / rate[f'torch {op}']:.2f}x)", flush=True)
    print(f"  ({label}: state {nbytes / MB:.0f} MB of tensors; on disk store {on_disk['store'] / MB:.0f} MB, "
          f"torch {on_disk['torch'] / MB:.0f} MB; median of {repeats}; no fsync on either side)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="50 steps at batch 4, only the small model (< 60 s)")
    ap.add_argument("--dir", default=None, help="where the store and torch files go (default: system temp)")
    args = ap.parse_args()

    configure_determinism(os.cpu_count())
    print(hardware(), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-record-", dir=args.dir) as tmp:
        workdir = Path(tmp)
        bench_overhead(workdir, timed_steps=50 if args.quick else 300, batch=4 if args.quick else 16)
        bench_throughput(workdir, SMALL, "4 layers x 128")
        if not args.quick:
            bench_throughput(workdir, LARGE, "GPT-2 small: 12 layers x 768, seq 1024, vocab 50304")


if __name__ == "__main__":
    main()
