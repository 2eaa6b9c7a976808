"""Running the analysis: faults retried, interruptions resumed, only new work computed, labelled data."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from replay.analysis.jobs import analyze
from replay.analysis.results import METRICS, analysis_status, read_distances, read_metrics
from tests.conftest import error_line, killed_by_fault, replay_cli, tree_snapshot

# Its in-process 2-rank runs use the worker's warm ranks (tests/conftest.py): its subject is
# the analysis of what they record, not how ranks start, which tests/launch checks with fresh ones.
pytestmark = pytest.mark.usefixtures("on_rank_pool")


def _same_results(a, b) -> None:
    ta, tb = read_metrics(a), read_metrics(b)
    assert ta["step"].tolist() == tb["step"].tolist()
    for name in METRICS:
        np.testing.assert_array_equal(ta[name], tb[name], err_msg=name)
    da, db = read_distances(a / "replays/lr2"), read_distances(b / "replays/lr2")
    for metric in ("max_abs", "wasserstein"):
        np.testing.assert_array_equal(da["parent"][metric], db["parent"][metric])


def test_xarray_opens_the_analysis_group_with_named_dimensions(analysed_store):
    import xarray as xr

    ds = xr.open_zarr(analysed_store, group="analysis", consolidated=False)
    assert ds["spectral_head"].dims == ("checkpoint", "layer", "head_matrix", "head")
    assert ds["spectral_qk"].dims == ("checkpoint", "layer", "head")
    assert ds["checkpoint"].values.tolist() == [0, 10, 20, 30]
    q = ds["spectral_head"].sel(head_matrix="q", checkpoint=20, layer=1).values
    assert q.shape == (2,) and np.all(q > 0)
    dist = xr.open_zarr(analysed_store / "replays/lr2", group="analysis/distances/parent", consolidated=False)
    assert dist["wasserstein"].dims == ("checkpoint", "tensor")
    assert any("c_attn" in str(t) for t in dist["tensor"].values)


def test_failed_tasks_are_retried_and_the_results_are_complete(replayed_copy, analysed_store, ray_local, tmp_path,
                                                              monkeypatch):
    """An injected transient I/O error (OSError) on checkpoint 20 and a worker SIGKILLed mid-task on
    checkpoint 10: Ray runs both tasks again and the results equal those of an undisturbed analysis."""
    monkeypatch.setenv("REPLAY_FAULT", "analysis-io:20,analysis-kill:10")
    monkeypatch.setenv("REPLAY_FAULT_ONCE", str(tmp_path))   # the retry succeeds
    summary = analyze(replayed_copy)
    assert summary.computed == 7 and summary.skipped == 0    # 4 run + 2 replay checkpoints, 1 distance
    _same_results(replayed_copy, analysed_store)


def test_one_worker_without_a_cluster_computes_the_same_results_in_its_own_process(replayed_copy, analysed_store,
                                                                                   monkeypatch):
    """`--workers 1` with no cluster to join: no Ray, the items one at a time in the command's process, and
    the results bit for bit those of the analysis on Ray workers."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    result = replay_cli("analyze", str(replayed_copy), "--workers", "1", "--json", process=True)
    assert result.returncode == 0, result.stderr
    assert "7 work items one at a time in this process" in result.stderr, result.stderr
    assert "Ray" not in result.stderr, result.stderr
    assert json.loads(result.stdout)["computed"] == 7
    _same_results(replayed_copy, analysed_store)


def test_an_interrupted_analysis_resumes_without_recomputing(replayed_copy, analysed_store, ray_local):
    """The driver is SIGKILLed after 2 finished items; the next run computes only the rest."""
    killed_by_fault("analysis-driver-kill:2", "analyze", str(replayed_copy), "--workers", "1",
                    env={"RAY_ADDRESS": ray_local})
    result = replay_cli("analyze", str(replayed_copy), "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["already_done"] >= 2 and out["computed"] == 7 - out["already_done"]
    _same_results(replayed_copy, analysed_store)


def test_an_analysis_from_before_a_metric_existed_is_completed(analysed_store, ray_local, tmp_path):
    """An analysis group without the early-warning signals (as `replay analyze` wrote it before they
    existed) reads with NaN there, and the next analysis computes every row again."""
    import shutil

    import zarr

    store = tmp_path / "run"
    shutil.copytree(analysed_store, store)
    for where in (store, store / "replays/lr2"):
        group = zarr.open_group(str(where / "analysis"), mode="r+")
        for name in ("attn_entropy", "log_z"):
            del group[name]
    old = read_metrics(store)
    assert np.isnan(old["attn_entropy"]).all() and np.isnan(old["log_z"]).all()
    assert old["step"].tolist() == read_metrics(analysed_store)["step"].tolist()
    summary = analyze(store)
    assert (summary.computed, summary.skipped) == (6, 1)   # every checkpoint again; the distances were whole
    _same_results(store, analysed_store)


def _own_data(store) -> dict:
    """The store's files that the analysis does not write."""
    return {k: v for k, v in tree_snapshot(store).items()
            if not k.startswith(("analysis/", "leases/")) and "/analysis/" not in k}


def test_a_full_disk_stops_the_analysis_in_one_line_and_the_next_one_completes_it(replayed_store, analysed_store,
                                                                                 ray_local, small_disk):
    """100 KiB free (a tmpfs): one line naming the problem and what to do, the run's own data as it was; once
    space is freed, `replay analyze` completes it, equal to an undisturbed analysis."""
    disk = small_disk(16384)
    store = disk.path / "run"
    shutil.copytree(replayed_store, store)
    own = _own_data(store)
    disk.fill(leave_kib=100)
    result = replay_cli("analyze", str(store))
    line = error_line(result)
    assert result.returncode == 2 and "no space left on the device" in line and "free space there" in line, line
    assert _own_data(store) == own
    disk.free()
    again = replay_cli("analyze", str(store))
    assert again.returncode == 0, again.stderr
    _same_results(store, analysed_store)


@pytest.mark.parametrize("fault", ["analysis-unfinished", "analysis-rows"])
def test_an_analysis_killed_while_making_its_tables_is_made_whole_by_the_next(replayed_copy, analysed_store,
                                                                            ray_local, fault):
    """SIGKILLed after the metrics table's arrays are made but before its attributes say so, or after its arrays
    are sized for the new rows but before they are listed: nothing is read of it, and the next analysis
    computes every item, equal to an undisturbed analysis."""
    killed_by_fault(fault, "analyze", str(replayed_copy), env={"RAY_ADDRESS": ray_local})
    assert (replayed_copy / "analysis/zarr.json").exists()
    assert analysis_status(replayed_copy)["checkpoints"] == []
    summary = analyze(replayed_copy)
    assert (summary.computed, summary.skipped) == (7, 0)
    _same_results(replayed_copy, analysed_store)


def test_rerunning_computes_only_what_is_new(replayed_copy, ray_local):
    first = analyze(replayed_copy)
    assert (first.computed, first.skipped) == (7, 0)
    again = analyze(replayed_copy)
    assert (again.computed, again.skipped) == (0, 7)
    result = replay_cli("run", str(replayed_copy), "--from", "20", "--to", "24", "--lr-scale", "0.5")
    assert result.returncode == 0, result.stderr
    new = analyze(replayed_copy)     # the new replay: its start checkpoint (20) and its end (25)
    assert (new.computed, new.skipped) == (2, 7)


def test_analysis_errors_are_one_line_and_change_nothing(replayed_copy, tmp_path):
    before = tree_snapshot(replayed_copy)
    assert "does not exist" in error_line(replay_cli("analyze", str(tmp_path / "nope")))
    assert "is a replay" in error_line(replay_cli("analyze", str(replayed_copy / "replays/lr2")))
    assert "--workers must be >= 1" in error_line(replay_cli("analyze", str(replayed_copy), "--workers", "0"))
    line = error_line(replay_cli("analyze", str(replayed_copy), "--ray-address", "127.0.0.1:9", process=True))
    assert "cannot connect to the Ray cluster at 127.0.0.1:9" in line
    assert tree_snapshot(replayed_copy) == before


def test_info_shows_what_is_analysed(analysed_store):
    out = json.loads(replay_cli("info", str(analysed_store), "--json").stdout)
    assert out["analysis"]["checkpoints"] == [0, 10, 20, 30]
    text = replay_cli("info", str(analysed_store)).stdout
    assert "analysis    4 checkpoints analysed" in text


def test_a_replay_that_cannot_be_read_is_named_not_skipped(replayed_copy, ray_local):
    (replayed_copy / "replays/lr2/zarr.json").write_text('{"broken')
    info = replay_cli("info", str(replayed_copy))
    assert info.returncode == 0 and "lr2: cannot be read:" in info.stdout
    said = []
    analyze(replayed_copy, progress=said.append)
    assert any(m.startswith("warning: replay lr2 cannot be read, so it is not analysed") for m in said), said
    report = replay_cli("report", str(replayed_copy))
    assert report.returncode == 0
    assert "warning: replay lr2 cannot be read and is left out of the report" in report.stderr
    assert "Replay lr2 cannot be read" in (replayed_copy / "report.html").read_text()
