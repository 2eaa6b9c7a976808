"""examples/hf_trainer: a transformers Trainer run of a Llama built from a config, recorded through
TrainerRecorder in one process (two DataLoader workers, 18 samples in batches of 4 and steps of 2: every
epoch's last step trains on one micro-batch of 2 samples) and under torchrun, killed and resumed, and
replayed by the product's commands through the recorded command, the Trainer started by recorder.train or
built with the recorder among its callbacks (misuse of the callback: test_hf_trainer.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from replay.analysis.results import read_metrics
from replay.store import RunStore
from replay.store.run_store import micro_batches
from tests.conftest import REPO, error_line, replay_cli, tree_snapshot
from tests.examples.conftest import assert_resumed_as_recorded, assert_same_run

EXAMPLE = REPO / "examples" / "hf_trainer"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
BLOCK = 32
SAMPLES = 18   # 5 batches of 4 an epoch, the last of 2: 3 steps of 2 micro-batches, the last of one
SMALL_EPOCHS = (f"--samples={SAMPLES}", "--dataloader_num_workers=2")
ONE_PROCESS = ("--save_steps=5", *SMALL_EPOCHS, "--logging_steps=1")   # the Trainer's own checkpoints too
# the example under a callback that ends its process (os._exit, no cleanup) as the Trainer begins a step
KILLED = """
import os, runpy, sys, time, transformers
from replay.store import RunStore
class Kill(transformers.TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == int(os.environ["KILL_AT"]):
            # once the checkpoint it names, written in the background, is committed (a loaded machine lags)
            deadline = time.monotonic() + 120
            while (int(os.environ["KILL_AFTER_COMMIT"]) not in [c.step for c in RunStore.open(
                    os.environ["KILL_STORE"]).checkpoints()] and time.monotonic() < deadline):
                time.sleep(0.05)
            os._exit(9)
init = transformers.Trainer.__init__
transformers.Trainer.__init__ = lambda self, *a, **k: (init(self, *a, **k), self.add_callback(Kill()))[0]
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
# the example with its callbacks given to each Trainer after it was built (trainer.add_callback)
ADDED_LATER = """
import runpy, sys, transformers
init = transformers.Trainer.__init__
def given_later(self, *args, callbacks=None, **kwargs):
    init(self, *args, **kwargs)
    for callback in callbacks or []:
        self.add_callback(callback)
transformers.Trainer.__init__ = given_later
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _train(workdir: Path, *args: str, launcher: list[str] | None = None,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([*(launcher or [sys.executable]), str(EXAMPLE / "train.py"), *args], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_trainer")


def _record(runs: Path, token_file: Path, name: str, *args: str, launcher: list[str] | None = None,
            env: dict[str, str] | None = None, returncode: int = 0) -> Path:
    store = runs / name
    done = _train(runs, f"--data={token_file}", f"--store={store}", f"--output_dir={store}-out",
                  "--max_steps=20", "--checkpoint_every=10", *args, launcher=launcher, env=env)
    assert done.returncode == returncode, done.stderr
    return store


@pytest.fixture(scope="module")
def one_process(runs, token_file) -> Path:
    """Its `--out` (every step's logged loss, the final weights): one.pt beside it."""
    return _record(runs, token_file, "one", *ONE_PROCESS, f"--out={runs / 'one.pt'}")


def _first_step_loss(store: RunStore, token_file: Path) -> float:
    """Step 0's loss recomputed: checkpoint 0's weights in transformers' own eager Llama, on every rank's
    recorded samples of that step, as the mean token loss over all of them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokens = np.memmap(token_file, dtype=np.uint16, mode="r")
    config = AutoConfig.for_model("llama", vocab_size=256, hidden_size=32, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=BLOCK)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.load_state_dict(store.read_shard(0, 0)["state"]["replicated"]["model"], strict=False)
    ids = store.read_steps(["sample_ids"])["sample_ids"][0].ravel()
    x = torch.stack([torch.from_numpy(tokens[i * BLOCK:(i + 1) * BLOCK].astype(np.int64)) for i in ids])
    with torch.no_grad():
        logits = model(input_ids=x).logits[:, :-1]
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1)))


def test_the_record_holds_each_steps_dataset_indices_and_its_own_loss(one_process, token_file):
    """The step's loss is the model's mean token loss over the step's samples (both micro-batches), not
    the Trainer's logged average."""
    store = RunStore.open(one_process)
    m = store.manifest
    assert (m.status, m.world_size, m.layout["o"], m.config.model.attention) == \
        ("complete", 1, "model.layers.{layer}.self_attn.o_proj.weight", "sdpa")
    assert [c.step for c in store.checkpoints()] == [0, 10, 20]
    steps = store.read_steps(["sample_ids", "loss"])
    ids = steps["sample_ids"]
    n_blocks = (token_file.stat().st_size // 2 - 1) // BLOCK
    assert ids.shape == (20, 1, 2, 4) and ids.max() < SAMPLES < n_blocks
    for epoch in range(6):   # every sample once an epoch, in another order each time; its last step is partial
        its = ids[3 * epoch:3 * epoch + 3, 0]
        assert sorted(its[its >= 0].tolist()) == list(range(SAMPLES))
        assert [[len(b) for b in micro_batches(step)] for step in its] == [[4, 4], [4, 4], [2]]
    assert not np.array_equal(ids[0], ids[3])
    assert steps["loss"][0] == pytest.approx(_first_step_loss(store, token_file), rel=1e-5)
    saved = sorted(p.name for p in Path(f"{one_process}-out").glob("checkpoint-*"))
    assert saved == [f"checkpoint-{s}" for s in (10, 15, 20, 5)]


def test_a_recording_trains_as_trainer_train_without_replay_bit_for_bit(one_process, runs, token_file):
    """The same Trainer run by `trainer.train()` alone (--record=False): the Trainer's logged loss of every
    step and the final weights are the recording's."""
    done = _train(runs, f"--data={token_file}", f"--output_dir={runs / 'plain-out'}", "--max_steps=20", *ONE_PROCESS,
                  "--record=False", f"--out={runs / 'plain.pt'}")
    assert done.returncode == 0, done.stderr
    assert_same_run(runs / "one.pt", runs / "plain.pt", steps=20)


def test_a_window_replays_bit_for_bit_and_one_query_head_diverges_at_from(one_process):
    """From checkpoint 10 (the middle of an epoch: the Trainer skips to it itself) over two epoch ends
    (steps 11 and 14 train on 2 samples), the DataLoader's workers fetching ahead; neither replay writes a
    checkpoint of the Trainer's own into the recording's output_dir."""
    trainer_out = tree_snapshot(Path(f"{one_process}-out"))
    result = replay_cli("run", str(one_process), "--from", "12", "--to", "15", "--verify", "--json")
    assert result.returncode == 0, result.stderr
    v = json.loads(result.stdout)["verification"]
    assert (v["steps"], v["bitwise"], v["level"], v["divergence"]) == ([10, 15], True, "state", None)
    result = replay_cli("run", str(one_process), "--from", "12", "--to", "13", "--verify", "--json",
                        "--attention", "fa2-emu:dtype=bf16", "--heads", "1.3")
    assert result.returncode == 0, result.stderr
    v = json.loads(result.stdout)["verification"]
    assert not v["bitwise"] and v["divergence"]["step"] == 12
    assert tree_snapshot(Path(f"{one_process}-out")) == trainer_out


def test_a_trainer_built_with_the_recorder_records_as_recorder_train_and_replays_bit_for_bit(one_process, runs,
                                                                                          token_file):
    """Trainer(..., callbacks=[recorder]) and a plain trainer.train() (--callback_form=True): the steps
    recorder.train records, bit for bit, and a replay from checkpoint 10 (the Trainer's own resume, reached
    through its train) bit for bit."""
    store = _record(runs, token_file, "callback_form", "--callback_form=True", *SMALL_EPOCHS)
    fields = ["sample_ids", "loss", "grad_norm", "lr"]
    ours, theirs = RunStore.open(store).read_steps(fields), RunStore.open(one_process).read_steps(fields)
    assert all(np.array_equal(ours[f], theirs[f]) for f in fields)
    result = replay_cli("run", str(store), "--from", "12", "--to", "15", "--verify", "--json")
    assert result.returncode == 0, result.stderr
    v = json.loads(result.stdout)["verification"]
    assert (v["steps"], v["bitwise"], v["level"], v["divergence"]) == ([10, 15], True, "state", None)


def test_a_recorder_added_after_the_trainer_was_built_is_refused_in_one_line_before_the_store(runs, token_file):
    """The Trainer's own train() with the recorder added by trainer.add_callback: no replay could start it
    past step 0, so its recording is refused as it starts, and no store is made."""
    wrapper = runs / "added_later.py"
    wrapper.write_text(ADDED_LATER)
    store = runs / "added_later"
    done = _train(runs, f"--data={token_file}", f"--store={store}", f"--output_dir={store}-out", "--max_steps=4",
                  "--callback_form=True", launcher=[sys.executable, str(wrapper)])
    lines = [line for line in done.stderr.splitlines() if "TrainerRecorder" in line]
    assert done.returncode == 2 and "Traceback" not in done.stderr and len(lines) == 1, done.stderr
    assert lines[0].endswith("rank 0: TrainerRecorder: a Trainer given the recorder after it was built "
                             "(trainer.add_callback) and started by its own train() could not be started past step 0 "
                             "by a replay: build the Trainer with callbacks=[recorder] or start it with "
                             "recorder.train(trainer)")
    assert not store.exists()


def test_a_killed_recording_resumes_from_the_store_bit_for_bit(one_process, runs, token_file):
    """Killed as step 18 begins (checkpoint 10, 2 batches into its epoch, committed), then run again
    with --resume=True: its steps and final weights are the uninterrupted recording's, bit for bit."""
    wrapper = runs / "killed.py"
    wrapper.write_text(KILLED)
    store = runs / "killed"
    args = (f"--data={token_file}", f"--store={store}", f"--output_dir={store}-out", "--max_steps=20",
            "--checkpoint_every=10", *ONE_PROCESS)
    done = _train(runs, *args, launcher=[sys.executable, str(wrapper)],
                  env={"KILL_AT": "18", "KILL_AFTER_COMMIT": "10", "KILL_STORE": str(store)})
    assert done.returncode == 9, done.stderr
    killed = RunStore.open(store)
    assert killed.manifest.status == "running" and [c.step for c in killed.checkpoints()][-1] == 10
    done = _train(runs, *args, "--resume=True")
    assert done.returncode == 0, done.stderr
    assert_resumed_as_recorded(store, one_process, resumed_from=10, checkpoint=20)


def test_a_killed_replay_resumes_from_its_own_checkpoint_to_the_uninterrupted_one(one_process):
    """A replay killed as it commits checkpoint 16, resumed from its 14 (the Trainer skipping to it in its
    epoch again), equals the same replay run through, over the epoch ends after steps 14 and 17."""
    window = ["--from", "11", "--to", "19", "--checkpoint-every", "2", "--skip", "13"]
    whole = replay_cli("run", str(one_process), *window, "--name", "whole")
    assert whole.returncode == 0, whole.stderr
    killed = replay_cli("run", str(one_process), *window, "--name", "cut", env={"REPLAY_FAULT": "before-commit:16:0"})
    assert killed.returncode != 0
    resumed = replay_cli("run", str(one_process), *window, "--name", "cut", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    a, b = (RunStore.open(one_process / "replays" / name) for name in ("whole", "cut"))
    assert [r.from_step for r in b.manifest.resumes] == [14]
    fields = ["sample_ids", "loss", "grad_norm", "lr"]
    x, y = a.read_steps(fields), b.read_steps(fields)
    assert all(np.array_equal(x[f], y[f], equal_nan=True) for f in fields)


def test_under_torchrun_each_rank_records_its_own_indices_and_replays_bit_for_bit(runs, token_file):
    store = _record(runs, token_file, "ddp", launcher=TORCHRUN)
    m = RunStore.open(store).manifest
    assert (m.world_size, m.command.launcher) == (2, "torchrun")
    steps = RunStore.open(store).read_steps(["sample_ids", "loss"])
    ids = steps["sample_ids"]
    assert ids.shape == (20, 2, 2, 4)
    assert all(np.intersect1d(ids[s, 0], ids[s, 1]).size == 0 for s in range(20))   # the ranks' shares
    # each rank's loss is its share of the step's tokens over both ranks': their mean is the step's mean
    assert steps["loss"][0] == pytest.approx(_first_step_loss(RunStore.open(store), token_file), rel=1e-5)
    result = replay_cli("run", str(store), "--from", "11", "--to", "13", "--verify", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["verification"]["bitwise"] is True


def test_a_skipped_step_runs_without_its_update_and_its_schedule_moves_on(one_process):
    """The Trainer runs every step it fetches: --skip 10 leaves the weights after step 10 those before it
    (the parent's checkpoint 10), while step 11 has the learning rate it had in the record."""
    result = replay_cli("run", str(one_process), "--from", "10", "--to", "11", "--skip", "10", "--checkpoint-every",
                        "1", "--json")
    assert result.returncode == 0, result.stderr
    replay, parent = RunStore.open(json.loads(result.stdout)["replay"]), RunStore.open(one_process)
    after = replay.read_shard(11, 0)["state"]["replicated"]["model"]
    before = parent.read_shard(10, 0)["state"]["replicated"]["model"]
    assert all(torch.equal(after[k], before[k]) for k in before)
    ours = replay.read_steps(["lr", "loss"], start=11, stop=12)
    theirs = parent.read_steps(["lr", "loss"], start=11, stop=12)
    assert ours["lr"][0] == theirs["lr"][0] and ours["loss"][0] != theirs["loss"][0]


def test_a_precision_change_is_refused_in_one_line_and_leaves_the_store_as_it_was(one_process):
    """The Trainer's autocast is accelerate's: the script refuses --precision as it starts, and the replay
    it never ran is not left in the store."""
    before = tree_snapshot(one_process)
    result = replay_cli("run", str(one_process), "--from", "12", "--to", "13", "--precision", "bf16")
    assert "the training script failed" in error_line(result)
    assert "rank 0: --precision: a Trainer run's autocast is accelerate's" in result.stderr
    assert tree_snapshot(one_process) == before


def test_compare_analyze_and_report_read_trainer_runs_as_any_other(one_process, runs, token_file, ray_local, tmp_path):
    """Another seed's run, compared with this one (the weights' distances, checkpoint by checkpoint);
    this one analysed (every checkpoint, the probe on its first batch) and reported."""
    store = tmp_path / "one"
    shutil.copytree(one_process, store)
    other = _record(runs, token_file, "seed7", "--seed=7")
    result = replay_cli("compare", str(other), str(store), "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["steps"] == [0, 10, 20] and max(out["relative"][0]) > 0.5   # another initialisation
    result = replay_cli("analyze", str(store), "--json")
    assert result.returncode == 0, result.stderr
    table = read_metrics(store)
    assert table["step"].tolist() == [0, 10, 20] and np.isfinite(table["max_logit"]).all()
    assert replay_cli("report", str(store)).returncode == 0 and (store / "report.html").stat().st_size > 10_000
