"""`replay analyze`, `report` and `compare` on checkpoints replay did not record: a real transformers Trainer
run's checkpoint-* folders, analysed in a folder and in an S3 bucket (the tests' SeaweedFS), on Ray."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from replay.analysis.results import read_distances, read_metrics
from replay.analysis.series import INTO
from replay.store import RunStore
from replay.store.location import Location
from tests.conftest import error_line, replay_cli
from tests.head_norms import assert_fused_head_norms

N_HEAD = 4


@pytest.fixture(scope="module")
def trainer_out(tmp_path_factory):
    """A real Trainer run of a tiny GPT-2: 8 steps, a checkpoint every 2, the loss logged every step."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    out = tmp_path_factory.mktemp("trainer") / "out"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=N_HEAD,
                                       bos_token_id=0, eos_token_id=0))
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 40, (32, 16))]
    args = TrainingArguments(str(out), max_steps=8, save_steps=2, logging_steps=1, per_device_train_batch_size=4,
                             report_to=[], use_cpu=True, learning_rate=1e-2, disable_tqdm=True,
                             dataloader_num_workers=0)
    Trainer(model=model, args=args, train_dataset=data).train()
    return out


def _weights(out, step: int) -> dict[str, torch.Tensor]:
    return load_file(out / f"checkpoint-{step}" / "model.safetensors")


def _check_head_norms(table, out, row: int, step: int) -> None:
    w = _weights(out, step)   # GPT-2's Conv1D keeps (in, out): as nn.Linear's, transposed
    for layer in range(2):
        assert_fused_head_norms({"spectral_head": table["spectral_head"][row]}, layer,
                                w[f"transformer.h.{layer}.attn.c_attn.weight"].T,
                                w[f"transformer.h.{layer}.attn.c_proj.weight"].T, N_HEAD)


def test_a_trainers_checkpoints_are_analysed_reported_and_compared_without_a_recording(trainer_out, tmp_path,
                                                                                        ray_local):
    out = tmp_path / "out"
    shutil.copytree(trainer_out, out)
    result = replay_cli("analyze", str(out), "--workers", "2", "--spike", "6", "--json")
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["computed"] == 4 and [s["spike"] for s in answer["spikes"]] == [6]
    table = read_metrics(out / INTO)
    assert table["step"].tolist() == [2, 4, 6, 8]
    _check_head_norms(table, out, 2, 6)
    assert np.isnan(table["update_rel"][0]).all() and np.isfinite(table["update_rel"][1:]).all()
    logged = {h["step"] - 1: h["loss"] for h in json.loads((out / "checkpoint-8" / "trainer_state.json").read_text())
              ["log_history"] if "loss" in h}
    assert dict(map(tuple, RunStore.open(out / INTO).manifest.series.losses)) == logged

    assert "wrote" in replay_cli("report", str(out)).stdout
    info = replay_cli("info", str(out)).stdout
    assert f"analysis of hf-trainer checkpoints replay did not record  {out / INTO}" in info
    assert "step 6: given with --spike" in info and "4 checkpoints analysed (2, 4, 6, 8)" in info
    html = (out / INTO / "report.html").read_text()
    assert "hf-trainer checkpoints replay did not record" in html and html.count('<img class="figure"') >= 2

    again = json.loads(replay_cli("analyze", str(out), "--workers", "2", "--json").stdout)
    assert again["computed"] == 0 and again["already_done"] == 4
    assert [e["step"] for e in RunStore.open(out / INTO).spikes] == [6]   # the step given before is kept
    # a checkpoint rewritten in place is analysed again, and only it
    rewritten = {k: v * 1.5 for k, v in _weights(out, 4).items()}
    save_file(rewritten, out / "checkpoint-4" / "model.safetensors", metadata={"format": "pt"})
    redone = json.loads(replay_cli("analyze", str(out), "--workers", "2", "--json").stdout)
    assert 1 <= redone["computed"] <= 4 and redone["already_done"] >= 0
    _check_head_norms(read_metrics(out / INTO), out, 1, 4)

    # another "run": a copy with one tensor changed at step 8; the distances are exactly that change
    other = tmp_path / "other"
    shutil.copytree(trainer_out, other, ignore=shutil.ignore_patterns(INTO))
    changed = _weights(other, 8)
    key = "transformer.h.1.mlp.c_fc.weight"
    changed[key] = changed[key] + 0.25
    save_file(changed, other / "checkpoint-8" / "model.safetensors", metadata={"format": "pt"})
    compared = replay_cli("compare", str(trainer_out), str(other), "--workers", "2", "--json")
    assert compared.returncode == 0, compared.stderr
    distances = json.loads(compared.stdout)
    assert distances["steps"] == [2, 4, 6, 8]
    column = distances["tensors"].index("/state/replicated/model/" + key)
    assert [row[column] for row in distances["max_abs"]] == pytest.approx([0, 0, 0, 0.25])
    assert max(max(row) for row in distances["max_abs"][:3]) == 0.0
    assert list(read_distances(trainer_out / INTO)) == [distances["table"].split("/")[-1]]


def test_checkpoints_in_a_bucket_are_analysed_there(trainer_out, s3_store, ray_local, tmp_path):
    for path in sorted(trainer_out.rglob("*")):
        if path.is_file() and INTO not in path.parts:
            (s3_store / "out" / str(path.relative_to(trainer_out))).write(path.read_bytes())
    result = replay_cli("analyze", f"{s3_store}/out", "--workers", "2")
    assert result.returncode == 0, result.stderr
    table = read_metrics(s3_store / "out" / INTO)
    assert table["step"].tolist() == [2, 4, 6, 8]
    _check_head_norms(table, trainer_out, 3, 8)
    report = replay_cli("report", f"{s3_store}/out", "-o", str(tmp_path / "r.html"))
    assert report.returncode == 0 and (tmp_path / "r.html").stat().st_size > 10_000


def test_what_is_not_a_checkpoint_folder_is_refused_in_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    line = error_line(replay_cli("analyze", str(tmp_path)))
    assert "holds no checkpoints replay can read" in line and "notes.txt" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]   # nothing written
    assert Location.parse(tmp_path).children() == ["notes.txt"]
