"""`replay export` of the reference 2-rank recording, read back by DCP's own `dcp.load` into a fresh built-in
model; its refusals in one line (the in-process API's tests: tests/recorder/test_dcp.py)."""

from __future__ import annotations

import torch.distributed.checkpoint as dcp

from replay.store import RunStore
from replay.store.dcp import quiet_single_process
from replay.train.model import build_model
from tests.conftest import error_line, replay_cli, tensors_equal


def test_export_writes_the_checkpoints_model_that_dcp_loads_bit_for_bit(two_rank_store, tmp_path):
    result = replay_cli("export", str(two_rank_store), "--step", "10", "--to", str(tmp_path / "dcp"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("exported checkpoint 10") and "model only" in result.stdout
    store = RunStore.open(two_rank_store)
    cfg = store.manifest.config
    state = {"model": build_model(cfg.model, cfg.model.vocab_size or 256, seed=123).state_dict()}
    with quiet_single_process():
        dcp.load(state, checkpoint_id=tmp_path / "dcp")
    assert tensors_equal(state["model"], store.read_model(10, list(state["model"])))


def test_export_refusals_are_one_line(two_rank_store, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    for args, message in [(["--step", "7", "--to", str(tmp_path / "a")], "no committed checkpoint at step 7"),
                          (["--step", "10", "--to", str(tmp_path / "full")], "is not an empty directory")]:
        result = replay_cli("export", str(two_rank_store), *args)
        assert result.returncode == 2 and message in error_line(result), result.stderr
    assert not (tmp_path / "a").exists()
