"""Benchmark the attention backends: the FA2 emulation against eager attention, forward + backward.

CPU (always): GPT-2-small attention shapes (batch 1, 12 heads, head dim 64), causal, BF16 inputs, at
sequence lengths 512, 1024 and 2048. Eager is transformers' GPT-2 `eager_attention_forward` (materialised
S, softmax, P V); the emulation is `fa2-emu` with its default 128 x 128 tiles, and `reference-emu`. Each
repetition times forward + backward of every backend in turn (interleaved, so machine noise hits all
alike); the median of the repetitions is reported with the ratio to eager (target: within 3x).

GPU (when CUDA is present): the Triton kernels against PyTorch SDPA flash at BF16, seq 1k-8k, head dim
64/128 (target >= 0.8x SDPA throughput; safe-softmax fix overhead <= 5%). Without a GPU this part says
so and is skipped.

    .venv/bin/python benchmarks/bench_attention.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from transformers.models.gpt2.modeling_gpt2 import eager_attention_forward

from replay.kernels.baseline import causal_mask
from replay.kernels.flash_emu import flash_attention
from replay.kernels.options import AttentionOptions, SafeSoftmaxFix
from replay.launch.lifeline import follow_parent


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

    from replay.kernels.triton_fa2 import triton_flash_attention

    print("GPU, causal, BF16, batch 4 x 16 heads, forward + backward, median of 10 (CUDA events):")
    for d in (64, 128):
        for n in ([1024, 4096] if quick else [1024, 2048, 4096, 8192]):
            q, k, v, do = (torch.randn(4, 16, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))

            def sdpa(a, b, c):
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=True)

            runs = {"sdpa-flash": sdpa,
                    "triton-fa2": lambda a, b, c: triton_flash_attention(a, b, c, AttentionOptions()),
                    "triton-fa2+fix": lambda a, b, c: triton_flash_attention(
                        a, b, c, AttentionOptions(fix=SafeSoftmaxFix(7.0)))}
            ms = {name: _cuda_ms(fn, q, k, v, do) for name, fn in runs.items()}
            flops = 4 * 4 * 16 * n * n * d * 2.5 / 2   # fwd (2 matmuls) + bwd (5), causal half
            print(f"  d {d:3d} seq {n:5d}: " + ", ".join(
                f"{name} {t:.2f} ms ({flops / t / 1e9:.0f} TFLOP/s)" for name, t in ms.items())
                + f"; triton/sdpa throughput {ms['sdpa-flash'] / ms['triton-fa2']:.2f}x (target >= 0.8x), "
                f"fix overhead {100 * (ms['triton-fa2+fix'] / ms['triton-fa2'] - 1):+.1f}% (target <= 5%)")


def _cuda_ms(fn, q, k, v, do) -> float:
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    for _ in range(3):
        fn(*leaves).backward(do)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*leaves).backward(do)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seq 512 and 1024 only, 3 repetitions")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    print(hardware())
    cpu_section([512, 1024] if args.quick else [512, 1024, 2048], reps=3 if args.quick else 5)
    gpu_section(args.quick)


if __name__ == "__main__":
    follow_parent()   # started by the test suite: end with it
    main()
