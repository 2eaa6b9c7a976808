"""`replay report` refusing what it cannot report (the report of a real spike: test_report_integration.py)."""

from __future__ import annotations

import dataclasses
import json
import re

from replay.analysis.report import write_report
from replay.store import RunStore
from replay.store.step_diff import Deviation, Difference, HeadDiff, StepDiff
from tests.conftest import error_line, new_store, replay_cli


def test_report_needs_a_store(tmp_path):
    assert "does not exist" in error_line(replay_cli("report", str(tmp_path / "missing")))


def _saved_diff() -> StepDiff:
    """A diff as `replay diff --save` keeps it, made by hand: layer 1's heads differ, layer 0's do not."""
    first = Difference(3, "forward", "attention 1", "O", [2, 2, 8, 4], "float32", Deviation(2e-3, 1e-4, 4e-3, 6e4))
    heads = [HeadDiff(layer, head, 0.0 if layer == 0 else 2e-3, 1e-6, 1e-7, 1e-7, 1e-6, 0.0 if layer == 0 else 1e-6,
                      0.0 if layer == 0 else 0.8, 0.1, s=0.0 if layer == 0 else 1e-3, p=0.0 if layer == 0 else 4e-3)
             for layer in range(2) for head in range(3)]
    return StepDiff("s", 4, {"attention": "reference-emu:dtype=bf16", "layers": [1]}, 40, first,
                    [first, dataclasses.replace(first, order=7, what="dQ")], heads, ["forward x output 1"], [])


def test_a_saved_diff_reads_back_as_it_was_and_the_report_shows_it_with_its_heatmaps(tmp_path):
    """The answer goes through the store's JSON unchanged, and the report's section names its sides, its first
    difference and draws one figure of per-head heatmaps for it; a store without one says how to save one."""
    store = new_store(tmp_path / "s")
    bare = write_report(tmp_path / "s", tmp_path / "bare.html").read_text()
    assert "No saved diff yet" in bare
    saved = _saved_diff()
    store.write_diff("bf16-layer1", json.loads(json.dumps(saved.to_dict())))
    assert StepDiff.from_dict(RunStore.open(tmp_path / "s").diffs()["bf16-layer1"]) == saved
    page = write_report(tmp_path / "s", tmp_path / "with.html").read_text()
    figures = [int(re.search(r"data-figures='(\d+)'", text).group(1)) for text in (bare, page)]
    assert figures[1] == figures[0] + 1
    section = page[page.index("<h2>Operation by operation</h2>"):page.index("<h2>Localisation</h2>")]
    assert "bf16-layer1: step 4, rank 0" in section and "2 differ" in section
    assert "first difference: forward attention 1 O [2, 2, 8, 4] float32" in section
    assert section.count("<img") == 1 and "No saved diff yet" not in section
