"""examples/torchtitan: torchtitan's llama3 debugmodel and its HF text loader (a StatefulDataLoader subclass that
pickles its state) in a Loop on 2 gloo ranks under torchrun, recorded and replayed by the product's commands.

torchtitan is not one of replay's test dependencies (its requirements would change the suite's environment), so
these tests skip unless it is installed as examples/torchtitan/README.md says; they are the by-hand check of that
README made repeatable: `python -m pytest tests/examples/test_torchtitan_integration.py` where it is."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from replay.store import RunStore
from tests.conftest import REPO, replay_cli
from tests.examples.conftest import assert_resumed_as_recorded, kill_after_checkpoint, run_example

pytest.importorskip("torchtitan", reason="torchtitan is not a test dependency: install it as "
                                         "examples/torchtitan/README.md says to run these")
pytest.importorskip("datasets", reason="torchtitan's text loader needs `datasets` (examples/torchtitan/README.md)")

EXAMPLE = REPO / "examples" / "torchtitan" / "train.py"
STEPS = 16


@pytest.fixture(scope="module", autouse=True)
def offline() -> Iterator[None]:
    """Nothing downloaded: the loader reads local files only, here and in every rank the tests start."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("torchtitan") / "assets"
    done = subprocess.run([sys.executable, str(EXAMPLE.parent / "prepare.py"), "--out", str(out)], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def recorded(assets) -> Path:
    """16 steps on 2 ranks, checkpoints every 4."""
    workdir = assets.parent
    done = run_example(EXAMPLE, workdir, f"--assets={assets}", f"--store={workdir / 'run'}")
    assert done.returncode == 0, done.stderr
    return workdir / "run"


def test_the_loaders_state_is_kept_as_the_stateful_dataloader_it_is_and_holds_no_pickle(recorded):
    store = RunStore.open(recorded)
    assert store.manifest.status == "complete" and store.manifest.world_size == 2
    loader = store.read_shard(8, 1)["loop"]["loader"]
    assert loader["kind"] == "stream" and loader["loader_class"] == "StatefulDataLoader"
    assert loader["loader"]["dataset_state"]["sample_idx"] > 0   # the packing dataset's own position
    steps = store.read_steps(["sample_ids", "sample_digest"])
    assert np.array_equal(steps["sample_ids"][:, 0].reshape(STEPS, -1), np.arange(STEPS * 2).reshape(STEPS, 2))
    assert not np.array_equal(steps["sample_digest"][:, 0], steps["sample_digest"][:, 1])   # each rank its shard


def test_a_window_replays_bit_for_bit_and_an_emulated_bf16_attention_diverges_at_from(recorded):
    plain = replay_cli("run", str(recorded), "--from", "9", "--to", "14", "--verify", "--json")
    assert plain.returncode == 0, plain.stderr
    v = json.loads(plain.stdout)["verification"]
    assert (v["steps"], v["bitwise"], v["level"]) == ([8, 14], True, "state")
    changed = replay_cli("run", str(recorded), "--from", "9", "--to", "11", "--verify", "--json",
                         "--attention", "reference-emu:dtype=bf16")
    assert changed.returncode == 0, changed.stderr
    answer = json.loads(changed.stdout)
    assert not answer["verification"]["bitwise"] and answer["verification"]["divergence"]["step"] == 9
    assert answer["reached"]["refused"] is None and sum(sum(c) for c in answer["reached"]["counts"]) > 0


def test_a_killed_recording_resumes_to_the_uninterrupted_one(recorded, assets, tmp_path):
    store = tmp_path / "cut"
    args = [f"--assets={assets}", f"--store={store}"]
    last = kill_after_checkpoint(run_example(EXAMPLE, tmp_path, *args, popen=True), store, 8)
    assert 8 <= last < STEPS
    resumed = run_example(EXAMPLE, tmp_path, *args, "--resume=True")
    assert resumed.returncode == 0, resumed.stderr
    assert_resumed_as_recorded(store, recorded, resumed_from=last, checkpoint=STEPS)
