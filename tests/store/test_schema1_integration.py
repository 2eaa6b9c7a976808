"""A store written before checksums covered every byte and before state digests (schema 1, tests/data:
test_schema1.py) replays a window, the replay itself in the current format, verified on the scalars the old
record holds (it has no state digests) and saying so.

The store was recorded on one machine (its manifest's environment names the processor), and the bits a
replay computes depend on the CPU it runs on: another microarchitecture takes other SIMD paths in oneDNN and
MKL. So nothing here assumes this machine's bits are the recording's, except where its processor and torch
are the recording's: there the replay must equal the record bit for bit. Elsewhere the replay must name the
processor difference and end with the exit code of its verdict. On every CPU the window replays to the same
bits twice, and a record that differs from its replay (a copy whose recorded gradient norm is doubled) is named
at the scalars level, with exit code 5."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from replay.store import RunStore
from replay.store.verification import Verification
from tests.conftest import error_line, replay_cli, tensors_equal
from tests.store.conftest import SCHEMA1

WINDOW = ["--from", "2", "--to", "3"]   # from checkpoint 2; the replay ends with a checkpoint at 4
FIELDS = ["loss", "rank_loss", "grad_norm", "lr", "state_digest"]
NO_DIGESTS = "the record holds no state digests: it was recorded by an earlier version of replay"


def _this_processor() -> str:
    with open("/proc/cpuinfo") as f:
        return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))


def _verification(replay: Path) -> Verification:
    v = RunStore.open(replay).manifest.replay_spec.verification
    assert v is not None, replay
    return v


@pytest.fixture(scope="module")
def replayed(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, subprocess.CompletedProcess, float]:
    """A copy of the store, its window replayed (`replays/steps-2-3`), then the record's gradient norm of
    step 2 doubled (a difference no CPU's rounding makes) and the same window replayed again
    (`replays/again`)."""
    store = tmp_path_factory.mktemp("schema1") / "old"
    shutil.copytree(SCHEMA1, store)
    first = replay_cli("run", str(store), *WINDOW, "--verify")
    grad = RunStore.open(store, mode="a").root["steps/grad_norm"]
    moved = float(2 * grad[2])
    grad[2] = moved
    again = replay_cli("run", str(store), *WINDOW, "--verify", "--name", "again")
    return store, first, again, moved


def test_a_window_replays_in_the_current_format_verified_on_its_scalars(replayed):
    store, result, _, _ = replayed
    env = RunStore.open(store).manifest.environment
    replay = RunStore.open(store / "replays/steps-2-3")
    assert replay.schema == 2 and replay.manifest.status == "complete"   # the replay itself: the current format
    assert replay.read_steps(["loss"])["step"].tolist() == [2, 3] and replay.digests is not None
    v = _verification(store / "replays/steps-2-3")
    assert v.level == "scalars" and v.steps == [2, 3] and v.note == NO_DIGESTS
    # the processor difference is named exactly where there is one
    other_cpu = env["processor"] != _this_processor()
    named = f"environment differs from the recording: processor: recorded {env['processor']}, "
    assert (named in result.stderr) is other_cpu, result.stderr
    if not other_cpu and env["packages"]["torch"] == torch.__version__:
        assert result.returncode == 0 and v.bitwise, result.stderr
        assert (f"verify: every replayed step's losses per rank, gradient norm and learning rate equal the "
                f"record's bit for bit; the state was not compared ({NO_DIGESTS})") in result.stdout
    elif v.bitwise:   # another CPU (or torch) may still give the recorded bits
        assert result.returncode == 0, result.stderr
    else:             # or not: a plain replay that is not bit for bit exits 5, naming the step
        assert result.returncode == 5 and f"({NO_DIGESTS})" in error_line(result), result.stderr


def test_the_window_replays_to_the_same_bits_twice(replayed):
    """What does not depend on the CPU that recorded the store: this machine gives the same steps, state
    digests and final checkpoint for the same window from the same checkpoint."""
    store, _, _, _ = replayed
    a, b = (RunStore.open(store / "replays" / name) for name in ("steps-2-3", "again"))
    x, y = a.read_steps(FIELDS), b.read_steps(FIELDS)
    assert x["step"].tolist() == y["step"].tolist() == [2, 3]
    for name in FIELDS:
        assert (x[name].dtype, x[name].shape, x[name].tobytes()) == (y[name].dtype, y[name].shape, y[name].tobytes())
    assert [c.step for c in a.checkpoints()] == [c.step for c in b.checkpoints()] == [4]
    first, second = (s.read_shard(4, 0) for s in (a, b))
    assert first["state"]["replicated"]["model"] and first["state"]["replicated"]["optimizer"]["state"]
    assert tensors_equal(first, second)   # model, optimizer, scheduler and RNG states, by their bits


def test_a_record_that_differs_from_its_replay_is_named_on_its_scalars_and_exits_5(replayed):
    store, _, again, moved = replayed
    assert again.returncode == 5, again.stderr
    line = error_line(again)
    # what differs from the record's environment (its transformers, at least) is named first, then the step
    assert line.startswith("error: the replay is not bit for bit: ") and "first divergence at step 2: " in line \
        and line.endswith(f"({NO_DIGESTS})"), line
    v = _verification(store / "replays/again")
    assert not v.bitwise and v.level == "scalars" and v.divergence is not None and v.divergence.state is None
    # the moved norm is among the changes at step 2 (the first replay's own, here, against the moved record's)
    replayed_norm = float(RunStore.open(store / "replays/steps-2-3").read_steps(["grad_norm"])["grad_norm"][0])
    changes = {c.quantity: (c.recorded, c.replayed) for c in v.divergence.scalars}
    assert v.divergence.step == 2 and changes["grad_norm"] == (moved, replayed_norm), changes
    assert RunStore.open(store / "replays/again").manifest.status == "complete"   # kept, as the verdict says
