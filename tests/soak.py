"""The fault soak: real SIGKILLs of a 2-rank recording at random moments, each resumed to completion and
compared bit for bit with an uninterrupted run; flipped bits in a committed checkpoint, each refused
on read with one line naming the checkpoint and the file or array; and the derived commands (`analyze`,
`report`, `export`, `bisect`) SIGKILLed at random moments and run on a full disk, each run again after
(tests/soak_derived.py).

The suite runs a few trials of each (tests/launch/test_soak_integration.py, and the derived commands' own tests);
`make soak` runs 30 kills, flips bits all over every file of a checkpoint, kills and fills the disk of each
derived command, and prints the counts; with --s3, every store is in the bucket of a SeaweedFS server started
for it on 127.0.0.1 (tests/s3server.py):

    .venv/bin/python -m tests.soak [--kills 30] [--flips-per-file 40] [--derived-kills 4] [--full-disks 2]
                                   [--seed S] [--s3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from replay.errors import ChecksumError
from replay.lifeline import child_env
from replay.processes import descendants
from replay.store import RunStore
from replay.store.location import Location, Where
from tests import soak_derived
from tests.conftest import TWO_RANK_ARGS, assert_gone, tensors_equal

REPO = Path(__file__).resolve().parents[1]
STEPS = 30
LAST_KILL = STEPS - 3   # kills aimed at most here still land before the run ends (2 steps and a commit later)
RECIPE = [*TWO_RANK_ARGS, "--set", "log_every=1"]   # the suite's reference recording, printing every step
FIELDS = ("loss", "rank_loss", "grad_norm", "lr", "tokens", "sample_ids")


def replay_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "replay", *map(str, args)]


def record_reference(path: Location) -> Location:
    """The uninterrupted run every trial is compared with (the suite reuses its own: tests/conftest.py)."""
    subprocess.run(replay_command("record", "--store", path, *RECIPE), check=True, capture_output=True,
                   cwd=REPO, env=child_env())
    return path


# -- kills ------------------------------------------------------------------------------------------------


@dataclass
class KillTrial:
    how: str               # "group": the whole `replay record` process group; "rank": one rank alone
    at_step: int           # the kill came once rank 0 had reported this step (-1: as soon as the ranks started)
    landed: str            # where the run was: "start-up", "training" or "checkpoint write"
    resumed_from: int      # the committed checkpoint the resume continued from (0: the run started over)
    error: str             # the killed command's last line


def killed_launch(store: Location, rng: random.Random, how: str, at_step: int, fault: str | None = None) -> KillTrial:
    """`replay record` the recipe into `store` (`--resume` if it holds a run), and SIGKILL it, the whole group
    or one rank, once rank 0 has reported `at_step`, plus a random fraction of a step; or with `fault`, let
    the fault hook kill it at its precise point (REPLAY_FAULT). Checks that no process of the launch is left
    2 s later, and that what it committed is the reference's (see `assert_prefix`)."""
    resume = (store / "zarr.json").exists()
    env = child_env({**os.environ, "REPLAY_FAULT": fault} if fault else None)
    args = ["--resume"] if resume else RECIPE
    proc = subprocess.Popen(replay_command("record", "--store", store, *args), cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        launched = {}
        if fault is None:
            _wait_for(proc, at_step)
            time.sleep(rng.uniform(0, 0.03))   # anywhere within the step, its checkpoint write included
            launched = descendants(proc.pid)
            workers = _rank_pids(launched)
            with contextlib.suppress(ProcessLookupError):   # on a loaded machine the run may just have ended
                if how == "group":
                    os.killpg(proc.pid, signal.SIGKILL)
                elif workers:
                    os.kill(rng.choice(workers), signal.SIGKILL)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert_gone(launched, within=2.0)
    killed = RunStore.open(store) if (store / "zarr.json").exists() else None
    landed = ("start-up" if killed is None or not killed.checkpoints() else
              "checkpoint write" if killed.uncommitted_checkpoints() else "training")
    resumes = killed.manifest.resumes if killed else []
    last_line = (stderr or "").strip().splitlines()[-1:] or [""]
    return KillTrial(how, at_step, landed, resumes[-1].from_step if resumes else 0, last_line[0])


def kill_trial(reference: Where, workdir: Where, rng: random.Random, how: str, at_step: int | None = None,
               fault: str | None = None) -> KillTrial:
    """A fresh recording of the reference recipe, SIGKILLed at a random step (or `at_step`, or by `fault`),
    then resumed to completion; the result must equal the reference bit for bit (AssertionError otherwise)."""
    store = Location.parse(workdir) / "run"
    trial = killed_launch(store, rng, how, rng.randrange(-1, LAST_KILL + 1) if at_step is None else at_step, fault)
    again = RECIPE if not (store / "zarr.json").exists() else ["--resume"]   # killed before the store existed
    result = subprocess.run(replay_command("record", "--store", store, *again), cwd=REPO, env=child_env(),
                            capture_output=True, text=True)
    assert result.returncode == 0, f"{how} kill at step {trial.at_step}: the resume failed: {result.stderr}"
    assert_same_run(store, reference)
    resumes = RunStore.open(store).manifest.resumes
    return KillTrial(how, trial.at_step, trial.landed, resumes[-1].from_step if resumes else 0, trial.error)


def chained_kills(reference: Where, workdir: Where, plan: list[tuple[str, int, str | None]],
                  rng: random.Random) -> list[KillTrial]:
    """One recording killed once per entry of `plan` (how, at step, fault), each kill's launch resuming the
    last; after each, what is committed must be the reference's, and the last resume runs to completion, bit
    for bit the reference. Cheaper than independent trials (the suite's way; `make soak` runs independent
    ones)."""
    store, trials = Location.parse(workdir) / "run", []
    for how, at_step, fault in plan:
        trials.append(killed_launch(store, rng, how, at_step, fault))
        assert_prefix(store, reference)
    result = subprocess.run(replay_command("record", "--store", store, "--resume"), cwd=REPO, env=child_env(),
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert_same_run(store, reference)
    return trials


def assert_prefix(store_path: Where, reference: Where) -> None:
    """What a killed run committed is the reference's: its last committed checkpoint, every rank's state,
    and the step log before it, bit for bit."""
    a, b = RunStore.open(store_path), RunStore.open(reference)
    committed = a.checkpoints()
    if not committed:
        return
    last = committed[-1].step
    steps_a, steps_b = a.read_steps(list(FIELDS)), b.read_steps(list(FIELDS))
    for name in FIELDS:
        assert np.array_equal(steps_a[name][:last].view(np.uint8), steps_b[name][:last].view(np.uint8)), name
    for rank in range(b.manifest.world_size):
        assert tensors_equal(a.read_shard(last, rank), b.read_shard(last, rank)), f"checkpoint {last} rank {rank}"


def _wait_for(proc: subprocess.Popen, at_step: int) -> None:
    """Until the ranks run (at_step -1) or rank 0 has printed `step N` for N >= at_step."""
    if at_step < 0:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(_rank_pids(descendants(proc.pid))) < 2:
            time.sleep(0.01)
        return
    for line in proc.stderr:
        words = line.split()
        if len(words) > 1 and words[0] == "step" and words[1].isdigit() and int(words[1]) >= at_step:
            return
    raise AssertionError(f"the recording ended before step {at_step}")


def _rank_pids(launched: dict[int, int]) -> list[int]:
    """The ranks among `launched`: fresh ones (launch/fresh.py), or ranks forked by a fork server
    (launch/forkserver.py: the server's children, which show its command line)."""
    servers = {pid for pid in launched if b"replay.launch.forkserver" in _cmdline(pid)}
    return [pid for pid in launched
            if b"replay.launch.worker" in _cmdline(pid) or (pid in servers and _parent(pid) in servers)]


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ")
    except OSError:
        return b""


def assert_same_run(a_path: Where, b_path: Where) -> None:
    """Step log, checkpoints and the final state of every rank: equal bit for bit."""
    a, b = RunStore.open(a_path), RunStore.open(b_path)
    assert a.manifest.status == "complete" and a.n_steps == b.n_steps
    steps_a, steps_b = a.read_steps(list(FIELDS)), b.read_steps(list(FIELDS))
    for name in FIELDS:
        assert np.array_equal(steps_a[name].view(np.uint8), steps_b[name].view(np.uint8)), name
    assert [(c.step, c.kind) for c in a.checkpoints()] == [(c.step, c.kind) for c in b.checkpoints()]
    for rank in range(b.manifest.world_size):
        last = b.checkpoints()[-1].step
        assert tensors_equal(a.read_shard(last, rank), b.read_shard(last, rank)), f"final state of rank {rank}"


# -- flips ------------------------------------------------------------------------------------------------


@dataclass
class FlipTrial:
    file: str              # relative to the checkpoint's directory
    byte: int
    bit: int
    refused: bool          # read refused with a ChecksumError ...
    one_line: bool         # ... of one line naming the checkpoint and the file or array
    message: str


def checkpoint_files(store: Where, step: int) -> list[Location]:
    """Every file (or object) of a checkpoint."""
    def walk(where: Location) -> list[Location]:
        found = []
        for name in where.children():
            child = where / name
            found += [child] if child.exists() else walk(child)
        return found

    return sorted(walk(Location.parse(store) / "checkpoints" / f"{step:08d}"), key=str)


def flip_trial(store: Where, step: int, path: Location, byte: int, bit: int) -> FlipTrial:
    """Flip one bit of a committed checkpoint's file, read the checkpoint (every rank), restore the bit."""
    raw = path.read()
    assert raw is not None, path
    data = bytearray(raw)
    data[byte] ^= 1 << bit
    path.write(bytes(data))
    message = ""
    try:
        run = RunStore.open(store)
        for rank in range(run.manifest.world_size):
            run.read_shard(step, rank)
    except ChecksumError as e:
        message = str(e)
    finally:
        data[byte] ^= 1 << bit
        path.write(bytes(data))
    rel = path.relative(Location.parse(store) / "checkpoints" / f"{step:08d}")
    parts = rel.split("/")
    names_it = rel in message or (parts[-2] == "c" and f"array tensors chunk {parts[-1]} " in message)
    return FlipTrial(rel, byte, bit, bool(message), bool(message) and "\n" not in message and
                     f"checkpoint {step}" in message and names_it, message)


def random_flips(store: Where, step: int, n: int, rng: random.Random) -> list[FlipTrial]:
    files = checkpoint_files(store, step)
    trials = []
    for _ in range(n):
        path = rng.choice(files)
        trials.append(flip_trial(store, step, path, rng.randrange(_size(path)), rng.randrange(8)))
    return trials


def _size(path: Location) -> int:
    raw = path.read()
    assert raw is not None, path
    return len(raw)


def flips_over_every_file(store: Where, step: int, per_file: int, rng: random.Random) -> list[FlipTrial]:
    trials = []
    for path in checkpoint_files(store, step):
        size = _size(path)
        for byte in rng.sample(range(size), min(per_file, size)):
            trials.append(flip_trial(store, step, path, byte, rng.randrange(8)))
    return trials


# -- make soak --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _stores(tmp: Path, s3: bool) -> Iterator[Location]:
    """Where the soak's stores go: `tmp`, or a bucket of an S3 server of its own."""
    if not s3:
        yield Location.parse(tmp)
        return
    from tests.s3server import S3Server

    server = S3Server(tmp / "s3")
    server.start()
    os.environ.update(server.env)
    try:
        yield Location.parse(f"s3://{server.bucket}/soak")
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=30)
    ap.add_argument("--flips-per-file", type=int, default=40)
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--derived-kills", type=int, default=4, help="SIGKILLs of each derived command")
    ap.add_argument("--full-disks", type=int, default=2, help="full disks met by each derived command")
    ap.add_argument("--s3", action="store_true", help="every store in a local S3 server's bucket")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    print(f"soak, seed {args.seed}: {args.kills} kills of `replay record {' '.join(RECIPE)}`, alternating the "
          "whole process group and one rank, at random steps (every sixth as the ranks start), each resumed and "
          "compared bit for bit" + (", every store on S3" if args.s3 else ""), flush=True)
    with tempfile.TemporaryDirectory(prefix="replay-soak-") as tmp, _stores(Path(tmp), args.s3) as base:
        reference = record_reference(base / "reference")
        trials = []
        t0 = time.perf_counter()
        print("  (a kill goes out once rank 0's `step N` line is read; the ranks may be a few steps further by then)")
        for i in range(args.kills):
            work = base / f"kill-{i}"
            trial = kill_trial(reference, work, rng, ("group", "rank")[i % 2], at_step=-1 if i % 6 == 2 else None)
            trials.append(trial)
            work.remove_tree()
            when = "as the ranks started" if trial.at_step < 0 else f"once step {trial.at_step:>2} was read"
            print(f"  kill {i + 1:>2}: {trial.how:<5} {when} ({trial.landed}), resumed from checkpoint "
                  f"{trial.resumed_from}: bit for bit the uninterrupted run", flush=True)
        by = Counter(t.landed for t in trials)
        print(f"kills: {len(trials)} of {args.kills} resumed to completion and equal bit for bit (loss, grad norm, "
              f"lr, sample ids, final state of both ranks); landed in start-up {by['start-up']}, training "
              f"{by['training']}, a checkpoint write {by['checkpoint write']}; {time.perf_counter() - t0:.0f} s",
              flush=True)
        step = RunStore.open(reference).checkpoints()[-2].step
        flips = flips_over_every_file(reference, step, args.flips_per_file, rng)
        files = len(checkpoint_files(reference, step))
        refused = sum(f.refused for f in flips)
        named = sum(f.one_line for f in flips)
        print(f"flips: {len(flips)} single-bit flips over all {files} files of checkpoint {step}: {refused} refused on "
              f"read, {named} of them with one line naming the checkpoint and the file or array; "
              f"{len(flips) - refused} accepted", flush=True)
        for f in flips:
            if not f.one_line:
                print(f"  not caught as it should be: {f.file} byte {f.byte} bit {f.bit}: {f.message or 'accepted'}")
        if args.derived_kills or args.full_disks:
            derived(reference, base / "derived", Path(tmp) / "derived", args, rng)


def derived(reference: Location, base: Location, local: Path, args: argparse.Namespace, rng: random.Random) -> None:
    print(f"derived commands: {args.derived_kills} SIGKILLs of each of {', '.join(soak_derived.COMMANDS)} at random "
          f"moments (its process group or itself alone), and {args.full_disks} full disks each (a tmpfs mounted "
          "here), each run again after", flush=True)
    t0 = time.perf_counter()
    trials = soak_derived.run(reference, base, local, args.derived_kills, args.full_disks, rng)
    for line in soak_derived.summary(trials):
        print(line)
    print(f"({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
