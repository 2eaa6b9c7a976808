"""Benchmark the attention backends: the FA2 emulation against eager attention, forward + backward.

CPU (always): GPT-2-small attention shapes (batch 1, 12 heads, head dim 64), causal, BF16 inputs, at
sequence lengths 512, 1024 and 2048. Eager is transformers' GPT-2 `eager_attention_forward` (materialised
S, softmax, P V); the emulation is `fa2-emu` with its default 128 x 128 tiles, and `reference-emu`. Each
repetition times forward + backward of every backend in turn (interleaved, so machine noise hits all
alike); the median of the repetitions is reported with the ratio to eager (target: within 3x).

GPU (when CUDA is present): the Triton kernels against PyTorch SDPA flash at BF16, batch 4 x 16 heads,
seq 1k-8k, head dim 64/128, with the flash kernel's own tiles (target >= 0.8x SDPA throughput;
safe-softmax fix overhead <= 5%), and the emulation run on the GPU for comparison. Without a GPU this
part says so and is skipped.

    .venv/bin/python benchmarks/bench_attention.py [--quick] [--gpu-only]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from functools import partial

import torch
from transformers.models.gpt2.modeling_gpt2 import eager_attention_forward

from replay.kernels.baseline import causal_mask
from replay.kernels.flash_emu import flash_attention
from replay.kernels.options import AttentionOptions, SafeSoftmaxFix
from replay.lifeline import follow_parent


def hardware() -> str:
    cpu = platform.processor() or "unknown CPU"
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", no GPU"
    return f"hardware: {cpu}, {os.cpu_count()} cores{gpu}; torch {torch.__version__}"


def fwd_bwd_seconds(fn, q, k, v, do) -> float:
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    start = time.perf_counter()
    fn(*leaves).backward(do)
    return time.perf_counter() - start


_MODULE = torch.nn.Module().eval()   # eager_attention_forward reads module.training (for dropout)


def eager(q, k, v):
    n = q.shape[-2]
    additive = torch.where(causal_mask(n, n), 0.0, torch.finfo(torch.float32).min)
    return eager_attention_forward(_MODULE, q, k, v, additive, scaling=q.shape[-1] ** -0.5)[0].transpose(1, 2)


def cpu_section(seq_lens: list[int], reps: int) -> None:
    backends = {
        "eager": eager,
        "fa2-emu": lambda q, k, v: flash_attention(q, k, v, AttentionOptions()),
        "reference-emu": lambda q, k, v: flash_attention(q, k, v, AttentionOptions(placement="reference")),
    }
    print(f"CPU, causal, BF16, batch 1 x 12 heads x head dim 64, forward + backward, median of {reps}:")
    for n in seq_lens:
        g = torch.Generator().manual_seed(n)
        q, k, v, do = (torch.randn(1, 12, n, 64, generator=g).bfloat16() for _ in range(4))
        times = {name: [] for name in backends}
        for _ in range(reps):
            for name, fn in backends.items():
                times[name].append(fwd_bwd_seconds(fn, q, k, v, do))
        base = statistics.median(times["eager"])
        row = [f"eager {1e3 * base:7.1f} ms"]
        for name in list(backends)[1:]:
            t = statistics.median(times[name])
            row.append(f"{name} {1e3 * t:7.1f} ms ({t / base:.2f}x eager)")
        print(f"  seq {n:5d}: " + ", ".join(row) + "   target: emulation within 3x of eager")


def gpu_section(quick: bool) -> None:
    if not torch.cuda.is_available():
        print("GPU: skipped, no CUDA device on this machine (Triton vs SDPA needs one)")
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    from replay.kernels.triton_fa2 import triton_flash_attention

    def sdpa(a, b, c):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=True)

    def ms(fn, q, k, v, do) -> float:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        return do_bench(lambda: fn(*leaves).backward(do), warmup=50, rep=300, return_mode="median")

    print(f"GPU {torch.cuda.get_device_name()}, causal, BF16, batch 4 x 16 heads, forward + backward, median ms "
          "(triton.testing.do_bench); Triton tiles as the flash kernel's: 128x128 at d 64, 128x64 at d 128:")
    for d in (64, 128):
        tile = AttentionOptions(block_r=128, block_c=128 if d <= 64 else 64)
        for n in ([1024, 4096] if quick else [1024, 2048, 4096, 8192]):
            q, k, v, do = (torch.randn(4, 16, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            fixed = tile.with_(fix=SafeSoftmaxFix(7.0))
            runs = {"sdpa-flash": sdpa,
                    "triton-fa2": partial(triton_flash_attention, opts=tile),
                    # as in training: checked once per step
                    "triton-fa2+fix": partial(triton_flash_attention, opts=fixed, defer_checks=True),
                    "+fix checked at once": partial(triton_flash_attention, opts=fixed)}
            if n <= 2048:
                runs["fa2-emu"] = partial(flash_attention, opts=tile)
            t = {name: ms(fn, q, k, v, do) for name, fn in runs.items()}
            flops = 4 * 16 * n * n * d * 2 * 7 / 2   # 2 matmuls forward, 5 backward, causal half
            print(f"  d {d:3d} seq {n:5d}: " + ", ".join(
                f"{name} {m:.3f} ms ({flops / m / 1e9:.0f} TFLOP/s)" for name, m in t.items())
                + f"; triton/sdpa throughput {t['sdpa-flash'] / t['triton-fa2']:.2f}x (target >= 0.8x), "
                f"fix overhead {100 * (t['triton-fa2+fix'] / t['triton-fa2'] - 1):+.1f}% (target <= 5%; "
                f"{100 * (t['+fix checked at once'] / t['triton-fa2'] - 1):+.1f}% checked at once)"
                + (f", emulation {t['fa2-emu'] / t['sdpa-flash']:.0f}x sdpa's time" if "fa2-emu" in t else ""),
                flush=True)


def tune_section() -> None:
    """The launch settings behind triton_fa2._warps_and_stages: (warps, pipeline stages) of the forward and
    of the two backward kernels, at seq 2048, against SDPA flash (the settings move no rounding point)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    from replay.kernels import triton_fa2

    chosen = triton_fa2._warps_and_stages

    def ms(fn, q, k, v, do, backward=True) -> float:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        step = (lambda: fn(*leaves).backward(do)) if backward else (lambda: fn(*leaves))
        return do_bench(step, warmup=50, rep=200, return_mode="median")

    def sdpa(a, b, c):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=True)

    try:
        for d in (64, 128):
            q, k, v, do = (torch.randn(4, 16, 2048, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            base_f, base = ms(sdpa, q, k, v, do, False), ms(sdpa, q, k, v, do)
            print(f"tune, d {d} seq 2048: sdpa-flash forward {base_f:.3f} ms, forward + backward {base:.3f} ms",
                  flush=True)
            for tile in ((128, 128), (128, 64), (64, 64)):
                opts = AttentionOptions(block_r=tile[0], block_c=tile[1])
                for fw in ((4, 2), (8, 2), (8, 3)):
                    for bw in ((4, 2), (8, 2), (8, 1)):
                        triton_fa2._warps_and_stages = lambda _opts, forward, fw=fw, bw=bw: fw if forward else bw
                        fn = partial(triton_fa2.triton_flash_attention, opts=opts)
                        f, t = ms(fn, q, k, v, do, False), ms(fn, q, k, v, do)
                        print(f"  tiles {tile[0]}x{tile[1]} forward {fw} backward {bw} (warps, stages): forward "
                              f"{f:.3f} ms ({base_f / f:.2f}x sdpa), forward + backward {t:.3f} ms "
                              f"({base / t:.2f}x sdpa)", flush=True)
    finally:
        triton_fa2._warps_and_stages = chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seq 512 and 1024 only, 3 repetitions")
    parser.add_argument("--gpu-only", action="store_true", help="only the GPU part")
    parser.add_argument("--tune", action="store_true", help="(GPU) also time the Triton kernels' launch settings")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    print(hardware())
    if not args.gpu_only:
        cpu_section([512, 1024] if args.quick else [512, 1024, 2048], reps=3 if args.quick else 5)
    gpu_section(args.quick)
    if args.tune and torch.cuda.is_available():
        tune_section()


if __name__ == "__main__":
    follow_parent()   # started by the test suite: end with it
    main()
