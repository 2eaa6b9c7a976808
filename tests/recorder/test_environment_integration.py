"""What shapes the numbers besides the code is recorded and restored: a launcher's variables (accelerate's, here
its mixed precision and CPU mode) and the autocast the forward really ran under; what still differs in a replay
is named first. Who the ranks are comes from the process group, as a launcher that sets no RANK leaves it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from replay.store import RunStore
from tests.conftest import REPO, error_line, replay_cli

ACCELERATE = """
import sys
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from replay.recorder import Loop

accelerator = Accelerator()   # its mixed precision and device from the launcher's ACCELERATE_* variables
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 16), torch.nn.GELU(),
                            torch.nn.Linear(16, 32))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = accelerator.prepare(model, optimizer)
data = torch.randint(0, 32, (64, 9))
with Loop(sys.argv[1], model, optimizer, total_steps=6, checkpoint_every=2) as loop:
    for step in loop.steps():
        ix = loop.sample_ids(torch.randint(0, 64, (4,)))
        x, y = data[ix, :8], data[ix, 1:]
        loss = F.cross_entropy(model(x).float().view(-1, 32), y.reshape(-1))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loop.log(loss=loss)
"""

LAUNCHER = {"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_USE_CPU": "1"}


def _run(tmp_path: Path, source: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "RANK", "WORLD_SIZE"))}
    return subprocess.run([sys.executable, str(script), *args], cwd=tmp_path, capture_output=True, text=True,
                          env={**clean, "PYTHONPATH": str(REPO), **(env or {})}, timeout=180)


def test_a_launchers_mixed_precision_is_recorded_restored_and_named_first_when_it_differs(tmp_path):
    store = tmp_path / "run"
    done = _run(tmp_path, ACCELERATE, str(store), env=LAUNCHER)
    assert done.returncode == 0, done.stderr
    m = RunStore.open(store).manifest
    assert m.environment["autocast"] == "bf16 on cpu"   # what accelerate's wrapped forward ran under
    assert m.command is not None and {k: m.command.env[k] for k in LAUNCHER} == LAUNCHER
    # replayed from a shell without the launcher's variables, and with a stray one: the recorded ones are set
    plain = replay_cli("run", str(store), "--from", "2", "--to", "3", "--json",
                       env={"ACCELERATE_MIXED_PRECISION": "fp16", "ACCELERATE_USE_CPU": None})
    assert plain.returncode == 0, plain.stderr
    answer = json.loads(plain.stdout)
    assert answer["verification"]["bitwise"] and answer["verification"]["level"] == "state"
    assert answer["environment_differences"] == []
    assert RunStore.open(answer["replay"]).manifest.environment["autocast"] == "bf16 on cpu"
    # the script changed to run without mixed precision: not bit for bit (exit 5), and the autocast named first
    (tmp_path / "train.py").write_text(textwrap.dedent(ACCELERATE).replace(
        "accelerator = Accelerator()", 'accelerator = Accelerator(mixed_precision="no")'))
    changed = replay_cli("run", str(store), "--from", "2", "--to", "3", "--allow-changed", "--name", "changed")
    assert changed.returncode == 5
    assert error_line(changed).startswith(
        "error: the replay is not bit for bit: the replay ran in another environment than the record (the forward "
        "ran under autocast off, the record's under bf16 on cpu): first divergence at step 2")


SPAWNED = """
import os
import sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from replay.recorder import Loop

def main(rank, store, port, same):
    # as Lightning's launcher: a process group made by hand, no RANK or WORLD_SIZE in the environment
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 8), torch.nn.Linear(8, 32))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Loop(store, ddp, optimizer, total_steps=4, checkpoint_every=2) as loop:
        for step in loop.steps():
            g = torch.Generator().manual_seed(step * 2 + (0 if same else rank))
            ids = loop.sample_ids(torch.randint(0, 32, (4,), generator=g))
            loss = torch.nn.functional.cross_entropy(ddp(ids), ids)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            loop.log(loss=loss)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(main, args=(sys.argv[1], int(sys.argv[2]), "--same" in sys.argv), nprocs=2)
"""


def test_ranks_are_who_the_process_group_says_and_ranks_training_the_same_samples_are_named(tmp_path):
    from replay.launch.local import free_port

    done = _run(tmp_path, SPAWNED, str(tmp_path / "split"), str(free_port()))
    assert done.returncode == 0, done.stderr
    ids = RunStore.open(tmp_path / "split").read_steps(["sample_ids"])["sample_ids"]
    assert RunStore.open(tmp_path / "split").manifest.world_size == 2 and ids.shape[1] == 2
    assert not (ids[:, 0] == ids[:, 1]).all() and "same samples" not in done.stderr
    same = _run(tmp_path, SPAWNED, str(tmp_path / "same"), str(free_port()), "--same")
    assert same.returncode == 0, same.stderr
    warnings = [line for line in same.stderr.splitlines() if "trained on the same samples at step 0" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: all 2 ranks")
