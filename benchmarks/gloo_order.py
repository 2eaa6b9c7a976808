"""Which order does gloo's CPU all-reduce (SUM, float32) add the ranks' values in? Found by experiment.

Each of W real gloo ranks (processes, TCP on 127.0.0.1) all-reduces a known float32 tensor whose elements
have random magnitudes (so that different orders of the additions round differently); the result is then
compared, element by element and bit for bit, with every order of adding W operands (every binary tree over
the ranks: 1 for W=2, 3 for W=3, 15 for W=4), computed here in float32 with numpy. Printed per size: the
orders that match, as runs of elements ("elements 0..N-1: ((0+1)+2)+3"); an element matched by several
orders (their roundings agree) narrows its runs to the orders every element of the run admits.

DDP (torch.nn.parallel, gloo on CPU) divides each rank's bucket by the world size before this all-reduce;
for W a power of two that division is exact, so the order of the additions is all that decides the bits.

    python benchmarks/gloo_order.py                 # W = 2 and 4, sizes 1 .. 2**20 + 3
    python benchmarks/gloo_order.py --world 3 --sizes 7 1000
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from replay.train.fewer_ranks import ring_sum

SIZES = (1, 7, 1000, 120_576, 262_147, 7_000_001)


def operand(rank: int, size: int) -> np.ndarray:
    """Rank `rank`'s tensor: random signs and magnitudes over 2**-12 .. 2**12."""
    rng = np.random.default_rng(1000 * size + rank)
    return (rng.standard_normal(size) * np.exp2(rng.integers(-12, 13, size))).astype(np.float32)


def _rank(rank: int, world: int, port: int, sizes: tuple[int, ...], out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for size in sizes:
            t = torch.from_numpy(operand(rank, size))
            dist.all_reduce(t)
            if rank == 0:
                out[size] = t.numpy().copy()
    finally:
        dist.destroy_process_group()


def gloo_all_reduce(world: int, sizes: tuple[int, ...]) -> dict[int, np.ndarray]:
    """Rank 0's result of a real gloo all_reduce(SUM) over `world` processes, per size."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_rank, args=(world, port, sizes, out), nprocs=world, start_method="spawn")
        return dict(out)


def orders(ranks: tuple[int, ...]) -> Iterator[tuple[str, object]]:
    """Every way to add the ranks' values two at a time, as (name, tree); a tree is a rank or a pair."""
    if len(ranks) == 1:
        yield str(ranks[0]), ranks[0]
        return
    first, rest = ranks[0], ranks[1:]
    for mask in range(1 << len(rest)):   # the subset that goes with `first`; the other side is non-empty
        left = (first, *(r for i, r in enumerate(rest) if mask >> i & 1))
        right = tuple(r for i, r in enumerate(rest) if not mask >> i & 1)
        if not right:
            continue
        for ln, lt in orders(left):
            for rn, rt in orders(right):
                yield f"({ln}+{rn})", (lt, rt)


def evaluate(tree: object, values: list[np.ndarray]) -> np.ndarray:
    if isinstance(tree, int):
        return values[tree]
    left, right = tree  # type: ignore[misc]
    return evaluate(left, values) + evaluate(right, values)   # float32 + float32: one rounding


def matching(world: int, size: int, result: np.ndarray) -> list[tuple[int, int, list[str]]]:
    """Runs of elements (first, last, the orders all of them match)."""
    values = [operand(r, size) for r in range(world)]
    names, hits = [], []
    for name, tree in orders(tuple(range(world))):
        names.append(name[1:-1] if world > 1 else name)
        hits.append(evaluate(tree, values).view(np.uint32) == result.view(np.uint32))
    hit = np.stack(hits)   # (order, element)
    runs: list[tuple[int, int, list[str]]] = []
    start, common = 0, hit[:, 0].copy()
    for i in range(1, size + 1):
        narrowed = common & hit[:, i] if i < size else common
        if i == size or not narrowed.any():
            runs.append((start, i - 1, [n for n, h in zip(names, common, strict=True) if h]))
            if i < size:
                start, common = i, hit[:, i].copy()
        else:
            common = narrowed
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    args = parser.parse_args()
    print(f"torch {torch.__version__}, gloo all_reduce(SUM) of float32 on CPU", flush=True)
    for world in args.world:
        results = gloo_all_reduce(world, tuple(args.sizes))
        for size in args.sizes:
            runs = matching(world, size, results[size])
            unmatched = [r for r in runs if not r[2]]
            shown = runs if len(runs) <= 12 else runs[:6] + [(-1, -1, ["..."])] + runs[-6:]
            print(f"W={world} size={size}: {len(runs)} run(s) of one order"
                  + (f", {len(unmatched)} element run(s) matched by NO order" if unmatched else ""))
            for first, last, names in shown:
                print("    ..." if first < 0 else f"    elements {first}..{last}: {' | '.join(names) or 'none'}")
            ring = ring_sum([torch.from_numpy(operand(r, size)) for r in range(world)]).numpy()
            same = int((ring.view(np.uint32) == results[size].view(np.uint32)).sum())
            print(f"    the ring order (replay.train.fewer_ranks.ring_sum): {same} of {size} elements bit for bit")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
