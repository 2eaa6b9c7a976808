"""examples/streaming: a script that trains from an IterableDataset (shards of a token file, split over ranks
and DataLoader workers, shuffled per pass) through torchdata's StatefulDataLoader or a plain DataLoader,
recorded under torchrun and replayed, resumed and bisected by the product's commands. Every run is a real
process (torchrun, gloo, worker processes)."""

from __future__ import annotations

import json
import shutil
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import google_crc32c
import numpy as np
import pytest

from replay.launch.script import ScriptServer
from replay.store import RunStore
from tests.conftest import REPO, error_line, replay_cli, tree_snapshot
from tests.examples.conftest import (
    DETERMINISM,
    assert_resumed_as_recorded,
    assert_same_run,
    kill_after_checkpoint,
    run_example,
)
from tests.examples.planted import overwrite_with_noise

pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is a test dependency (pip install -e '.[test]')")

EXAMPLE = REPO / "examples" / "streaming" / "train.py"
STEPS, WINDOWS, BLOCK = 40, 600, 32   # the example's defaults: rank r's stream ends its first pass at step 37
SETTINGS = [f"--max_iters={STEPS}", "--checkpoint_every=10"]
ONE_PROCESS = (sys.executable,)


@pytest.fixture(scope="module")
def data_dir(token_file) -> Path:
    return token_file.parent


@pytest.fixture(scope="module")
def recorded(data_dir, tmp_path_factory) -> Path:
    """40 steps on 2 ranks through torchdata's StatefulDataLoader, 2 workers a rank, checkpoints every 10."""
    workdir = tmp_path_factory.mktemp("streaming")
    done = run_example(EXAMPLE, workdir, f"--data_dir={data_dir}", f"--store={workdir / 'run'}", *SETTINGS)
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stderr, done.stderr   # the ranks' samples differ (by digest), so no "not split"
    return workdir / "run"


@pytest.fixture(scope="module")
def served(recorded) -> Iterator[ScriptServer]:
    """The recording's script kept up between this file's replays of it, started at the first."""
    with ScriptServer(RunStore.open(recorded).manifest.command) as server:
        yield server


def window_digests(train_bin: Path, count: int = WINDOWS) -> dict[int, list[int]]:
    """The stream's windows by the digest replay takes of each (its two fields, x and y, as the int64 tensors
    the example yields: the CRC-32C of each field's bytes, then of the two CRCs), computed here with
    google-crc32c: digest -> the windows that have it (a text repeats itself now and then)."""
    tokens = np.fromfile(train_bin, dtype=np.uint16).astype(np.int64)
    out: dict[int, list[int]] = {}
    for w in range(count):
        chunk = tokens[w * BLOCK:(w + 1) * BLOCK + 1]
        fields = np.array([google_crc32c.value(chunk[:-1].tobytes()), google_crc32c.value(chunk[1:].tobytes())],
                          dtype=np.uint32)
        out.setdefault(google_crc32c.value(fields.tobytes()), []).append(w)
    return out


def test_each_sample_is_recorded_by_its_place_in_its_ranks_stream_and_the_digest_of_its_tokens(recorded, data_dir):
    """Every rank's samples are numbered 0, 1, 2, ... in the order its stream yielded them; every digest is one
    of the token file's windows; the first pass gives each window once, over both ranks, and a rank's second
    pass its own windows again."""
    steps = RunStore.open(recorded).read_steps(["sample_ids", "sample_digest"])
    ids, digests = steps["sample_ids"], steps["sample_digest"]
    assert ids.shape == digests.shape == (STEPS, 2, 2, 4)   # step, rank, micro-batch, sample
    windows = window_digests(data_dir / "train.bin")
    for rank in range(2):
        assert np.array_equal(ids[:, rank].ravel(), np.arange(STEPS * 8)), rank
    drawn = [[int(d) for d in digests[:, rank].ravel()] for rank in range(2)]
    assert all(d in windows for rank in drawn for d in rank)   # each sample is one of the file's windows
    per_rank = WINDOWS // 2
    every_window = Counter({digest: len(ws) for digest, ws in windows.items()})
    assert Counter(drawn[0][:per_rank]) + Counter(drawn[1][:per_rank]) == every_window   # a pass: each once
    second = drawn[0][per_rank:]   # rank 0's second pass: its own shards again, in another order
    assert set(second) <= set(drawn[0][:per_rank]) and second != drawn[0][:len(second)]
    shown = replay_cli("batch", str(recorded), "--step", "21", "--rank", "1").stdout
    assert f"number 170 of rank 1's stream, CRC-32C {digests[21, 1, 0, 2]:08x}" in shown, shown


def test_a_window_across_the_pass_end_replays_bit_for_bit_from_the_stateful_loaders_state(recorded, served):
    """From checkpoint 30 (the StatefulDataLoader's state there) over the end of the first pass, on the script
    kept up: every step bit for bit at the level of the state, and every sample's digest the record's."""
    result = replay_cli("run", str(recorded), "--from", "35", "--to", "39", "--verify", "--json", ranks=served)
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    v = answer["verification"]
    assert (v["steps"], v["bitwise"], v["level"]) == ([30, 39], True, "state")
    fields = ["sample_ids", "sample_digest"]
    replayed = RunStore.open(answer["replay"]).read_steps(fields)
    record = RunStore.open(recorded).read_steps(fields, start=30, stop=40)
    assert all(np.array_equal(replayed[f], record[f]) for f in fields)


def test_emulated_bf16_attention_diverges_at_from_on_the_kept_up_script(recorded, served):
    result = replay_cli("run", str(recorded), "--from", "24", "--to", "26", "--verify", "--json",
                        "--attention", "reference-emu:dtype=bf16", "--layers", "0", ranks=served)
    assert result.returncode == 0, result.stderr
    v = json.loads(result.stdout)["verification"]
    assert not v["bitwise"] and v["divergence"]["step"] == 24 and v["divergence"]["state"]["ranks"] == [0, 1]
    assert served.refused is None


def test_a_plain_dataloader_is_replayed_by_drawing_its_pass_again_and_other_data_is_refused(data_dir, tmp_path):
    """A DataLoader without state_dict(), in one process: the recording trains as the script does without
    replay; a replay from checkpoint 30 draws the pass again from its start (its workers seeded as the record's)
    to the checkpoint's position, bit for bit; after the token file changed, the replay stops at the first
    sample whose digest is not the record's (in the first step from its checkpoint), in one line, and keeps
    nothing."""
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    args = [f"--data_dir={data}", "--stateful=False", *SETTINGS]
    recorded = run_example(EXAMPLE, tmp_path, *args, f"--store={tmp_path / 'run'}", f"--out={tmp_path / 'rec.pt'}",
                           launcher=ONE_PROCESS)
    assert recorded.returncode == 0, recorded.stderr
    assert recorded.stderr.count(DETERMINISM) == 1
    plain = run_example(EXAMPLE, tmp_path, *args, "--record=False", f"--out={tmp_path / 'plain.pt'}",
                        launcher=ONE_PROCESS)
    assert plain.returncode == 0 and "replay" not in plain.stderr, plain.stderr
    assert_same_run(tmp_path / "rec.pt", tmp_path / "plain.pt", steps=STEPS)
    store = tmp_path / "run"
    result = replay_cli("run", str(store), "--from", "35", "--to", "39", "--verify", "--json")
    assert result.returncode == 0, result.stderr
    v = json.loads(result.stdout)["verification"]
    assert (v["steps"], v["bitwise"], v["level"]) == ([30, 39], True, "state")
    digests = RunStore.open(store).read_steps(["sample_digest"])["sample_digest"]
    changed = window_digests(data / "train.bin")[int(digests[30, 0, 1, 2])][0]   # step 30's 7th sample
    tokens = np.memmap(data / "train.bin", dtype=np.uint16, mode="r+")
    tokens[changed * BLOCK + 5] += 1
    tokens.flush()
    before = tree_snapshot(store)
    line = error_line(replay_cli("run", str(store), "--from", "31", "--to", "34", "--name", "changed"))
    assert "step 30, micro-batch 1: the stream's sample 246 is not the recorded one" in line, line
    assert "1 of the batch's 4 samples differ" in line
    assert tree_snapshot(store) == before


def test_a_recording_killed_mid_run_resumes_to_the_uninterrupted_one(recorded, data_dir, tmp_path):
    """Killed (torchrun, its ranks and their workers) after checkpoint 20 and resumed: the loader's state from
    the last committed checkpoint; every step's samples, digests, losses and state digests as recorded."""
    store = tmp_path / "cut"
    args = [f"--data_dir={data_dir}", f"--store={store}", *SETTINGS]
    last = kill_after_checkpoint(run_example(EXAMPLE, tmp_path, *args, popen=True), store, 20)
    assert 20 <= last < STEPS
    resumed = run_example(EXAMPLE, tmp_path, *args, "--resume=True")
    assert resumed.returncode == 0, resumed.stderr
    assert_resumed_as_recorded(store, recorded, resumed_from=last, checkpoint=STEPS)


def test_bisect_names_the_step_whose_windows_were_overwritten_in_the_token_file(data_dir, tmp_path):
    """One process, 78 steps over a stream of 700 windows (one pass, no workers): write random bytes above 127
    (never in Python source) over the windows its step 75 drew (found by their digests), record again (the
    stream's order does not depend on what the windows hold): the loss jumps there, far above the steps before
    it (the detector's baseline), and a data bisect names that step's batches by their places."""
    settings = ["--n_windows=700", "--max_iters=78", "--checkpoint_every=6", "--num_workers=0"]
    clean = run_example(EXAMPLE, tmp_path, f"--data_dir={data_dir}", f"--store={tmp_path / 'clean'}", *settings,
                        launcher=ONE_PROCESS)
    assert clean.returncode == 0, clean.stderr
    windows = window_digests(data_dir / "train.bin", 700)
    drawn = RunStore.open(tmp_path / "clean").read_steps(["sample_digest"])["sample_digest"][75]
    starts = sorted({w * BLOCK for digest in drawn.ravel() for w in windows[int(digest)]})
    poisoned = overwrite_with_noise(data_dir, starts, BLOCK + 1, into=tmp_path / "data")
    store = tmp_path / "spiked"
    done = run_example(EXAMPLE, tmp_path, f"--data_dir={poisoned}", f"--store={store}", *settings,
                       launcher=ONE_PROCESS)
    assert done.returncode == 0, done.stderr
    assert [e["step"] for e in RunStore.open(store).spikes] == [75]
    result = replay_cli("bisect", str(store), "--by", "data", "--json")
    assert result.returncode == 0, result.stderr
    verdict = json.loads(result.stdout)["verdict"]
    assert verdict["batches"] == [75], verdict
    assert "in the stream: step 75 rank 0: samples 600..607 (`replay batch" in result.stderr
    assert "started afresh" not in result.stderr
