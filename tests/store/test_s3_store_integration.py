"""Run stores at s3://bucket/prefix on a real S3 server (SeaweedFS on 127.0.0.1, tests/s3server.py): the same
bits as on disk, one writer, damage refused, a server restarted in the middle of a checkpoint's upload
and a SIGKILLed recording both resumed bit for bit, the analysis read straight from the bucket."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from replay.errors import ChecksumError, StoreError
from replay.lifeline import child_env
from replay.store import RunStore
from replay.store.lease import Lease
from replay.store.location import Location
from tests.conftest import REPO, TWO_RANK_ARGS, error_line, new_store, replay_cli
from tests.head_norms import assert_fused_head_norms

MODEL = "/state/replicated/model/"


def _same_run(a: RunStore, b: RunStore) -> None:
    """The same step log and, at every checkpoint both have, the same model, bit for bit."""
    ra, rb = a.read_steps(), b.read_steps()
    for field in ("loss", "rank_loss", "grad_norm", "sample_ids"):
        assert np.array_equal(ra[field], rb[field]), field
    steps = {c.step for c in a.checkpoints()} & {c.step for c in b.checkpoints()}
    assert steps, "no checkpoint in common"
    for step in sorted(steps):
        ma = a.read_shard(step, 0)["state"]["replicated"]["model"]
        mb = b.read_shard(step, 0)["state"]["replicated"]["model"]
        assert all(torch.equal(ma[k], mb[k]) for k in mb), step


def _record(store: Location, *args: str, env: dict | None = None, **kwargs) -> subprocess.Popen:
    """`replay record` into `store` as its own process group (a launcher that can be SIGKILLed whole)."""
    return subprocess.Popen([sys.executable, "-m", "replay", "record", "--store", str(store), *args],
                            cwd=REPO, env=child_env({**os.environ, **(env or {})}), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def _wait_for(predicate, timeout: float = 120.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_run_recorded_on_s3_is_the_run_recorded_on_disk_and_replays_bit_for_bit(two_rank_store, s3_store,
                                                                                   rank_pool):
    result = replay_cli("record", "--store", str(s3_store), *TWO_RANK_ARGS, ranks=rank_pool)
    assert result.returncode == 0, result.stderr
    assert not s3_store.local and (s3_store / "zarr.json").exists()
    _same_run(RunStore.open(str(s3_store)), RunStore.open(two_rank_store))

    ran = replay_cli("run", str(s3_store), "--from", "13", "--to", "19", "--verify", "--json", ranks=rank_pool)
    assert ran.returncode == 0, ran.stderr
    answer = json.loads(ran.stdout)
    assert answer["replay"] == f"{s3_store}/replays/steps-13-19" and answer["verification"]["bitwise"]
    info = json.loads(replay_cli("info", str(s3_store), "--json").stdout)
    assert [c["step"] for c in info["checkpoints"]] == [0, 10, 20, 30] and info["writer"] is None
    assert [r["id"] for r in info["replays"]] == ["steps-13-19"]
    assert (s3_store / "leases").children() in ([], ["replays"])   # every lease released
    batch = json.loads(replay_cli("batch", str(s3_store), "--step", "7", "--json").stdout)
    assert batch == json.loads(replay_cli("batch", str(two_rank_store), "--step", "7", "--json").stdout)


def test_compare_reads_a_store_in_a_bucket_against_one_on_disk(two_rank_store, s3_store, rank_pool, ray_local):
    result = replay_cli("record", "--store", str(s3_store), *TWO_RANK_ARGS[:2], "--nproc", "2", "--seed", "7",
                        "--checkpoint-every", "10", ranks=rank_pool)   # another seed: other weights
    assert result.returncode == 0, result.stderr
    compared = replay_cli("compare", str(s3_store), str(two_rank_store), "--workers", "2", "--json")
    assert compared.returncode == 0, compared.stderr
    distances = json.loads(compared.stdout)
    assert distances["steps"] == [0, 10, 20, 30] and distances["reference"] == str(s3_store)
    a, b = RunStore.open(str(s3_store)), RunStore.open(two_rank_store)
    key = "transformer.h.0.attn.c_attn.weight"
    column = distances["tensors"].index(MODEL + key)
    expected = (a.read_model(30, [key])[key] - b.read_model(30, [key])[key]).abs().max().item()
    assert distances["max_abs"][3][column] == pytest.approx(expected, rel=1e-6) and expected > 0


def test_a_store_removed_from_the_bucket_is_created_again_there(s3_store):
    """SeaweedFS lists a removed tree's prefixes for a while: a probe replay that a killed bisect left without a
    commit is removed and made again by the next bisect, and must not be refused as "not empty"."""
    new_store(s3_store)
    s3_store.remove_tree()
    new_store(s3_store)
    assert RunStore.open(s3_store).n_steps == 0


def test_one_writer_a_living_one_refuses_a_second_and_a_dead_ones_lease_is_taken_over(s3_store):
    with Lease.acquire(s3_store, "a test holding the store"):
        line = error_line(replay_cli("record", "--store", str(s3_store), "--steps", "2", process=True))
        assert "is being written by `a test holding the store`" in line
        assert s3_store.children() == ["leases"]                   # nothing written

    # a holder that died without releasing: its pid runs no more
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = {"command": "replay record", "pid": gone.pid, "host": socket.gethostname(), "since": time.time() - 60,
            "token": "dead", "start": None, "took_over": None, "beat": 3}
    assert (s3_store / "leases" / "run.json").create(json.dumps(dead).encode())
    result = replay_cli("record", "--store", str(s3_store), "--steps", "2", process=True)
    assert result.returncode == 0, result.stderr
    assert "took over the lease of `replay record`" in result.stderr


def test_of_racing_writers_exactly_one_takes_the_lease(s3_store):
    take = ("import sys, time; from replay.errors import StoreError; from replay.store.lease import Lease\n"
            "try:\n    lease = Lease.acquire(sys.argv[1], 'racer')\nexcept StoreError:\n    sys.exit(3)\n"
            "print('took', flush=True); time.sleep(4); lease.release()")
    racers = [subprocess.Popen([sys.executable, "-c", take, str(s3_store)], cwd=REPO, env=child_env(),
                               stdout=subprocess.PIPE, text=True) for _ in range(4)]
    codes = [p.wait(60) for p in racers]
    assert sorted(codes) == [0, 3, 3, 3], codes


def test_a_holder_whose_lease_object_was_replaced_stops_writing(s3_store):
    lease = Lease.acquire(s3_store, "the first holder")
    try:
        lease.check()
        (s3_store / "leases" / "run.json").write(json.dumps({
            "command": "another", "pid": 1, "host": "elsewhere", "since": time.time(), "token": "other"}).encode())
        with pytest.raises(StoreError, match="lost its lease to `another`"):
            lease.check()
    finally:
        lease.release()
    assert (s3_store / "leases" / "run.json").exists()   # the new holder's lease is not removed by the old one


def test_what_cannot_reach_a_bucket_is_named_in_one_line_and_quickly(s3_store, monkeypatch):
    with socket.socket() as s:   # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", closed)
    monkeypatch.setenv("REPLAY_S3_RETRY_SECONDS", "2")
    start = time.monotonic()
    line = error_line(replay_cli("info", str(s3_store)))
    assert line.startswith(f"error: cannot reach the S3 endpoint {closed} for bucket {s3_store.bucket} (check "
                           "AWS_ENDPOINT_URL)") and time.monotonic() - start < 10
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://192.0.2.1:8333")   # plain HTTP to another machine
    assert "would send the credentials in the clear" in error_line(replay_cli("info", str(s3_store)))


@pytest.fixture
def recorded(s3_store, rank_pool) -> Location:
    result = replay_cli("record", "--store", str(s3_store), "--steps", "12", "--nproc", "2", "--checkpoint-every",
                        "4", ranks=rank_pool)
    assert result.returncode == 0, result.stderr
    return s3_store


def _flip(where: Location, byte: int) -> bytes:
    raw = where.read()
    assert raw is not None, where
    damaged = bytearray(raw)
    damaged[byte % len(raw)] ^= 0x10
    where.write(bytes(damaged))
    return raw


def test_a_flipped_bit_in_any_object_of_a_checkpoint_is_refused_naming_it(recorded):
    shard = recorded / "checkpoints" / "00000008" / "rank1"
    rng = random.Random(0)
    for obj in (shard / "tensors" / "c" / "0", shard / "zarr.json", shard / "tensors" / "zarr.json"):
        good = _flip(obj, rng.randrange(1 << 16))
        with pytest.raises(ChecksumError) as refused:
            RunStore.open(str(recorded)).verify_shard(8, 1)
        assert "checkpoint 8 rank 1" in str(refused.value) and "\n" not in str(refused.value)
        obj.write(good)
    RunStore.open(str(recorded)).verify_shard(8, 1)

    good = _flip(recorded / "checkpoints" / "00000008" / "zarr.json", 40)
    info = json.loads(replay_cli("info", str(recorded), "--json").stdout)
    assert [d["step"] for d in info["damaged_checkpoints"]] == [8]
    ran = replay_cli("run", str(recorded), "--from", "9", "--to", "10", "--verify", process=True)
    assert ran.returncode == 0, ran.stderr
    assert "warning: checkpoint 8 is damaged" in ran.stderr and "from checkpoint 4" in ran.stderr
    (recorded / "checkpoints" / "00000008" / "zarr.json").write(good)


def test_the_analysis_reads_each_checkpoint_from_the_bucket(recorded, ray_local):
    result = replay_cli("analyze", str(recorded), "--workers", "2")
    assert result.returncode == 0, result.stderr
    from replay.analysis.results import read_metrics

    table = read_metrics(str(recorded))
    store = RunStore.open(str(recorded))
    assert table["step"].tolist() == [c.step for c in store.checkpoints()] == [0, 4, 8, 12]
    model = store.read_shard(8, 0)["state"]["replicated"]["model"]
    row = {name: table[name][2] for name in ("spectral_head",)}
    # the built-in GPT-2's Conv1D weights are (in, out): as nn.Linear's, transposed
    assert_fused_head_norms(row, 1, model["transformer.h.1.attn.c_attn.weight"].T,
                            model["transformer.h.1.attn.c_proj.weight"].T, store.manifest.config.model.n_head)


def test_a_server_killed_and_restarted_in_the_middle_of_a_checkpoints_upload_loses_nothing(two_rank_store, s3_store,
                                                                               s3_server, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    proc = _record(s3_store, *TWO_RANK_ARGS, env={"REPLAY_FAULT": "shard-pause:20:1",
                                                   "REPLAY_FAULT_ONCE": str(marks)})
    _wait_for(lambda: (marks / "paused").exists() or proc.poll() is not None, what="rank 1 half-way through step 20")
    assert proc.poll() is None, proc.communicate()
    s3_server.kill()                       # rank 1 is half-way through its shard of checkpoint 20
    (marks / "go").touch()                 # ... and goes on writing to a server that was killed
    time.sleep(1.5)
    s3_server.start()
    out, err = proc.communicate(timeout=300)
    if proc.returncode != 0:               # the upload could not be retried: the run resumes from its checkpoints
        assert "--resume" in err, err
        again = _record(s3_store, "--resume")
        out, err = again.communicate(timeout=300)
        assert again.returncode == 0, err
    store = RunStore.open(str(s3_store))
    for step in (0, 10):
        for rank in range(2):
            store.verify_shard(step, rank)
    _same_run(store, RunStore.open(two_rank_store))


def test_a_recording_sigkilled_at_a_random_moment_resumes_bit_for_bit(two_rank_store, s3_store):
    """One SIGKILL of the launcher and its ranks, mid-step or mid-checkpoint (`make soak` kills 30 times)."""
    proc = _record(s3_store, *TWO_RANK_ARGS)
    time.sleep(random.Random().uniform(2.5, 6.0))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    final = _record(s3_store, *(["--resume"] if (s3_store / "zarr.json").exists() else TWO_RANK_ARGS))
    out, err = final.communicate(timeout=300)
    assert final.returncode == 0, err
    _same_run(RunStore.open(str(s3_store)), RunStore.open(two_rank_store))


def test_a_server_that_dies_mid_replay_fails_it_in_one_line_per_process_and_the_replay_resumes(recorded, s3_server,
                                                                                                tmp_path):
    """Killed while rank 1 writes the replay's checkpoint 6 and kept down past REPLAY_S3_RETRY_SECONDS: each
    process says what happened in one line (no debug dump of the S3 client's error), the last one what to do;
    with the server back, the replay resumed from what it committed equals the record."""
    marks = tmp_path / "marks"
    marks.mkdir()
    window = ["run", str(recorded), "--from", "4", "--to", "11", "--checkpoint-every", "2"]
    proc = subprocess.Popen([sys.executable, "-m", "replay", *window], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=child_env({**os.environ, "REPLAY_FAULT": "shard-pause:6:1",
                                           "REPLAY_FAULT_ONCE": str(marks), "REPLAY_S3_RETRY_SECONDS": "3"}))
    try:
        _wait_for(lambda: (marks / "paused").exists() or proc.poll() is not None, what="rank 1 writing checkpoint 6")
        assert proc.poll() is None, proc.communicate()
        s3_server.kill()
        (marks / "go").touch()
        _, err = proc.communicate(timeout=300)
    finally:
        s3_server.start()
    assert proc.returncode != 0
    assert "Debug source" not in err and "RetryError" not in err and "Traceback" not in err, err
    said = [line for line in err.splitlines() if line.startswith(("rank ", "error:"))]
    assert said and all("did not answer" in line or "writing to the run store failed" in line for line in said), err
    assert said[-1].startswith("error:") and "--resume" in said[-1], said[-1]
    resumed = replay_cli("run", *window[1:], "--resume", "--verify", process=True)
    assert resumed.returncode == 0 and "bit for bit" in resumed.stdout, resumed.stderr
