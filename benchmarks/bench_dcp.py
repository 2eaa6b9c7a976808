"""Benchmark DCP interop against DCP itself: `replay export` and `load_dcp` beside dcp.save and dcp.load.

A model with its AdamW state after one step (random gradients) is committed as checkpoint 0 of a run store,
as the recorder writes it. Then, in rounds alternating the order, each timed alone (the page cache's dirty
data flushed first, untimed) in one temporary directory:

- export: `replay.store.dcp.export` of checkpoint 0 with the model and optimizer objects (read_model and
  the optimizer's shard read, every checksum verified; loaded into the objects; get_state_dict; dcp.save);
- dcp.save: what a torchtitan or OLMo-core user does with the live state: get_state_dict, then dcp.save;
- import: `replay.recorder.dcp.load_dcp` of the exported directory into a model and optimizer;
- dcp.load: get_state_dict of that model and optimizer, dcp.load into it, set_state_dict.

Median seconds of each and the ratios; then that the imported state equals the live one bit for bit. The
full run uses GPT-2 small (124M parameters; about two minutes); --quick a 4-layer model (seconds):

    .venv/bin/python benchmarks/bench_dcp.py [--quick] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from bench_record import LARGE, SMALL, hardware, n_params
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from replay.config import build_config
from replay.lifeline import follow_parent
from replay.recorder import create_run_store
from replay.recorder.dcp import load_dcp
from replay.recorder.environment import configure_determinism
from replay.recorder.state import TorchTrainState
from replay.store.dcp import export, quiet_single_process
from replay.train.model import build_model


def parts(sets: list[str], step: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and its AdamW; after one step on random gradients when `step`."""
    cfg = build_config("tiny", None, sets)
    model = build_model(cfg.model, cfg.model.vocab_size or 256, cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    if step:
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
    return model, optimizer


def recorded(workdir: Path, sets: list[str], model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Path:
    path = workdir / "run"
    store = create_run_store(str(path), build_config("tiny", None, sets))
    store.write_shard(0, 0, {"state": TorchTrainState(model, optimizer).state_dict(0), "rng": {}})
    store.commit_checkpoint(0, "regular", 1)
    return path


def timed(fn: Callable[[], object]) -> float:
    os.sync()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench(workdir: Path, sets: list[str], label: str, repeats: int) -> None:
    live, live_opt = parts(sets, step=True)
    store = recorded(workdir, sets, live, live_opt)
    target, target_opt = parts(sets, step=False)    # export loads the checkpoint into these
    into, into_opt = parts(sets, step=False)        # the imports load into these

    def dcp_save(out: Path) -> None:
        model_state, optimizer_state = get_state_dict(live, live_opt)
        with quiet_single_process():
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=out)

    def dcp_load(src: Path) -> None:
        model_state, optimizer_state = get_state_dict(into, into_opt)
        with quiet_single_process():
            dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=src)
        set_state_dict(into, into_opt, model_state_dict=model_state, optim_state_dict=optimizer_state)

    times: dict[str, list[float]] = {"export": [], "dcp.save": [], "import": [], "dcp.load": []}
    for r in range(repeats):
        ours, theirs = workdir / f"export-{r}", workdir / f"dcp-{r}"
        pairs = [("export", partial(export, store, 0, ours, target, target_opt)),
                 ("dcp.save", partial(dcp_save, theirs)),
                 ("import", partial(load_dcp, ours, into, into_opt)),
                 ("dcp.load", partial(dcp_load, theirs))]
        order = [pairs[0], pairs[1], pairs[2], pairs[3]] if r % 2 == 0 else [pairs[1], pairs[0], pairs[3], pairs[2]]
        for name, fn in order:
            times[name].append(timed(fn))
        shutil.rmtree(ours)
        shutil.rmtree(theirs)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{label} ({n_params(live) / 1e6:.1f}M params, model + AdamW state; median of {repeats}):", flush=True)
    print(f"  export {med['export']:.3f} s, dcp.save {med['dcp.save']:.3f} s: {med['export'] / med['dcp.save']:.2f}x")
    print(f"  import {med['import']:.3f} s, dcp.load {med['dcp.load']:.3f} s: {med['import'] / med['dcp.load']:.2f}x")
    export(store, 0, workdir / "check", target, target_opt)
    fresh, fresh_opt = parts(sets, step=False)
    load_dcp(workdir / "check", fresh, fresh_opt)
    same = all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), live.state_dict().values(), strict=True))
    same = same and all(torch.equal(fresh_opt.state[p][k], live_opt.state[q][k])
                        for p, q in zip(fresh.parameters(), live.parameters(), strict=True) for k in live_opt.state[q])
    print(f"  store -> DCP -> model: {'equal to the live state bit for bit' if same else 'DIFFERS from the live one'}")
    shutil.rmtree(workdir / "check")
    shutil.rmtree(workdir / "run")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 4-layer model, 2 rounds (seconds)")
    ap.add_argument("--dir", default=None, help="where the store and DCP directories go (default: system temp)")
    args = ap.parse_args()
    configure_determinism(os.cpu_count())
    print(hardware(), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-dcp-", dir=args.dir) as tmp:
        if args.quick:
            bench(Path(tmp), SMALL, "4 layers x 128", repeats=2)
        else:
            bench(Path(tmp), LARGE, "GPT-2 small: 12 layers x 768, seq 1024, vocab 50304", repeats=5)


if __name__ == "__main__":
    follow_parent()   # started by the test suite: end with it
    main()
