"""`replay report` on a real spike, rendered by a real headless browser (Debian's chromium)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from replay.analysis.localise import localise_store

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")


def _chromium(*args: str, profile: Path) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True,
                          timeout=120)


@needs_chromium
def test_report_renders_in_a_browser_with_its_plots(reported_spike, tmp_path):
    page = reported_spike / "report.html"
    dom = _chromium("--dump-dom", page.as_uri(), profile=tmp_path / "p1").stdout
    body = re.search(r"<body[^>]*>", dom).group(0)
    figures = int(re.search(r'data-figures="(\d+)"', body).group(1))
    rendered = int(re.search(r'data-figures-rendered="(\d+)"', body).group(1))
    assert figures >= 4 and rendered == figures        # loss/grad, 2 heatmap sets, distances: all decoded

    found = localise_store(reported_spike)[0]
    assert found.trajectory.startswith("steps-")          # read from the dense bitwise replay
    first = re.search(r"<table class=\"ranking\">.*?</tr><tr><td>head</td><td>([^<]+)</td>", dom, re.S)
    assert first and first.group(1) == found.heads[0].unit
    assert f"Spike at step <b>{found.spike}</b>" in dom

    shot = tmp_path / "shot.png"
    _chromium("--window-size=1200,3000", f"--screenshot={shot}", page.as_uri(), profile=tmp_path / "p2")
    from PIL import Image

    pixels = np.asarray(Image.open(shot).convert("RGB"))
    assert pixels.shape[:2] == (3000, 1200)
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 1000   # plots drawn, not a blank or broken page

