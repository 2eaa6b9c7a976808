"""Every benchmark runs in its quick mode, through its public entry points, and prints its ratios (never
asserted on: the numbers are the benchmark's to report, not the suite's to judge). Those that use Ray
start local clusters of their own, as a user's run would. The quick runs are marked `benchmark`: `make
bench-quick` runs them, beside `make test` in CI (docs/testing.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from replay.lifeline import child_env
from tests.conftest import BENCHMARKS, REPO

GPU_ONLY = {"bench_cuda_record.py"}   # says it skips on a machine without CUDA


def test_every_benchmark_is_here():
    assert BENCHMARKS == ["bench_analysis.py", "bench_attention.py", "bench_bisect.py", "bench_cuda_record.py",
                          "bench_dcp.py", "bench_diff.py", "bench_fewer_ranks.py", "bench_loader.py",
                          "bench_multinode.py", "bench_object_store.py", "bench_record.py", "bench_replay.py",
                          "bench_sharded.py"]


@pytest.mark.benchmark
@pytest.mark.parametrize("script", BENCHMARKS)
def test_the_benchmark_runs_quickly_and_prints_its_ratios(script):
    env = child_env({k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    result = subprocess.run([sys.executable, f"benchmarks/{script}", "--quick"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    if script in GPU_ONLY and not torch.cuda.is_available():
        assert result.stdout.startswith("skipped: no CUDA device"), result.stdout
        return
    assert re.search(r"\d\.\d+x", result.stdout) or script in GPU_ONLY, result.stdout
    if script in GPU_ONLY:
        assert result.stdout.count("bit for bit") == 1, result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU: the check would run")
def test_the_gpu_check_says_in_one_line_why_it_cannot_run_here(tmp_path):
    result = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--out", str(tmp_path / "gc")], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ")
    why = "CPU build" if torch.version.cuda is None else "needs a CUDA GPU"
    assert why in lines[0] and not (tmp_path / "gc" / "report.md").exists()
