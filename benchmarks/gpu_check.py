"""`make gpu-check`: every GPU test and GPU measurement of replay in one command, written to one report.

Sections (each a command of its own, run in turn; `--only` picks some):
  tests     the suite's GPU tests (`pytest -m gpu`): the Triton kernels against the emulation, FP64 and SDPA
            flash, their determinism, the flash check, CUDA recordings replayed bit for bit
  flash     `replay microbench --mode flash`: the real flash kernel against FP64 and, bit for bit, against
            the emulation; the Triton kernels against the emulation
  speed     benchmarks/bench_attention.py --gpu-only: Triton against SDPA flash, the fix's overhead, the
            emulation's speed on the GPU
  record    benchmarks/bench_record.py --device cuda: the recording overhead per step and the training
            thread's share of a checkpoint, GPT-2 small in BF16 on the GPU
  replay    benchmarks/bench_cuda_record.py: GPT-2 small recorded on the GPU with eager, sdpa and
            triton-fa2 attention, each replayed with --verify

The report (default runs/gpu-check/report.md) starts with the device, driver, versions and date, then
each section's command, exit status, wall time and output. Exits non-zero if any section failed.

    python benchmarks/gpu_check.py [--only tests,flash] [--out runs/gpu-check] [--replay-steps 200]
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def sections(out: Path, replay_steps: int) -> dict[str, list[str]]:
    py = sys.executable
    return {
        "tests": [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rs", "tests"],
        "flash": [py, "-m", "replay", "microbench", "--mode", "flash", "-o", str(out / "microbench")],
        "speed": [py, "benchmarks/bench_attention.py", "--gpu-only"],
        "record": [py, "benchmarks/bench_record.py", "--device", "cuda"],
        "replay": [py, "benchmarks/bench_cuda_record.py", "--steps", str(replay_steps),
                   "--checkpoint-every", str(replay_steps // 2)],
    }


def header() -> list[str]:
    import torch

    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.strip() or "unknown"
    versions = ", ".join(f"{name} {_version(name)}" for name in ("torch", "triton", "transformers"))
    return [f"# replay GPU check, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC", "",
            f"- device: {torch.cuda.get_device_name()} (compute capability "
            f"{'.'.join(map(str, torch.cuda.get_device_capability()))}), driver {driver}, CUDA {torch.version.cuda}",
            f"- {versions}; Python {sys.version.split()[0]}", ""]


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def main() -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated sections (default: all)")
    parser.add_argument("--out", default="runs/gpu-check", help="directory of the report and the flash check's files")
    parser.add_argument("--replay-steps", type=int, default=200,
                        help="steps of each recording in the replay section, a checkpoint at half (default 200)")
    args = parser.parse_args()
    if args.replay_steps < 2:
        parser.error("--replay-steps must be at least 2")
    if torch.version.cuda is None:
        print(f"error: this torch ({torch.__version__}) is a CPU build; install the CUDA build, e.g. "
              '`make setup TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"` '
              "(remove .venv first)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: the GPU check needs a CUDA GPU, and this machine has none; run it where `nvidia-smi` "
              "shows one", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    commands = sections(out, args.replay_steps)
    chosen = [s.strip() for s in args.only.split(",") if s.strip()] or list(commands)
    unknown = [s for s in chosen if s not in commands]
    if unknown:
        print(f"error: unknown section {unknown[0]!r}; choose from {', '.join(commands)}", file=sys.stderr)
        return 2
    report = out / "report.md"
    lines = header()
    failed = []
    for name in chosen:
        print(f"== {name}: {' '.join(commands[name][1:])}", flush=True)
        t0 = time.perf_counter()
        result = subprocess.run(commands[name], cwd=REPO, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        output = (result.stdout + ("\n" + result.stderr if result.returncode else "")).strip()
        print(output[-6000:], flush=True)
        if result.returncode:
            failed.append(name)
        lines += [f"## {name}", "", f"`{' '.join(['python', *commands[name][1:]])}`: exit {result.returncode}, "
                  f"{seconds:.0f} s", "", "```", output, "```", ""]
        report.write_text("\n".join(lines))   # after every section: a killed run keeps what it measured
    print(f"wrote {report}" + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
