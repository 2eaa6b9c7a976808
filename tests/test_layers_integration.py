"""The processes that launch the work never load torch (the import contract: test_layers.py)."""

from __future__ import annotations

import subprocess
import sys


def test_the_launching_processes_never_load_torch():
    """`replay record`, `run`, `bisect`, `analyze`, `compare` and the views check plans, stores and data
    before any rank or Ray task starts, without torch (about a second of every command's start-up; the ranks
    and the Ray workers load it)."""
    code = ("import sys, replay.cli, replay.launch.ranks, replay.launch.script, replay.replayer.replays, "
            "replay.bisect.session, replay.analysis.jobs, replay.views\n"
            "from replay.config import ModelConfig\nfrom replay.kernels.plan import check_attention\n"
            "check_attention(ModelConfig(attention='fa2-emu;1.0=baseline'))\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
