"""The loop API (replay.recorder.Loop) misused, and a script whose runs cannot be replayed as recorded."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from replay.errors import ReplayError, UsageError
from replay.recorder import Loop
from replay.store import RunStore
from tests.conftest import REPO, error_line, replay_cli, tree_snapshot
from tests.recorder.models import SelfAttention


class Tiny(torch.nn.Module):
    """One block whose attention calls SDPA, as a user's model does."""

    def __init__(self):
        super().__init__()
        self.emb, self.attn, self.head = torch.nn.Embedding(16, 8), SelfAttention(), torch.nn.Linear(8, 16)

    def forward(self, x):   # dropout: the loss depends on the RNG states, as a replay restores them
        return self.head(torch.nn.functional.dropout(self.attn(self.emb(x)), p=0.1, training=self.training))


def _parts():
    torch.manual_seed(0)
    model = Tiny()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(loop, model, optimizer, step):
    x = (torch.arange(8) + step).view(1, 8) % 16
    ids = loop.sample_ids(torch.tensor([step]))
    loss = torch.nn.functional.cross_entropy(model(x).view(-1, 16), x.view(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return ids, loss


def test_a_loop_records_its_steps_and_finds_the_attention(tmp_path):
    model, optimizer = _parts()
    with Loop(tmp_path / "run", model, optimizer, total_steps=6, checkpoint_every=3) as loop:
        for step in loop.steps():
            _, loss = _step(loop, model, optimizer, step)
            loop.log(loss=loss)
    store = RunStore.open(tmp_path / "run")
    m = store.manifest
    assert (m.status, m.config.model.n_layer, m.config.model.n_head) == ("complete", 1, 2)
    assert store.read_steps(["sample_ids"])["sample_ids"][:, 0, :, 0].tolist() == [[s] for s in range(6)]
    assert store.read_steps(["lr"])["lr"].tolist() == [0.1] * 6   # the optimizer's, when not given
    assert [c.step for c in store.checkpoints()] == [0, 3, 6]
    assert m.command.argv == sys.orig_argv[1:]
    info = replay_cli("info", str(tmp_path / "run")).stdout
    assert f"command     python x 1: python {' '.join(sys.orig_argv[1:])}" in info
    assert ("model       1 attention layers x 2 heads, fp32 (its first forward ran under autocast off), layout "
            "none") in info


def test_what_a_loop_cannot_do_is_refused_in_one_line_before_anything_is_written(tmp_path):
    model, optimizer = _parts()
    with Loop(tmp_path / "run", model, optimizer, total_steps=4, checkpoint_every=2) as loop:
        for step in loop.steps():
            _step(loop, model, optimizer, step)
            loop.log(loss=1.0)
    store = str(tmp_path / "run")
    before = tree_snapshot(tmp_path / "run")
    refusals = {("run", store, "--from", "2", "--to", "3", "--drop", "2:2"): "--drop needs the built-in trainer",
                ("run", store, "--from", "2", "--to", "3", "--lr-scale", "0.5", "--layers", "0"):
                    "--lr-scale on --layers/--heads needs the built-in trainer",
                ("analyze", store): "named no weight layout",
                ("record", "--store", store, "--resume"): "run your script again with Loop(..., resume=True)"}
    for args, message in refusals.items():
        assert message in error_line(replay_cli(*args)), args
    assert tree_snapshot(tmp_path / "run") == before


@pytest.mark.parametrize("mistake, message", [
    ("no-log", "ended without loop.log"),
    ("no-ids", "drew no training batch: pass every training micro-batch"),
    ("twice", "loop.log(...) is called once in every step"),
])
def test_a_step_without_its_calls_is_named(tmp_path, mistake, message):
    model, optimizer = _parts()
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        with Loop(tmp_path / "run", model, optimizer, total_steps=3) as loop:
            for step in loop.steps():
                if mistake != "no-ids":
                    _step(loop, model, optimizer, step)
                if mistake != "no-log":
                    loop.log(loss=1.0)
                if mistake == "twice":
                    loop.log(loss=1.0)


def test_a_used_store_is_refused_untouched_without_resume(tmp_path):
    model, optimizer = _parts()
    with Loop(tmp_path / "run", model, optimizer, total_steps=2) as loop:
        for step in loop.steps():
            _step(loop, model, optimizer, step)
            loop.log(loss=1.0)
    before = tree_snapshot(tmp_path / "run")
    made = Loop(tmp_path / "run", model, optimizer, total_steps=2)   # builds nothing: refused where it starts
    with pytest.raises(UsageError, match="not empty|already"):
        made.start()
    assert tree_snapshot(tmp_path / "run") == before
    with pytest.raises(UsageError, match="precision"):
        Loop(tmp_path / "other", model, optimizer, total_steps=2, precision="int8")


SCRIPT = """
import sys
import numpy as np
import torch
from replay.recorder import Loop
from tests.recorder.test_loop_integration import Tiny

torch.manual_seed(0)
model = Tiny()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
unrecorded = np.random.default_rng()   # fresh entropy in every process: not part of any RNG state
loop = Loop(sys.argv[1], model, optimizer, scheduler=scheduler, total_steps=8, checkpoint_every=4)
with loop:
    for step in loop.steps():
        drawn = unrecorded.integers(0, 1000, 2) if "--unrecorded" in sys.argv else torch.randint(0, 1000, (2,))
        ids = loop.sample_ids(drawn)
        x = torch.as_tensor(np.asarray(ids)).view(1, 2) % 16
        with torch.autocast("cpu", enabled=False):   # not loop.autocast: --precision cannot reach it
            loss = torch.nn.functional.cross_entropy(model(x).view(-1, 16), x.view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loop.log(loss=loss)
        scheduler.step()   # after log: still in the step's checkpoint
        if loop.replaying and step == 5 and "--break" in sys.argv:
            break
"""


def _record(tmp_path: Path, *flags: str) -> Path:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    store = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(script), str(store), *flags], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return store


def test_a_loader_with_unrecorded_randomness_is_caught_in_the_replay(tmp_path):
    store = _record(tmp_path, "--unrecorded")
    result = replay_cli("run", str(store), "--from", "5", "--to", "6")
    assert result.returncode == ReplayError.exit_code
    # the rank's own error, said to the launcher over its pipe (recorder/serving.py), in the command's one line
    assert error_line(result).startswith("error: the training script failed: rank 0: step 4, rank 0: the loader "
                                         "drew samples")   # the first step it ran
    assert "not the recorded RNG states" in result.stderr and "global generators" in result.stderr


def test_a_replay_the_script_cannot_run_or_finish_is_an_error(tmp_path):
    """--precision needs a forward under loop.autocast (tests/examples/test_nanogpt_integration.py shows one
    that has it); a script that leaves its loop before the window's end has not replayed the window."""
    store = _record(tmp_path, "--break")
    refused = replay_cli("run", str(store), "--from", "5", "--to", "6", "--precision", "bf16")
    assert refused.returncode == UsageError.exit_code and "the training script failed: rank 0: " in error_line(refused)
    assert "rank 0: --precision: this script does not run its forward under loop.autocast" in refused.stderr
    early = error_line(replay_cli("run", str(store), "--from", "2", "--to", "6"))
    assert "ended without an error after step 5, before the window 2..6 was done" in early


def test_a_killed_replay_with_a_skip_resumes_to_the_uninterrupted_one(tmp_path):
    """After a skipped step the replay's RNG states are its own: resumed from its checkpoint, the loader draws
    what the replay would have drawn, and the resumed replay equals one that ran through."""
    store = _record(tmp_path)
    plain = replay_cli("run", str(store), "--from", "5", "--to", "6", "--verify")
    assert "bit for bit" in plain.stdout, plain.stderr   # the scheduler stepped after log is in checkpoint 4
    window = ["--from", "2", "--to", "7", "--skip", "3", "--checkpoint-every", "2"]
    whole = replay_cli("run", str(store), *window, "--name", "whole")
    assert whole.returncode == 0, whole.stderr
    killed = replay_cli("run", str(store), *window, "--name", "cut", env={"REPLAY_FAULT": "before-commit:6:0"})
    assert killed.returncode != 0
    resumed = replay_cli("run", str(store), *window, "--name", "cut", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    a, b = RunStore.open(store / "replays" / "whole"), RunStore.open(store / "replays" / "cut")
    assert [r.from_step for r in b.manifest.resumes] == [4]
    for name in ("loss", "sample_ids"):
        x, y = a.read_steps([name])[name], b.read_steps([name])[name]
        assert np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)), name


MINGPT_SHAPE = """
import sys
import torch
from replay.recorder import Loop
from tests.recorder.test_loop_integration import Tiny

torch.manual_seed(0)
model = Tiny()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
max_iters = None if "--forever" in sys.argv else 6
loop = Loop(sys.argv[1], model, optimizer, total_steps=max_iters, checkpoint_every=4)   # neither `with` nor close()
for it in loop.steps():
    ids = loop.sample_ids(torch.randint(0, 1000, (2,)))
    x = ids.view(1, 2) % 16
    loss = torch.nn.functional.cross_entropy(model(x).view(-1, 16), x.view(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    loop.log(loss=loss)
    if it + 1 >= max_iters:   # minGPT's own termination check, after the step's log
        break
"""


def test_a_loop_left_by_a_break_after_its_last_step_and_never_closed_is_complete(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(MINGPT_SHAPE))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    store = RunStore.open(tmp_path / "run")
    assert store.manifest.status == "complete" and store.n_steps == 6
    assert [c.step for c in store.checkpoints()] == [0, 4, 6]
    plain = replay_cli("run", str(tmp_path / "run"), "--from", "4", "--to", "5", "--verify")
    assert plain.returncode == 0 and "bit for bit" in plain.stdout, plain.stderr
    forever = subprocess.run([sys.executable, str(script), str(tmp_path / "forever"), "--forever"], cwd=tmp_path,
                             env=env, capture_output=True, text=True, timeout=120)
    assert forever.returncode == UsageError.exit_code and "Traceback" not in forever.stderr
    assert forever.stderr.strip().splitlines()[-1].startswith("rank 0: Loop(total_steps=None): a replay needs")
    assert not (tmp_path / "forever").exists()
