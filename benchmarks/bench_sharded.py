"""Benchmark a checkpoint of an FSDP2 model (fully_shard) on 2 gloo ranks: each rank's peak memory while the
recorder captures and writes its checkpoint, against the size of that rank's shard (its pieces of the
parameters and of AdamW's state), and against gathering the whole state to rank 0 first (DCP's
`get_state_dict(full_state_dict=True, cpu_offload=True)`, what a single-file save of a sharded model needs).

The model: a stack of square Linear layers, each fully_shard'ed, built on the meta device and materialised
shard by shard (no rank ever holds it whole), one optimizer step taken so that AdamW's state exists. The
peak: the kernel's high-water mark of the process's resident memory (VmHWM), reset just before
(/proc/self/clear_refs), less the resident memory then. The first checkpoint copies into new memory; the
next reuses the buffer a finished write gave back. Memory the process freed but still holds is reused
without raising the mark, so a peak is a lower bound; the bytes a gathered state holds are given too.

    .venv/bin/python benchmarks/bench_sharded.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

MB = 1 << 20


def hardware() -> str:
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.processor())
    return f"hardware: {cpu}, {os.cpu_count()} cores"


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    return kb * 1024


def _peak_above_now(work) -> int:
    """Bytes of resident memory `work()` needed above what the process held when it began."""
    Path("/proc/self/clear_refs").write_text("5")   # resets VmHWM to the current resident set
    before = _status("VmRSS")
    work()
    return _status("VmHWM") - before


def worker(out: Path, width: int, layers: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.fsdp import fully_shard

    from replay.config import RunConfig
    from replay.recorder import Recorder, RecorderConfig, create_run_store
    from replay.recorder.fsdp import FSDP2TrainState

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.device("meta"):
        model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for layer in model:
        layer.reset_parameters()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    path = str(out / "run")
    if rank == 0:
        create_run_store(path, RunConfig(steps=4), world_size=world)
    dist.barrier()
    state = FSDP2TrainState(model, optimizer)
    shard = sum(t.numel() * t.element_size() for t in _tensors(state.state_dict(rank)))
    recorder = Recorder(path, state, cfg=RecorderConfig(total_steps=4, checkpoint_every=1), rank=rank,
                        world_size=world)

    def checkpoint(step: int):
        def work() -> None:
            recorder._checkpoint(step, "regular")
            recorder.writer.flush()
        return work

    first = _peak_above_now(checkpoint(1))
    again = _peak_above_now(checkpoint(2))
    dist.barrier()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    held: list = []
    gathered = _peak_above_now(lambda: held.append(get_state_dict(model, optimizer, options=options)))
    whole = sum(t.numel() * t.element_size() for t in _tensors(held[0]))
    held.clear()
    recorder.close()
    (out / f"rank{rank}.json").write_text(json.dumps({"shard": shard, "first": first, "again": again,
                                                      "gathered": gathered, "whole": whole}))
    dist.destroy_process_group()


def _tensors(tree):
    import torch

    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 4 MB model instead of a 226 MB one")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    width, layers = (256, 16) if args.quick else (1536, 24)
    if args.worker:
        worker(Path(args.worker), width, layers)
        return
    print(hardware())
    params = layers * (width * width + width)
    print(f"model: {layers} x Linear({width}, {width}), {params * 4 / MB:.0f} MB of fp32 parameters "
          f"({3 * params * 4 / MB:.0f} MB with AdamW's state), fully_shard'ed over 2 gloo ranks")
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               __file__, "--worker", tmp] + (["--quick"] if args.quick else []),
                              env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(done.stderr[-3000:])
        rows = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(2)]
    print("| rank | shard (params + AdamW state) | peak, first checkpoint | peak, next checkpoint | "
          "gathering the whole state (DCP full_state_dict): what it holds; its peak |")
    print("|---|---|---|---|---|")
    for rank, r in enumerate(rows):
        s = r["shard"]
        print(f"| {rank} | {s / MB:.1f} MB | {r['first'] / MB:.1f} MB, {r['first'] / s:.2f}x | "
              f"{r['again'] / MB:.1f} MB, {r['again'] / s:.2f}x | {r['whole'] / MB:.1f} MB, {r['whole'] / s:.2f}x; "
              f"{r['gathered'] / MB:.1f} MB, {r['gathered'] / s:.2f}x |")


if __name__ == "__main__":
    main()
