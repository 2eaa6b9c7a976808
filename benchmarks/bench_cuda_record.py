"""A CUDA recording replayed bit for bit: GPT-2 small on one GPU, BF16 autocast, a local token file.

For each attention (eager, sdpa, triton-fa2 by default): `replay record` of GPT-2 small (12 layers x 768,
12 heads, seq 1024, vocab 50304; batch 16 = 2 micro-batches of 8) for --steps steps on a token file written
from the built-in corpus (uint16 tokens), a checkpoint every --checkpoint-every steps; then
`replay run --from S/2 --to S-1 --verify` from the middle checkpoint. Prints, per attention: the median
recorded step time, the record's and the replay's wall time, and whether every replayed step equals the
record bit for bit; then which attention kernels one training step of the `sdpa` model launches on the GPU
(PyTorch's profiler), since SDPA picks its backend itself.

    python benchmarks/bench_cuda_record.py [--steps 300] [--checkpoint-every 100] [--attention eager,sdpa] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from replay.lifeline import follow_parent
from replay.store import RunStore
from replay.train.data import builtin_corpus

GPT2_SMALL = ["model.n_layer=12", "model.n_head=12", "model.n_embd=768", "model.block_size=1024",
              "model.vocab_size=50304", "batch_size=16", "micro_batch_size=8", "device=cuda"]


def replay(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "replay", *map(str, args)], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if result.returncode:
        print(result.stderr[-3000:], flush=True)
    return result, seconds


def record_and_replay(workdir: Path, tokens: Path, attention: str, steps: int, every: int) -> tuple[bool, str]:
    """(whether it recorded and replayed bit for bit, the line to print)."""
    store = workdir / attention.replace(":", "_")
    sets = [a for s in GPT2_SMALL for a in ("--set", s)]
    recorded, record_s = replay("record", "--store", store, "--data", tokens, "--steps", steps, "--checkpoint-every",
                                every, "--precision", "bf16", "--attention", attention, "--set", "log_every=50", *sets)
    if recorded.returncode:
        return False, f"{attention}: record failed (exit {recorded.returncode})"
    step_s = statistics.median(RunStore.open(store).read_steps(["step_time"])["step_time"].tolist())
    start = (steps // 2) // every * every
    replayed, replay_s = replay("run", store, "--from", start, "--to", steps - 1, "--verify")
    bitwise = replayed.returncode == 0 and "bit for bit" in replayed.stdout
    verdict = "bit for bit" if bitwise else f"NOT bitwise: {replayed.stdout.strip()[-300:]}"
    return bitwise, (f"{attention:>12}: median step {1e3 * step_s:6.1f} ms recorded; record {record_s:5.1f} s "
                     f"({steps} steps), replay of steps {start}..{steps - 1} {replay_s:5.1f} s: {verdict}")


def sdpa_kernels() -> list[str]:
    """The GPU kernels an `sdpa` GPT-2 small launches for attention in one BF16 training step, as recorded."""
    from torch.profiler import ProfilerActivity, profile

    from replay.config import build_config
    from replay.recorder.environment import configure_determinism
    from replay.train.model import build_model, lm_loss

    configure_determinism(1)
    cfg = build_config("tiny", None, [*GPT2_SMALL, "model.attention=sdpa"])
    model = build_model(cfg.model, 50304, 0).cuda()
    x = torch.randint(0, 50304, (8, 1024), device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.autocast("cuda", torch.bfloat16):
            loss = lm_loss(model, x, x)
        loss.backward()
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    return sorted(n for n in names if any(w in n.lower() for w in ("flash", "fmha", "attention", "cudnn", "sdpa")))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--attention", default="sdpa,triton-fa2,eager", help="comma-separated attention plans")
    parser.add_argument("--quick", action="store_true", help="20 steps of sdpa only")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.checkpoint_every, args.attention = 20, 10, "sdpa"
    if not torch.cuda.is_available():
        print("skipped: no CUDA device on this machine (this benchmark records on the GPU)")
        return 0
    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-cuda-record-") as tmp:
        workdir = Path(tmp)
        tokens = workdir / "train.bin"
        builtin_corpus(1 << 23).astype(np.uint16).tofile(tokens)
        failed = []
        for attention in args.attention.split(","):
            print(f"recording with {attention} ...", flush=True)
            ok, line = record_and_replay(workdir, tokens, attention, args.steps, args.checkpoint_every)
            print(line, flush=True)
            failed += [] if ok else [attention]
    print("attention kernels of one sdpa training step: " + "; ".join(sdpa_kernels()), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    follow_parent()   # started by the test suite: end with it
    sys.exit(main())
