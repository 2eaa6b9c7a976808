"""`replay export` of the reference 2-rank recording, read back by DCP's own `dcp.load` into a fresh built-in
model; its refusals and failures in one line (a read-only or full target), and an export killed before it is
complete written over by the next (the in-process API's tests: tests/recorder/test_dcp.py)."""

from __future__ import annotations

from pathlib import Path

import torch.distributed.checkpoint as dcp

from replay.store import RunStore
from replay.store.dcp import PARTIAL, quiet_single_process
from replay.train.model import build_model
from tests.conftest import error_line, killed_by_fault, replay_cli, tensors_equal


def _exported(store_path: Path, target: Path) -> None:
    """`replay export` of checkpoint 10 to `target` succeeds, and DCP loads it bit for bit into a fresh model."""
    result = replay_cli("export", str(store_path), "--step", "10", "--to", str(target))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("exported checkpoint 10") and "model only" in result.stdout
    assert not (target / PARTIAL).exists()
    store = RunStore.open(store_path)
    cfg = store.manifest.config
    state = {"model": build_model(cfg.model, cfg.model.vocab_size or 256, seed=123).state_dict()}
    with quiet_single_process():
        dcp.load(state, checkpoint_id=target)
    assert tensors_equal(state["model"], store.read_model(10, list(state["model"])))


def test_export_writes_the_checkpoints_model_that_dcp_loads_bit_for_bit(two_rank_store, tmp_path):
    _exported(two_rank_store, tmp_path / "dcp")


def test_an_export_to_a_read_only_folder_is_one_line_and_the_next_export_works(two_rank_store, tmp_path, read_only):
    (tmp_path / "ro").mkdir()
    result = replay_cli("export", str(two_rank_store), "--step", "10", "--to", str(read_only(tmp_path / "ro") / "dcp"))
    line = error_line(result)
    assert result.returncode == 2 and ("read-only" in line or "permission denied" in line), line
    assert not any((tmp_path / "ro").iterdir())
    _exported(two_rank_store, tmp_path / "dcp")


def test_an_export_to_a_full_disk_is_one_line_leaves_nothing_and_works_once_space_is_freed(two_rank_store,
                                                                                          small_disk):
    disk = small_disk(2048)
    disk.fill(leave_kib=100)                    # the export is about 600 KiB
    result = replay_cli("export", str(two_rank_store), "--step", "10", "--to", str(disk.path / "dcp"))
    line = error_line(result)
    assert result.returncode == 2 and "no space left on the device" in line and "free space there" in line, line
    assert not (disk.path / "dcp").exists()
    disk.free()
    _exported(two_rank_store, disk.path / "dcp")


def test_an_export_killed_before_it_is_complete_is_written_over_by_the_next(two_rank_store, tmp_path):
    killed_by_fault("export-written", "export", str(two_rank_store), "--step", "10", "--to", str(tmp_path / "dcp"))
    assert (tmp_path / "dcp" / PARTIAL).exists()
    _exported(two_rank_store, tmp_path / "dcp")


def test_an_export_to_an_object_store_is_refused_in_one_line_before_anything_is_written(two_rank_store, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = replay_cli("export", str(two_rank_store), "--step", "10", "--to", "s3://bucket/x")
    line = error_line(result)
    assert result.returncode == 2 and "s3://bucket/x" in line and "local directory" in line, line
    assert not any(tmp_path.iterdir())         # not ./s3:/bucket/x


def test_export_refusals_are_one_line(two_rank_store, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    for args, message in [(["--step", "7", "--to", str(tmp_path / "a")], "no committed checkpoint at step 7"),
                          (["--step", "10", "--to", str(tmp_path / "full")], "is not an empty directory")]:
        result = replay_cli("export", str(two_rank_store), *args)
        assert result.returncode == 2 and message in error_line(result), result.stderr
    assert not (tmp_path / "a").exists()
