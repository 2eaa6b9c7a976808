"""`replay report` on a real spike, rendered by a real headless browser (Debian's chromium); a report that
cannot be written (a read-only store, a full disk) or is killed."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from replay.analysis.localise import localise_store
from tests.conftest import error_line, killed_by_fault, replay_cli, tree_snapshot

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



def _without_report(store: Path) -> dict:
    return {k: v for k, v in tree_snapshot(store).items() if not k.startswith("report.html")}


def test_a_report_on_a_read_only_store_is_one_line_and_writes_nothing(analysed_store, read_only, tmp_path):
    store = tmp_path / "run"
    shutil.copytree(analysed_store, store, ignore=shutil.ignore_patterns("report.html*"))
    before = tree_snapshot(store)
    result = replay_cli("report", str(read_only(store)))
    line = error_line(result)
    assert result.returncode == 2 and ("read-only" in line or "permission denied" in line) and "-o FILE" in line, line
    assert tree_snapshot(store) == before        # no report.html.tmp, nothing else


def test_a_report_on_a_full_disk_is_one_line_leaves_no_temporary_file_and_is_written_once_space_is_freed(
        analysed_store, small_disk):
    disk = small_disk(16384)
    store = disk.path / "run"
    shutil.copytree(analysed_store, store, ignore=shutil.ignore_patterns("report.html*"))
    own = _without_report(store)
    disk.fill(leave_kib=64)                       # the page is about 150 KiB
    result = replay_cli("report", str(store))
    line = error_line(result)
    assert result.returncode == 2 and "no space left on the device" in line and "free space there" in line, line
    assert not (store / "report.html.tmp").exists() and not (store / "report.html").exists()
    disk.free()
    assert replay_cli("report", str(store)).returncode == 0
    assert (store / "report.html").stat().st_size > 64 * 1024 and not (store / "report.html.tmp").exists()
    assert _without_report(store) == own


def test_a_report_killed_before_its_page_is_in_place_is_written_by_the_next(analysed_store, tmp_path):
    store = tmp_path / "run"
    shutil.copytree(analysed_store, store, ignore=shutil.ignore_patterns("report.html*"))
    killed_by_fault("report-written", "report", str(store))
    assert (store / "report.html.tmp").exists() and not (store / "report.html").exists()
    assert replay_cli("report", str(store)).returncode == 0
    assert (store / "report.html").exists() and not (store / "report.html.tmp").exists()
