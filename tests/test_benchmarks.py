"""Every benchmark runs in its quick mode, through its public entry points, and prints its ratios (never
asserted on: the numbers are the benchmark's to report, not the suite's to judge). They run one after
another in the background from the start of the suite, beside the other tests, which only the numbers
they print feel."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from replay.launch.lifeline import child_env
from tests.conftest import REPO, in_background, wait_ready

pytestmark = pytest.mark.slow
BENCHMARKS = sorted(p.name for p in (REPO / "benchmarks").glob("bench_*.py"))
GPU_ONLY = {"bench_cuda_record.py"}   # says it skips on a machine without CUDA


def test_every_benchmark_is_here():
    assert BENCHMARKS == ["bench_analysis.py", "bench_attention.py", "bench_bisect.py", "bench_cuda_record.py",
                          "bench_record.py", "bench_replay.py"]


def _quick(script: str, ray_address: str | None = None) -> subprocess.CompletedProcess:
    env = os.environ | ({"RAY_ADDRESS": ray_address} if ray_address else {})
    return subprocess.run([sys.executable, f"benchmarks/{script}", "--quick"], cwd=REPO, env=child_env(env),
                          capture_output=True, text=True, timeout=300)


def _every_quick_run() -> dict[str, subprocess.CompletedProcess]:
    """One after another; the analysis benchmark's last, on the session's Ray cluster once there is one."""
    runs = {script: _quick(script) for script in BENCHMARKS if script != "bench_analysis.py"}
    runs["bench_analysis.py"] = _quick("bench_analysis.py", wait_ready("ray_local"))
    return runs


def start_in_background() -> None:
    in_background("benchmarks", _every_quick_run)


@pytest.fixture(scope="module")
def quick_runs(ray_local) -> dict[str, subprocess.CompletedProcess]:
    """Every benchmark's quick mode, started when the suite began (conftest.in_background)."""
    return in_background("benchmarks", _every_quick_run).result()


@pytest.mark.parametrize("script", BENCHMARKS)
def test_the_benchmark_runs_quickly_and_prints_its_ratios(quick_runs, script):
    result = quick_runs[script]
    assert result.returncode == 0, result.stderr[-3000:]
    if script in GPU_ONLY and not torch.cuda.is_available():
        assert result.stdout.startswith("skipped: no CUDA device"), result.stdout
        return
    assert re.search(r"\d\.\d+x", result.stdout) or script in GPU_ONLY, result.stdout
    if script in GPU_ONLY:
        assert result.stdout.count("bit for bit") == 1, result.stdout
