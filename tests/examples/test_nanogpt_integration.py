"""examples/nanogpt: a nanoGPT-style script of a user's own, recorded under torchrun and replayed, bisected and
analysed by the product's commands, as its README says. Every run is a real process (torchrun, gloo)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from replay.launch.script import ScriptServer
from replay.replayer.replays import ReplayRequest, run
from replay.store import RunStore
from replay.store.overrides import Overrides
from tests.conftest import REPO, error_line, replay_cli, tree_snapshot
from tests.examples.conftest import DETERMINISM, assert_same_run
from tests.examples.planted import plant_nanogpt_run
from tests.head_norms import assert_fused_head_norms

EXAMPLE = REPO / "examples" / "nanogpt"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _train(workdir: Path, *args: str, launcher: list[str] | None = None, env: dict | None = None,
           script: Path = EXAMPLE / "train.py") -> subprocess.CompletedProcess:
    """The example's script, as its user runs it: from their own directory, not through replay."""
    cmd = [*(launcher or [sys.executable]), str(script), *args]
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)} | (env or {})
    return subprocess.run(cmd, cwd=workdir, env=full, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("nanogpt") / "data"
    done = subprocess.run([sys.executable, str(EXAMPLE / "prepare.py"), "--out", str(out), "--bytes", "200000"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def torchrun_store(data_dir) -> Path:
    """40 steps on 2 ranks under torchrun, checkpoints every 10."""
    store = data_dir.parent / "ddp"
    done = _train(data_dir.parent, f"--data_dir={data_dir}", f"--store={store}", "--max_iters=40",
                  "--checkpoint_every=10", launcher=TORCHRUN)
    assert done.returncode == 0, done.stderr
    return store


@pytest.fixture(scope="module")
def served(torchrun_store) -> Iterator[ScriptServer]:
    """The recording's script kept up between this file's replays of it (docs/your-loop.md), started at the first."""
    with ScriptServer(RunStore.open(torchrun_store).manifest.command) as server:
        yield server


def test_a_recording_trains_as_the_script_without_replay_bit_for_bit(data_dir, tmp_path):
    """The script with its replay lines and without them (--record=False), dropout on (torch's generator
    draws the masks as well as the offsets, the first batch's ahead of the first step), rank 0 evaluating at
    step 0 through the same get_batch: every step's loss and the final weights are the same, and the
    recording says in one line what it changed (deterministic algorithms)."""
    args = [f"--data_dir={data_dir}", "--max_iters=12", "--dropout=0.1"]
    recorded = _train(tmp_path, *args, f"--store={tmp_path / 'run'}", f"--out={tmp_path / 'recorded.pt'}")
    assert recorded.returncode == 0, recorded.stderr
    assert recorded.stderr.count(DETERMINISM) == 1
    plain = _train(tmp_path, *args, "--record=False", f"--out={tmp_path / 'plain.pt'}")
    assert plain.returncode == 0 and "replay" not in plain.stderr, plain.stderr
    assert_same_run(tmp_path / "recorded.pt", tmp_path / "plain.pt", steps=12)


def test_torchrun_records_each_ranks_draws_and_the_command(torchrun_store, data_dir):
    store = RunStore.open(torchrun_store)
    m = store.manifest
    assert m.status == "complete" and m.world_size == 2 and m.launcher == "custom"
    assert m.command.launcher == "torchrun" and m.command.world_size == 2
    assert str(EXAMPLE / "train.py") in m.command.argv and m.command.cwd == str(data_dir.parent)
    script = str(EXAMPLE / "train.py")
    digest = m.command.files[script]
    assert digest == hashlib.sha256(Path(script).read_bytes()).hexdigest()
    assert [c.step for c in store.checkpoints()] == [0, 10, 20, 30, 40]
    ids = store.read_steps(["sample_ids"])["sample_ids"]
    assert ids.shape == (40, 2, 2, 4)   # step, rank, micro-batch, sample: random offsets into train.bin
    n_tokens = (data_dir / "train.bin").stat().st_size // 2
    assert ids.min() >= 0 and ids.max() < n_tokens - 32
    assert not np.array_equal(ids[:, 0], ids[:, 1])   # each rank draws its own (seeded by rank)


def test_a_window_replays_bit_for_bit_through_the_recorded_command(torchrun_store, served):
    result = replay_cli("run", str(torchrun_store), "--from", "15", "--to", "22", "--verify", "--json",
                        ranks=served)
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    v = answer["verification"]
    assert (v["steps"], v["bitwise"], v["level"], v["divergence"]) == ([10, 22], True, "state", None)
    replay = RunStore.open(answer["replay"])
    assert replay.manifest.status == "complete" and [c.step for c in replay.checkpoints()] == [23]


def test_ddp_ranks_kept_up_serve_windows_one_after_another_bit_for_bit(torchrun_store, tmp_path):
    """Both torchrun ranks of the script stay up (their process group too) through a plain window, a halved
    learning rate and a plain window again: each plain one equals the record at the level of the state."""
    store = tmp_path / "ddp"
    shutil.copytree(torchrun_store, store, ignore=shutil.ignore_patterns("replays"))
    requests = [ReplayRequest(20, 22), ReplayRequest(12, 14, overrides=Overrides(lr_scale=0.5)),
                ReplayRequest(10, 11)]
    with ScriptServer(RunStore.open(store).manifest.command) as server:
        outcomes = []
        for req in requests:
            result = run(store, req, ranks=server)
            outcomes.append((result.verification.bitwise, result.verification.level, tuple(server.pids)))
    assert [o[:2] for o in outcomes] == [(True, "state"), (False, "state"), (True, "state")]
    assert len({o[2] for o in outcomes}) == 1 and len(outcomes[0][2]) == 2   # the same two processes throughout


def test_a_session_serves_its_replays_on_the_script_started_once(torchrun_store, tmp_path):
    """`replay session` as a user types it, one `replay run` per line: a plain window, an emulated BF16
    attention from step 21, a line with a bad option and a plain window again, on the torchrun ranks started
    once. Each replay's verdict is the one its own command would give; the bad line fails alone."""
    store = tmp_path / "ddp"
    shutil.copytree(torchrun_store, store, ignore=shutil.ignore_patterns("replays"))
    lines = ("# two plain windows around a counterfactual\n"
             "--from 12 --to 14 --verify\n"
             "run --from 21 --to 22 --attention fa2-emu:dtype=bf16 --verify\n"
             "--from 12 --to 14 --no-such-option\n"
             "\n"
             "--from 25 --to 27 --name again\n")
    result = replay_cli("session", str(store), input=lines, process=True)
    assert result.returncode == 2, result.stderr
    assert "--no-such-option" in error_line(result)
    assert "session: 4 replays, 1 failed (line 4 of the input); the script was started once" in result.stderr
    verdicts = {}
    for name in ("steps-12-14", "again"):
        verdicts[name] = RunStore.open(store / "replays" / name).manifest.replay_spec.verification
    counterfactual = next(p for p in (store / "replays").iterdir() if p.name.startswith("steps-21-22-"))
    verdicts["bf16"] = RunStore.open(counterfactual).manifest.replay_spec.verification
    assert [(v.bitwise, v.level) for v in (verdicts["steps-12-14"], verdicts["again"])] == [(True, "state")] * 2
    assert verdicts["bf16"].divergence.step == 21 and sorted(p.name for p in (store / "replays").iterdir()) == \
        sorted(["steps-12-14", "again", counterfactual.name])


def test_emulated_bf16_attention_on_layer_1_diverges_exactly_at_from(torchrun_store, served):
    result = replay_cli("run", str(torchrun_store), "--from", "15", "--to", "18", "--verify", "--json",
                        "--attention", "reference-emu:dtype=bf16", "--layers", "1", ranks=served)
    assert result.returncode == 0, result.stderr
    v = json.loads(result.stdout)["verification"]
    assert not v["bitwise"] and v["divergence"]["step"] == 15   # steps 10..14 were bit for bit


def test_bf16_autocast_from_from_on_through_loop_autocast(torchrun_store, served):
    result = replay_cli("run", str(torchrun_store), "--from", "15", "--to", "16", "--verify", "--json",
                        "--precision", "bf16", ranks=served)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["verification"]["divergence"]["step"] == 15


def test_a_halved_learning_rate_changes_the_state_at_from_and_the_loss_one_step_later(torchrun_store, served):
    """The step at --from is computed before its scaled update: its loss is the record's, the state after its
    update is not (the verdict's first divergence), and the loss differs from the next step on."""
    result = replay_cli("run", str(torchrun_store), "--from", "15", "--to", "17", "--verify", "--json",
                        "--lr-scale", "0.5", ranks=served)
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    d = answer["verification"]["divergence"]
    assert d["step"] == 15 and d["scalars"] == [] and d["state"]["ranks"] == [0, 1], d
    assert answer["reached"]["counters"] == ["optimizer steps at the scaled learning rate"]
    assert answer["reached"]["counts"] == [[2], [2], [2]]   # each step, on each of the 2 ranks
    replayed = RunStore.open(answer["replay"]).read_steps(["loss"], start=16)["loss"]
    assert (replayed != RunStore.open(torchrun_store).read_steps(["loss"], start=16, stop=18)["loss"]).all()


def test_a_scripts_step_captured_by_one_command_is_compared_by_another(torchrun_store):
    """The script's step as recorded, captured (`--capture`, layer 1's attention kept whole) by one command's
    replay and compared by another's with layer 1 on emulated BF16: every tensor before layer 1's O has the
    trace's bits, and O is the first difference, with its deviation from the kept tensor."""
    store = str(torchrun_store)
    taken = replay_cli("diff", store, "--step", "12", "--capture", "rec", "--keep", "attention 1")
    assert taken.returncode == 0, taken.stderr
    changed = replay_cli("diff", store, "--step", "12", "--against", "rec", "--attention", "reference-emu:dtype=bf16",
                         "--layers", "1", "--json")
    assert changed.returncode == 0, changed.stderr
    answer = json.loads(changed.stdout)
    first = answer["first"]
    assert (first["where"], first["what"]) == ("attention 1", "O") and 0 < first["deviation"]["relative"] < 0.1
    assert first["order"] > 10 and all(d["order"] >= first["order"] for d in answer["differences"])


def test_a_scripts_run_diffed_against_its_counterfactual_replay_parts_at_the_replays_first_step(torchrun_store,
                                                                                                  served):
    """`replay diff RUN REPLAY --step N` of a script, the replay's layer 1 on emulated BF16 attention from step 12:
    step 12 replayed twice through the script (from checkpoint 10), every tensor of rank 0's step traced by its
    loop, side A as recorded (its replay checked against the record: no note) and side B as the replay ran it.
    Layer 1's attention output is the first difference, layer 0's heads' O are untouched, the config change is
    named, and both replays are removed; step 13, after the replay's overrides acted, is refused; step 11, before
    its window, is the run's on both sides, with no change of config between them."""
    store = str(torchrun_store)
    made = replay_cli("run", store, "--from", "12", "--to", "13", "--attention", "reference-emu:dtype=bf16", "--layers",
                      "1", "--name", "cf-diff", "--json", ranks=served)
    assert made.returncode == 0, made.stderr
    replay = f"{store}/replays/cf-diff"
    before = tree_snapshot(torchrun_store)
    done = replay_cli("diff", store, replay, "--step", "12", "--json")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    first = answer["first"]
    assert (first["phase"], first["where"], first["what"]) == ("forward", "attention 1", "O"), first
    assert 0 < first["deviation"]["relative"] < 0.1 and answer["notes"] == []
    assert answer["changes"]["model.attention"][1] == "sdpa;1=reference-emu:dtype=bf16", answer["changes"]
    o = {(h["layer"], h["head"]): h["o"] for h in answer["heads"]}
    assert sorted(o) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert o[(0, 0)] == o[(0, 1)] == 0 and min(o[(1, 0)], o[(1, 1)]) > 0
    grads = {d["where"] for d in answer["differences"] if d["phase"] == "gradient"}
    assert "transformer.h.1.attn.c_attn.weight" in grads and "transformer.wte.weight" in grads
    assert tree_snapshot(torchrun_store) == before
    later = replay_cli("diff", store, replay, "--step", "13")
    assert later.returncode == 2 and "does not hold the run's state at step 13" in error_line(later)
    before_window = replay_cli("diff", store, replay, "--step", "11", "--json")   # the replay's fast-forward
    assert before_window.returncode == 0, before_window.stderr
    answer = json.loads(before_window.stdout)
    assert answer["first"] is None and answer["changes"] == {}, answer["changes"]   # both ran it as recorded


def test_diffs_a_script_cannot_run_are_refused_in_one_line_before_it_starts(torchrun_store):
    store = str(torchrun_store)
    before = tree_snapshot(torchrun_store)
    for args, says in [(("--step", "12", "--rank", "all"), "a script's ranks each train their own micro-batches"),
                       (("--step", "40"), "not step 40"),
                       (("--step", "12", "--rank", "2"), "recorded on ranks 0..1")]:
        done = replay_cli("diff", store, *args)
        assert done.returncode == 2 and says in error_line(done), (args, done.stderr)
    assert tree_snapshot(torchrun_store) == before


def test_an_edited_script_is_refused_unless_allowed(data_dir, tmp_path):
    script = tmp_path / "train.py"
    shutil.copy(EXAMPLE / "train.py", script)
    store = tmp_path / "run"
    done = _train(tmp_path, f"--data_dir={data_dir}", f"--store={store}", "--max_iters=12",
                  "--checkpoint_every=6", script=script)
    assert done.returncode == 0, done.stderr
    script.write_text(script.read_text().replace("learning_rate, min_lr", "learning_rate,  min_lr"))
    before = tree_snapshot(store)
    line = error_line(replay_cli("run", str(store), "--from", "7", "--to", "9"))
    assert str(script) in line and "changed since the run was recorded" in line and "--allow-changed" in line
    assert tree_snapshot(store) == before
    allowed = replay_cli("run", str(store), "--from", "7", "--to", "9", "--verify", "--allow-changed")
    assert allowed.returncode == 0 and "bit for bit" in allowed.stdout   # a whitespace edit changes no bits


def test_a_killed_recording_resumes_to_the_uninterrupted_run(data_dir, tmp_path):
    args = [f"--data_dir={data_dir}", "--max_iters=24", "--checkpoint_every=8"]
    whole = _train(tmp_path, *args, f"--store={tmp_path / 'whole'}")
    assert whole.returncode == 0, whole.stderr
    cut = tmp_path / "cut"
    killed = _train(tmp_path, *args, f"--store={cut}", env={"REPLAY_FAULT": "before-commit:16:0"})
    assert killed.returncode == -signal.SIGKILL
    assert [c.step for c in RunStore.open(cut).checkpoints()] == [0, 8]
    resumed = _train(tmp_path, *args, f"--store={cut}", "--resume=True")
    assert resumed.returncode == 0, resumed.stderr
    a, b = RunStore.open(tmp_path / "whole"), RunStore.open(cut)
    assert [r.from_step for r in b.manifest.resumes] == [8]
    for name in ("loss", "grad_norm", "sample_ids"):
        assert np.array_equal(a.read_steps([name])[name], b.read_steps([name])[name]), name
    final_a, final_b = a.read_shard(24, 0), b.read_shard(24, 0)
    for key, tensor in final_a["state"]["replicated"]["model"].items():
        assert tensor.equal(final_b["state"]["replicated"]["model"][key]), key


def test_analyze_reads_the_nanogpt_layout(torchrun_store):
    """Per-head spectral norms of the analysis against an SVD of the stored c_attn weight, which nn.Linear
    keeps as (out, in): head h's W_Q is rows h*16:(h+1)*16 of its first third."""
    from replay.analysis import jobs, tasks

    store = RunStore.open(torchrun_store)
    items, _ = jobs.plan_metrics(RunStore.open(torchrun_store, mode="a"))
    item = next(i for i in items if i.ckpt.step == 40)
    values = tasks.compute_metrics(item)
    shard = store.read_shard(40, 0)["state"]["replicated"]["model"]
    for layer in range(2):   # c_attn [3 * 32, 32], c_proj [32 out, 32 in]
        assert_fused_head_norms(values, layer, shard[f"transformer.h.{layer}.attn.c_attn.weight"],
                                shard[f"transformer.h.{layer}.attn.c_proj.weight"], n_head=2)
    assert np.isnan(values["max_logit"]).all()   # the probe runs the built-in model only


def test_bisect_finds_the_batch_planted_in_the_token_file(tmp_path, ray_local):
    """Record once, then write random bytes above 127 (never in Python source) over every window drawn at
    step 95, record again (the same RNG draws the same windows; tests/examples/planted.py): its loss jumps
    there, and a data bisect names that step's batch."""
    store = tmp_path / "spiked"
    plant_nanogpt_run(store, tmp_path / "data")   # checkpoints every 4: the last before 95 is 92
    assert [e["step"] for e in RunStore.open(store).spikes] == [95]   # the recording's own detector saw it
    result = replay_cli("bisect", str(store), "--by", "data", "--json")
    assert result.returncode == 0, result.stderr
    verdict = json.loads(result.stdout)["verdict"]
    assert verdict["batches"] == [95] and verdict["samples"] is None
    assert "one at a time in this process, each with 1 of the script's rank(s), kept up" in result.stderr
    assert "started afresh" not in result.stderr
