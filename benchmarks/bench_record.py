"""Benchmark the recorder: what recording costs a training step, and how fast the store moves checkpoints.

1. Recording overhead. Two identical GPT-2 models (same seed, same data order; 4 layers x 128, seq 128,
   batch 2 in quick mode: a step of about 20 ms on 2 idle cores) train side by side in one process, one plain
   and one through a `Loop` (sample_ids, log, the state digests: what a user's script runs), in blocks of 10
   steps, alternating A B, B A, ... Each pair of neighbouring blocks gives a ratio; the median of the ratios
   is the overhead, for the wall clock, the training thread's CPU time and the process's CPU time (every
   thread: the digests' and the store's background work included). On a machine other work keeps busy the
   wall clock moves by more than the effect; the CPU times do not. First with no checkpoint or snapshot in
   the timed steps (target <= 1%), then with a checkpoint every 50 steps and a snapshot every 10.
2. Checkpoint throughput. The state {"model": ..., "optimizer": ...} after one AdamW step, written and read
   through the run store (write_shard + commit_checkpoint; read_shard, which verifies every chunk's
   CRC-32C and every JSON checksum), through torch.save / torch.load(weights_only=True; and with
   mmap=True) and through
   torch.distributed.checkpoint (dcp.save / dcp.load into preallocated tensors, one process), in one
   temporary directory, rounds alternating the order; median seconds per operation and their ratio.
   The page cache's dirty data is flushed (os.sync) before every timed operation, untimed, so that no
   operation pays for another's writeback. Two lines per size: without fsync (the store with
   durable=False; torch.save as is), and with it (the store's default: chunks, JSON and commit on disk
   before the commit; torch.save followed by an fsync). Reads follow writes, mostly from the page cache.
   The store's read maps the chunk files (copy-on-write) rather than copying them, as torch.load does
   with mmap=True, and reads every byte once to verify its checksum; torch.load(mmap=True) returns
   before reading anything, so it is also timed followed by one read of every byte (a CRC-32C, as the
   store's). A plain torch.load copies into new memory, freed back to the system (malloc_trim) before
   every operation, as a fresh process would start.
3. The training thread's share of a checkpoint: the recorder copies the state into one buffer and
   writes it in the background; the copy is what training waits for. Timed cold (a new buffer) and
   warm (a buffer of an earlier checkpoint, which the recorder reuses), against torch.save, which
   blocks for its whole write.
4. The state digest every rank takes after each update (recorder/digest.py), at GPT-2 small (SMALL with
   --quick), against a training step of one micro-batch of 8 sequences (the gpt2-small preset's; its step is
   4 of them), alternating.
5. The design's choices, measured: CRC-32 (zlib) against CRC-32C (google-crc32c, the one Zarr's crc32c
   codec uses, and store/_crc32c.c's implementations, the state digest's), and the chunk size and number of
   writer threads of a checkpoint's write.

Run from the repository root; the full run takes about ten minutes, --quick (no GPT-2 small, a few blocks:
it keeps the script working, its numbers are noise) seconds:

    .venv/bin/python benchmarks/bench_record.py [--quick] [--dir DIR] [--threads N]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import platform
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from replay.config import RunConfig, build_config
from replay.lifeline import follow_parent
from replay.recorder import create_run_store
from replay.recorder.digest import StateDigest, _device_sums, _sum_digests
from replay.recorder.environment import configure_determinism
from replay.recorder.state import TorchTrainState
from replay.store.integrity import crc32c
from replay.store.tensors import pack
from replay.train.data import DataOrder, builtin_corpus, make_data
from replay.train.model import build_model, lm_loss, lr_factor

_LIBC = ctypes.CDLL(None)
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

def bench_overhead(workdir: Path, blocks: int, batch: int, sets: list[str] = SMALL, device: str = "cpu",
                   checkpoint_every: int = 0, snapshot_every: int = 0, block: int = 10, warmup: int = 10) -> None:
    """Two identical GPT-2 models (same seed, same data order) train side by side, one plain and one through a
    `Loop` (sample_ids, log, the checkpoint cadence: what a user's script runs), in blocks of `block` steps,
    alternating A B, B A, ... after `warmup` steps each. Each pair of neighbouring blocks gives a ratio of their
    mean step times; the median of those ratios is the overhead (machine noise hits both blocks of a pair alike,
    and a block slowed by other load moves one ratio, not the median). The background threads' work (the
    digests, the store's writes) is in the timed steps: nothing is drained untimed. `checkpoint_every=0`: no
    checkpoint or snapshot in the timed steps (the run's first and last are outside them)."""
    from replay.recorder import Loop

    steps = warmup + blocks * block
    cfg = build_config("tiny", None, [*sets, f"batch_size={batch}", f"micro_batch_size={batch}", f"steps={steps}",
                                      f"precision={'bf16' if device == 'cuda' else 'fp32'}"])
    data = make_data(cfg, builtin_corpus(cfg.data.corpus_bytes))
    order = DataOrder(data.n_samples, cfg.batch_size, cfg.seed)

    def make_step():   # a training loop of the user's own
        model = build_model(cfg.model, data.vocab_size, cfg.seed).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, functools.partial(lr_factor, cfg=cfg.optim, total_steps=cfg.steps))

        def train_step(ids) -> tuple[float, float, float]:
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device, torch.bfloat16, enabled=cfg.precision == "bf16"):
                loss = lm_loss(model, *(t.to(device) for t in data.batch(ids)))
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            lr = sched.get_last_lr()[0]
            opt.step()
            sched.step()
            return loss.item(), norm.item(), lr

        return train_step, model, opt, sched

    plain_step, *_ = make_step()
    rec_step, model, opt, sched = make_step()
    every = checkpoint_every or steps + 1
    loop = Loop(str(workdir / f"run-{checkpoint_every}"), model, opt, scheduler=sched, total_steps=steps,
                checkpoint_every=every, snapshot_every=snapshot_every)
    steps_of = loop.steps()
    record_cpu: list[float] = []   # the training thread's CPU in the Loop's own calls, step by step

    def step(s: int, recorded: bool) -> tuple[float, float, float]:
        """Seconds of step s: wall clock, the training thread's CPU, and the process's CPU (every thread)."""
        ids = order.rank_ids(s, 0, 1, cfg.micro_batch_size)
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        if recorded:
            r0 = time.thread_time()   # the loop's next step ends the last one: its step-log flush, checkpoints
            assert next(steps_of) == s, "the loop yields the steps in order"
            tapped = loop.sample_ids(ids)
            r1 = time.thread_time()
            loss, grad_norm, lr = rec_step(tapped)
            r2 = time.thread_time()
            loop.log(loss, grad_norm, lr, tokens=ids.size * cfg.model.block_size)
            record_cpu.append(r1 - r0 + time.thread_time() - r2)
        else:
            plain_step(ids)
        return time.perf_counter() - t0, time.thread_time() - c0, time.process_time() - p0

    for s in range(warmup):
        step(s, False)
        step(s, True)
    record_cpu.clear()
    means: dict[bool, list[np.ndarray]] = {False: [], True: []}
    for b in range(blocks):
        first = warmup + b * block
        for recorded in ((False, True) if b % 2 == 0 else (True, False)):   # A B, B A, ...: drift cancels
            means[recorded].append(np.mean([step(s, recorded) for s in range(first, first + block)], axis=0))
    assert next(steps_of, None) is None, "the loop ends after its last step"
    loop.close()

    rec_blocks, plain_blocks = np.array(means[True]), np.array(means[False])
    ratios = np.sort(rec_blocks / plain_blocks, axis=0)   # (block pair, wall | thread CPU | process CPU)
    median, low, high = (np.quantile(ratios, q, axis=0) for q in (0.5, 0.25, 0.75))
    plain, rec = np.median(plain_blocks, axis=0), np.median(rec_blocks, axis=0)
    cadence = (f"checkpoint every {checkpoint_every}, snapshot every {snapshot_every}" if checkpoint_every
               else "no checkpoint or snapshot in the timed steps")
    print(f"recording overhead ({cadence}), recorded / plain - 1, median of {blocks} paired blocks of {block} "
          f"steps [quartiles]; target <= 1% without checkpoints, 3% with:", flush=True)
    for i, what in enumerate(("wall clock", "training thread's CPU", "process's CPU, every thread")):
        print(f"  {what}: {100 * (median[i] - 1):+.2f}% [{100 * (low[i] - 1):+.2f}% .. {100 * (high[i] - 1):+.2f}%]; "
              f"median step {1e3 * rec[i]:.2f} ms recorded vs {1e3 * plain[i]:.2f} ms plain", flush=True)
    own = np.quantile(record_cpu, [0.25, 0.5, 0.75]) * 1e6
    share = 100 * own[1] / 1e6 / plain[1]
    print(f"  the Loop's own calls (its next step, sample_ids, log), timed alone: {own[1]:.0f} us of the training "
          f"thread a step [{own[0]:.0f} .. {own[2]:.0f}], {share:.2f}% of the plain step's CPU", flush=True)
    print(f"  ({n_params(model) / 1e6:.2f}M params, {cfg.model.n_layer} layers x {cfg.model.n_embd}, seq "
          f"{cfg.model.block_size}, batch {cfg.batch_size}, {cfg.precision} on {device}, "
          f"{torch.get_num_threads()} thread(s); recorded through Loop: sample_ids, log, the state digests)",
          flush=True)


# -- the state digest of every step -------------------------------------------------------------------------

def bench_digest(sets: list[str], micro: int, steps: int, device: str = "cpu") -> None:
    """The digest every rank takes of its model and optimizer state after each update (recorder/digest.py),
    against a training step of one micro-batch of `micro` sequences: forward, backward, clipping and AdamW,
    alternating with the digest step by step. On a GPU the digest's reductions run on the device."""
    cfg = build_config("tiny", None, [*sets, f"batch_size={micro}", f"micro_batch_size={micro}"])
    data = make_data(cfg, builtin_corpus(max(cfg.data.corpus_bytes, 2 * micro * (cfg.model.block_size + 1))))
    order = DataOrder(data.n_samples, cfg.batch_size, cfg.seed)
    model = build_model(cfg.model, data.vocab_size, cfg.seed).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    digest = StateDigest(TorchTrainState(model, opt), rank=0)
    train, taken, one_by_one = [], [], []
    for s in range(steps + 1):   # the first step makes AdamW's state: untimed
        ids = order.rank_ids(s, 0, 1, micro)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, torch.bfloat16, enabled=device == "cuda"):
            loss = lm_loss(model, *(t.to(device) for t in data.batch(ids)))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        digest()
        t2 = time.perf_counter()
        if device == "cuda":   # side by side: the sums tensor by tensor, as before the one launch per word width
            _sum_digests(_device_sums([t for _, t in TorchTrainState(model, opt).named_tensors() if t.is_cuda]))
            one_by_one.append(time.perf_counter() - t2)
        if s:
            train.append(t1 - t0)
            taken.append(t2 - t1)
    step_s, digest_s = statistics.median(train), statistics.median(taken)
    if device == "cuda":
        from replay.kernels.word_sums import WordSums

        tensors = [t for _, t in TorchTrainState(model, opt).named_tensors() if t.is_cuda]
        same = _sum_digests(WordSums(tensors)()) == _sum_digests(_device_sums(tensors))
        print(f"state digest on the GPU: {1e3 * digest_s:.2f} ms in one launch per word width vs "
              f"{1e3 * statistics.median(one_by_one[1:]):.2f} ms tensor by tensor "
              f"({statistics.median(one_by_one[1:]) / digest_s:.1f}x); the same digests: {same}", flush=True)
    state = sum(t.nbytes for _, t in TorchTrainState(model, opt).named_tensors())
    print(f"state digest per step: {1e3 * digest_s:.1f} ms for {len(digest.names or []) - 1} tensors "
          f"({state / MB:.0f} MB: {n_params(model) / 1e6:.0f}M params + AdamW state, {digest.kind}; "
          f"{state / MB / digest_s:.0f} MB/s), {100 * digest_s / step_s:.2f}% of a step of one micro-batch of "
          f"{micro} x {cfg.model.block_size} tokens ({step_s:.2f} s, {cfg.precision if device == 'cpu' else 'bf16'} "
          f"on {device}; median of {steps}; target <= 1%)", flush=True)


# -- 2. checkpoint throughput ------------------------------------------------------------------------------

def trained_state(sets: list[str], device: str = "cpu") -> tuple[dict, int]:
    """{"model", "optimizer"} state after one AdamW step (random gradients), and the parameter count."""
    cfg = build_config("tiny", None, sets)
    model = build_model(cfg.model, cfg.model.vocab_size or 256, cfg.seed).to(device)
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


def bench_throughput(workdir: Path, sets: list[str], label: str, repeats: int) -> None:
    import torch.distributed.checkpoint as dcp

    tree, params = trained_state(sets)
    nbytes = tree_bytes(tree)
    store = create_run_store(str(workdir / f"store-{label[:8]}"), RunConfig())
    files = {name: workdir / f"{name}-{label[:8]}" for name in ("torch", "torch-fsync", "dcp")}
    secs: dict[str, list[float]] = {}

    def timed(name: str, fn) -> None:
        os.sync()
        _LIBC.malloc_trim(0)   # no operation reuses memory the allocator kept from another's
        t0 = time.perf_counter()
        fn()
        secs.setdefault(name, []).append(time.perf_counter() - t0)

    def store_write(step: int, durable: bool) -> None:
        store.durable = durable
        store.write_shard(step, 0, tree)
        store.commit_checkpoint(step, "regular", 1)

    def torch_save_fsync() -> None:
        with open(files["torch-fsync"], "wb") as f:
            torch.save(tree, f)
            f.flush()
            os.fsync(f.fileno())

    def store_round(rep: int) -> None:
        timed("store write", lambda: store_write(2 * rep + 1, durable=False))
        timed("store write, fsync", lambda: store_write(2 * rep + 2, durable=True))
        timed("store read", lambda: store.read_shard(2 * rep + 1, 0))
        for step in (2 * rep + 1, 2 * rep + 2):
            shutil.rmtree(store.location.local / "checkpoints" / f"{step:08d}")

    def torch_round(_rep: int) -> None:
        timed("torch.save", lambda: torch.save(tree, files["torch"]))
        timed("torch.save, fsync", torch_save_fsync)
        timed("torch.load", lambda: torch.load(files["torch"], weights_only=True))
        timed("torch.load(mmap=True)", lambda: torch.load(files["torch"], weights_only=True, mmap=True))
        timed("torch.load(mmap=True) + read", lambda: _read_every_byte(
            torch.load(files["torch"], weights_only=True, mmap=True)))
        for name in ("torch", "torch-fsync"):
            files[name].unlink()

    def dcp_round(_rep: int) -> None:
        empty = _like(tree)   # dcp.load fills tensors it is given
        timed("DCP save", lambda: dcp.save({"state": tree}, checkpoint_id=files["dcp"]))
        timed("DCP load", lambda: dcp.load({"state": empty}, checkpoint_id=files["dcp"]))
        shutil.rmtree(files["dcp"])

    rounds = [store_round, torch_round, dcp_round]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # DCP warns that no process group is initialised: one process
        for rep in range(repeats):
            for fn in rounds[rep % 3:] + rounds[:rep % 3]:
                fn(rep)

    med = {name: statistics.median(s) for name, s in secs.items()}
    size = f"{params / 1e6:.0f}M params" if params >= 10e6 else f"{params / 1e6:.1f}M params"
    print(f"checkpoint of {size} ({label}: {nbytes / MB:.0f} MB of tensors), median of {repeats} rounds:", flush=True)
    for op, ours, others in (("write", "store write", ("torch.save", "DCP save")),
                             ("write with fsync", "store write, fsync", ("torch.save, fsync",)),
                             ("read", "store read", ("torch.load", "torch.load(mmap=True)",
                                                     "torch.load(mmap=True) + read", "DCP load"))):
        vs = "; ".join(f"{o} {med[o]:.3f} s (the store at {med[o] / med[ours]:.2f}x its speed)" for o in others)
        print(f"  {op}: store {med[ours]:.3f} s ({nbytes / MB / med[ours]:.0f} MB/s) vs {vs}", flush=True)


def _read_every_byte(tree) -> None:
    """What the store's read does to verify a checkpoint, and any use of the state does anyway: a mapped
    file that is never read costs nothing to 'load'."""
    if isinstance(tree, torch.Tensor):
        crc32c(tree.detach().reshape(-1).view(torch.uint8).numpy())
    elif isinstance(tree, dict):
        for v in tree.values():
            _read_every_byte(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            _read_every_byte(v)


def _like(tree):
    if isinstance(tree, torch.Tensor):
        return torch.empty_like(tree)
    if isinstance(tree, dict):
        return {k: _like(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_like(v) for v in tree)
    return tree


def bench_blocking(sets: list[str], repeats: int, device: str = "cpu") -> None:
    """What the training thread waits for per checkpoint: the copy into the recorder's buffer (from the
    GPU's memory, for a state on the GPU)."""
    tree, params = trained_state(sets, device)
    t0 = time.perf_counter()
    spare = pack(tree).buffer
    cold = time.perf_counter() - t0
    warm = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        pack(tree, into=spare)
        warm.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as tmp:
        save = []
        for _ in range(repeats):
            os.sync()
            t0 = time.perf_counter()
            torch.save(tree, Path(tmp) / "t.pt")
            save.append(time.perf_counter() - t0)
    print(f"training thread blocked per checkpoint ({params / 1e6:.0f}M params + AdamW state): "
          f"{statistics.median(warm):.3f} s (the copy into a reused buffer; {cold:.3f} s for the first, into a "
          f"new one) vs {statistics.median(save):.3f} s for torch.save, which blocks for its whole write", flush=True)
    if device == "cuda":   # the recorder's buffers for GPU state are page-locked: against pageable memory
        pageable = np.empty(len(spare), dtype=np.uint8)
        pageable[::4096] = 0   # its pages mapped, as a reused buffer's are
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            pack(tree, into=pageable)
            times.append(time.perf_counter() - t0)
        print(f"  the same copy into a pageable buffer: {statistics.median(times):.3f} s "
              f"({len(spare) / MB / statistics.median(times):.0f} MB/s; the recorder's page-locked one "
              f"{len(spare) / MB / statistics.median(warm):.0f} MB/s)", flush=True)


def bench_choices(workdir: Path, sets: list[str], repeats: int = 3) -> None:
    """The measurements behind the store's design: checksum speed, and chunk size x writer threads."""
    import zlib

    from replay.store import _crc32c, chunks
    from replay.store.tensors import layout

    tree, params = trained_state(sets)
    buffer = pack(tree).buffer
    checksums = [("zlib CRC-32", zlib.crc32), ("CRC-32C (google-crc32c)", crc32c)]
    checksums += [(f"CRC-32C (store/_crc32c.c, {path})", functools.partial(_crc32c.value, path=path))
                  for path in _crc32c.paths]   # the state digest's, each implementation this CPU has
    for name, fn in checksums:
        t = min(_seconds(functools.partial(fn, buffer)) for _ in range(repeats))
        print(f"  checksum {name}: {len(buffer) / MB / t:.0f} MB/s", flush=True)
    lay = layout(tree)
    segments = lay.segments()
    for chunk_mb in (4, 16, 64):
        for threads in (1, 2, 4):
            chunks.CHUNK_BYTES, chunks.THREADS = chunk_mb << 20, threads
            n, chunk = chunks.chunking(lay.size)
            out = workdir / f"choice-{chunk_mb}-{threads}"
            times = []
            for _ in range(repeats):
                os.sync()
                times.append(_seconds(functools.partial(chunks.write_chunks, out, segments, n, chunk)))
                shutil.rmtree(out)
            print(f"  chunks of {chunk_mb} MiB, {threads} writer thread(s): {statistics.median(times):.3f} s "
                  f"({lay.size / MB / statistics.median(times):.0f} MB/s)", flush=True)
    chunks.CHUNK_BYTES, chunks.THREADS = 16 << 20, 2


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def warm_memory(fraction: float = 0.6) -> None:
    """Touch most of the free memory once. On a fresh VM the first touch of each guest page costs far more
    than any later one (measured here: 2-4 s per 1.6 GB the first time, 0.16 s after), and which operation
    of a benchmark happens to draw untouched pages would otherwise decide its result."""
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    block = 256 << 20
    held = []
    for _ in range(int(available * fraction) // block):
        a = np.empty(block, dtype=np.uint8)
        a[::4096] = 1
        held.append(a)
    del held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="20 steps at batch 2, only the small model (seconds; the "
                                                          "suite runs it to keep the benchmark working)")
    ap.add_argument("--dir", default=None, help="where the store and torch files go (default: system temp)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: only the GPU measurements: the overhead on GPT-2 small in BF16 on the GPU, and the "
                         "training thread's share of a checkpoint of a state in GPU memory")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="torch's threads (default: one per core; 1 on a machine other work keeps busy)")
    args = ap.parse_args()

    configure_determinism(args.threads)
    print(hardware(), flush=True)
    if not args.quick:
        warm_memory()
    with tempfile.TemporaryDirectory(prefix="bench-record-", dir=args.dir) as tmp:
        workdir = Path(tmp)
        if args.device == "cuda":
            print(f"GPU: {torch.cuda.get_device_name()}", flush=True)
            bench_overhead(workdir, blocks=4 if args.quick else 10, batch=8, sets=LARGE, device="cuda")
            bench_digest(LARGE, micro=8, steps=10, device="cuda")
            bench_blocking(LARGE, repeats=5, device="cuda")
            return
        bench_overhead(workdir, blocks=4 if args.quick else 48, batch=2)   # a step of about 20 ms
        bench_overhead(workdir, blocks=2 if args.quick else 30, batch=2 if args.quick else 16,
                       checkpoint_every=CHECKPOINT_EVERY, snapshot_every=SNAPSHOT_EVERY)
        bench_digest(SMALL if args.quick else LARGE, micro=2 if args.quick else 8, steps=3)
        bench_throughput(workdir, SMALL, "4 layers x 128", repeats=2 if args.quick else 5)
        if not args.quick:
            bench_throughput(workdir, LARGE, "GPT-2 small: 12 layers x 768, seq 1024, vocab 50304", repeats=5)
            bench_blocking(LARGE, repeats=5)
            print("design choices (GPT-2 small state, no fsync, median of 3):", flush=True)
            bench_choices(workdir, LARGE)


if __name__ == "__main__":
    follow_parent()   # started by the test suite: end with it
    main()
