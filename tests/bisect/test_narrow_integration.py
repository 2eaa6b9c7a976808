"""`replay bisect` on recordings whose cause is known, through the real CLI: real rank processes,
real local Ray, replays in real Zarr stores."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

from replay.bisect.narrow import Bisect, BisectConfig
from replay.errors import UsageError
from replay.store import RunStore
from replay.store.location import Location
from tests.bisect.conftest import DATA_SPIKE_STEP, DEFECT
from tests.conftest import REPO, error_line, killed_by_fault, replay_cli, tree_snapshot


def _bisect(store, *args, env=None) -> dict:
    result = replay_cli("bisect", str(store), *args, "--json", env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_data_bisect_returns_exactly_the_planted_samples(planted_data, ray_local):
    store, planted = planted_data
    session = _bisect(store, "--by", "data")
    v = session["verdict"]
    assert v["spike"] == DATA_SPIKE_STEP
    assert v["batches"] == [DATA_SPIKE_STEP]
    assert v["samples"] == [[DATA_SPIKE_STEP, i] for i in planted]
    assert v["probes"] == len(session["probes"]) <= v["bound"]
    assert session["phases"]["baseline"]["bitwise"]
    # every probe is a replay in the store, judged by the rule; the answer's own probe prevents the spike
    answer = [p for p in session["probes"].values() if p["overrides"].get("drop") == v["samples"]]
    assert len(answer) == 1 and answer[0]["prevented"]
    for key in session["probes"]:
        assert RunStore.open(store / "replays" / key).manifest.status == "complete"

    # the same command again: a finished session, nothing re-run; the samples printed as `replay batch` does
    again = replay_cli("bisect", str(store), "--by", "data")
    assert again.returncode == 0, again.stderr
    assert f"{v['probes']} probes (0 run now" in again.stdout
    batch = replay_cli("batch", str(store), "--step", str(DATA_SPIKE_STEP)).stdout.split("--- ")
    for sample in planted:
        block = next(b for b in batch if f"sample {sample}\n" in b)
        assert "--- " + block in again.stdout
    info = json.loads(replay_cli("info", str(store), "--json").stdout)
    assert [(s["id"], s["status"]) for s in info["bisect"]] == [(session["id"], "complete")]


def test_layer_and_head_bisect_returns_the_planted_defective_head(planted_layer, ray_local):
    session = _bisect(planted_layer, "--by", "heads", "--fix", "attention=eager", "--workers", "1", env=DEFECT)
    v = session["verdict"]
    assert v["layers"] == [1]
    assert v["heads"] == [[1, 0]]
    assert v["probes"] <= v["bound"]
    # the rule saw the recorded breakdown in the plain replay and none in the answer's probe
    probes = session["probes"].values()
    assert any(not p["prevented"] and p["spike_at"] == v["spike"] for p in probes if not p["overrides"])
    assert any(p["prevented"] for p in probes if p["overrides"].get("units") == [[1, 0]])


def test_a_steps_bisect_of_an_attention_counterfactual_prints_the_diff_that_names_the_layer(planted_layer, ray_local,
                                                                                           tmp_path):
    """The planted kernel's run, bisected over steps with exact attention as the counterfactual: the verdict
    prints the `replay diff` of the first step where the counterfactual parts from the record (after the plain
    replay that checkpoints it), which names layer 1's attention, the planted head's, as the first operation
    where they part."""
    store = tmp_path / "run"
    shutil.copytree(planted_layer, store)
    v = _bisect(store, "--by", "steps", "--fix", "attention=eager", "--workers", "1", env=DEFECT)["verdict"]
    first = v["separation"]["first_bit"]
    assert v["window"][0] <= first and v["diff"] == (
        f"replay run {store} --from {first} --to {first} --checkpoint-every 1 --name at-{first} && "
        f"replay diff {store}/replays/at-{first} --step {first} --attention eager"), v
    commands = [shlex.split(part)[1:] for part in v["diff"].split(" && ")]
    made = replay_cli(*commands[0], env=DEFECT)
    assert made.returncode == 0, made.stderr
    diffed = replay_cli(*commands[1], "--json", env=DEFECT)
    assert diffed.returncode == 0, diffed.stderr
    first = json.loads(diffed.stdout)["first"]
    assert (first["phase"], first["where"], first["what"]) == ("forward", "attention 1", "O"), first


def test_a_killed_bisect_resumes_with_fewer_new_probes(spike_store, ray_local, tmp_path):
    store = tmp_path / "spike"
    shutil.copytree(spike_store, store, ignore=shutil.ignore_patterns("replays", "bisect", "analysis"))
    killed_by_fault("bisect-kill:2", "bisect", str(store), "--by", "layers", "--fix", "lr-scale=0.5", "--workers", "1",
                    env={"RAY_ADDRESS": ray_local})
    killed = RunStore.open(store).bisect_sessions()
    assert len(killed) == 1 and killed[0]["status"] == "running" and len(killed[0]["probes"]) == 2
    info = json.loads(replay_cli("info", str(store), "--json").stdout)
    assert info["bisect"][0]["status"].startswith("interrupted")   # no bisect holds the store: it was killed

    session = _bisect(store, "--by", "layers", "--fix", "lr-scale=0.5", "--workers", "1")
    v = session["verdict"]
    assert session["runs"][-1]["reused_probes"] == 2
    assert v["new_probes"] == v["probes"] - 2 > 0
    # the verdict is 1-minimal by the session's own probes: its layers prevent the spike, fewer do not
    probes = list(session["probes"].values())
    assert v["layers"] and any(p["prevented"] for p in probes if p["overrides"].get("layers") == v["layers"])
    for layer in v["layers"]:
        fewer = [x for x in v["layers"] if x != layer]   # [] is the plain replay: the baseline
        tried = [p for p in probes if p["overrides"].get("layers", []) == fewer and "skip" not in p["overrides"]]
        assert tried and not any(p["prevented"] for p in tried)


def test_an_interrupted_bisect_is_marked_failed(spike_store, tmp_path):
    store = tmp_path / "spike"
    shutil.copytree(spike_store, store, ignore=shutil.ignore_patterns("replays", "bisect", "analysis"))
    # Ctrl-C as at a terminal: a suite started in the background by a non-interactive shell ignores SIGINT,
    # and a child would inherit that (Python then installs no KeyboardInterrupt handler)
    proc = subprocess.Popen([sys.executable, "-m", "replay", "bisect", str(store), "--by", "steps", "--fix",
                             "lr-scale=0.5", "--workers", "1"], cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        while not [b for b in RunStore.open(store).bisect_sessions() if b.get("status") == "running"]:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGINT)   # Ctrl-C: an exception that is not the tool's own
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130 and "interrupted" in stderr
    session = RunStore.open(store).bisect_sessions()[0]
    assert session["status"] == "failed" and session["error"] == "KeyboardInterrupt"


def test_no_spike_is_its_own_exit_code_and_bad_fixes_are_one_line(two_rank_store, spike_store):
    quiet, before = tree_snapshot(two_rank_store), tree_snapshot(spike_store)
    result = replay_cli("bisect", str(two_rank_store))
    assert result.returncode == 3 and "no spike recorded" in error_line(result)
    line = error_line(replay_cli("bisect", str(spike_store)))   # the default, safe-softmax, on an eager run
    assert "--fix 'safe-softmax' does not apply to this run" in line and "use 'eager'" in line
    assert tree_snapshot(two_rank_store) == quiet and tree_snapshot(spike_store) == before


@pytest.mark.parametrize("cfg, expected", [
    (BisectConfig(spike=5, fix="lr-scale=0.5"), "too close to the start: the detector judges steps only after"),
    (BisectConfig(spike=400, fix="lr-scale=0.5"), "--spike 400 is outside the record: steps 0..399"),
    (BisectConfig(fix="magic"), "'magic' is not a counterfactual"),
    (BisectConfig(fix="lr-scale=x"), "lr-scale='x': not a number"),
    (BisectConfig(fix="precision=bf16"), "acts on the whole model"),
    (BisectConfig(fix="attention=flashy"), "unknown attention backend 'flashy'"),
    (BisectConfig(fix="lr-scale=0.5", horizon=0), "--horizon must be >= 1"),
])
def test_bad_bisect_input_is_refused_before_anything_runs(spike_store, cfg, expected):
    before = tree_snapshot(spike_store)
    with pytest.raises(UsageError, match=re.escape(expected)):
        Bisect(Location.parse(spike_store), cfg)
    assert tree_snapshot(spike_store) == before
