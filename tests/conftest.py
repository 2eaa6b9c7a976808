"""Shared fixtures: real recordings made once per session through the real CLI (real processes, gloo)."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
from filelock import FileLock

from replay.config import Launcher
from replay.launch.forkserver import ForkServer, script_argv_forkable
from replay.launch.job import RANKS_ENV, RankJob, RankLauncher
from replay.launch.pool import RankPool
from replay.launch.ray_cluster import SYSTEM_CONFIG
from replay.launch.script import ScriptServer, script_forks
from replay.lifeline import child_env, guarded
from replay.processes import alive, descendants
from replay.recorder.command import environment
from replay.store import RunStore
from replay.store.location import Location
from tests import disks
from tests.disks import Tmpfs, Unavailable
from tests.s3server import S3Server

REPO = Path(__file__).resolve().parents[1]


def _tmpfs(path: str) -> bool:
    try:
        with open("/proc/self/mounts") as f:
            return any(line.split()[1:3] == [path, "tmpfs"] for line in f)
    except OSError:
        return False


# The session's temporary folders (tmp_path, the shared recordings, the S3 server's data) on a tmpfs where there is
# one: every commit of a store is made durable (fsync, syncfs: store/integrity.py), which on a disk shared with
# other work waits for all of its writes; on a tmpfs those calls are made and return at once. (The 3 recorder
# files of test_loader, test_draws and test_dcp took 12 s against 20 s, 2 cores, 2026-11-26.) PYTEST_DEBUG_TEMPROOT
# is pytest's own setting of where its temporary folders go (pytest-of-USER/pytest-N under it); set, it is kept.
# Only where it has room to spare (a container's /dev/shm is often 64 MiB): the suite writes about 1 GiB there.
if "PYTEST_DEBUG_TEMPROOT" not in os.environ and os.access("/dev/shm", os.W_OK) and _tmpfs("/dev/shm") \
        and shutil.disk_usage("/dev/shm").free >= 4 * 2**30:
    os.environ["PYTEST_DEBUG_TEMPROOT"] = "/dev/shm"


# The warm ranks the in-process commands of the running test are lent when it asks for them without naming them
# in each call: set by the `on_rank_pool` fixture for the test, never by the product (which takes them as an argument)
_lent_for_test: list[RankPool] = []

# The fork server of this worker's in-process commands that are lent no other ranks: the built-in trainer's local
# ranks of every such command are forked from it, as a `replay session`'s are from one server, instead of from a
# server of the command's own that imports torch and transformers again (about 4 s of CPU a command). Started at
# its first job, ended with the worker. A command given REPLAY_RANKS (fresh ranks) chooses its own.
_worker_forks = ForkServer()


class _WorkerRanks:
    """What the worker lends its in-process `replay run`s: the built-in trainer's local ranks forked from the
    worker's fork server (above); a user's script started for the replay, as `ScriptRanks` does, with its processes
    forked from a script fork server the worker keeps for each recorded environment and set of packages
    (launch/script.py `script_forks`), instead of one the replay starts and ends (about 1.3 s of CPU a process for
    the nanoGPT example, 4 s for the Trainer's)."""

    def __init__(self) -> None:
        self._scripts: dict[tuple, ForkServer | None] = {}

    def takes(self, launcher: Launcher, world_size: int) -> bool:
        return launcher is Launcher.CUSTOM or _worker_forks.takes(launcher, world_size)

    def run(self, job: RankJob) -> None:
        command = RunStore.open(job.store).manifest.command
        if command is None:
            _worker_forks.run(job)
            return
        # each rank goes to its script's own directory: one server serves every recording of the same packages
        key = (script_argv_forkable(command.argv), tuple(command.imports), tuple(sorted(command.env.items())))
        if key not in self._scripts:
            self._scripts[key] = script_forks(command, environment(command, child_env(os.environ)))
        with ScriptServer(command, keep=False, forks=self._scripts[key]) as once:
            once.run(job)

    def close(self) -> None:
        for server in self._scripts.values():
            if server is not None:
                server.close()


_worker_ranks = _WorkerRanks()


def _default_ranks(args: tuple[str, ...], env: dict | None) -> RankLauncher | None:
    if _lent_for_test:
        return _lent_for_test[0]
    if RANKS_ENV in (env or {}) or RANKS_ENV in os.environ:
        return None
    return _worker_ranks if args[:1] == ("run",) else _worker_forks


def replay_cli(*args: str, env: dict | None = None, timeout: float = 600, process: bool = False,
               ranks: RankLauncher | None = None, input: str | None = None) -> subprocess.CompletedProcess:
    """Run `replay ARGS` as a user would: in this process (click's own test runner, the output captured at
    the file descriptors, so the ranks' output too), or in a fresh process (`process=True`, and whenever a
    fault is armed: a fault kills the process it fires in), which ends with the test run if that dies.
    `ranks`: in this process, the runs they take go to those warm ranks (the `rank_pool` fixture, by default
    the test's `on_rank_pool`, else the worker's fork server; a script's kept-up ranks), lent to the command as
    click's context object (cli.py `_lent_ranks`). `input`: the command's standard input."""
    ranks = ranks if ranks is not None else _default_ranks(tuple(map(str, args)), env)
    if process or (env and "REPLAY_FAULT" in env):
        full_env = child_env({k: v for k, v in os.environ.items() if k != "REPLAY_FAULT"} | (env or {}))
        return subprocess.run([sys.executable, "-m", "replay", *args], capture_output=True, text=True,
                              env=full_env, timeout=timeout, cwd=REPO, input=input)
    from click.testing import CliRunner

    from replay.cli import main

    result = CliRunner(capture="fd").invoke(main, [str(a) for a in args], env={"REPLAY_FAULT": None, **(env or {})},
                                            obj=ranks, input=input)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(["replay", *args], result.exit_code, result.stdout, result.stderr)


# Two tiers (docs/testing.md). A test is `integration` when it starts processes (ranks, scripts, Ray) or
# reads a recorded run, and then it lives in a file named `*_integration.py`, which marks it; the rest are
# unit tests, in this process. A test elsewhere that is marked integration or uses one of these fixtures (all
# of which record a run or start processes) is refused at collection, and a unit test that starts a process
# fails (`_refuse_processes`), so the tiers cannot drift apart.
INTEGRATION_FIXTURES = {"two_rank_store", "spike_store", "zero1_store", "reported_spike", "ray_local",
                        "planted_data", "planted_layer", "two_node_cluster", "other_seed", "interpreted",
                        "token_file", "replayed_store", "analysed_store", "rank_pool", "on_rank_pool",
                        "s3_server", "s3_store", "small_disk", "read_only"}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name.endswith("_integration.py"):
            item.add_marker(pytest.mark.integration)
        elif (uses := INTEGRATION_FIXTURES & set(item.fixturenames)) or item.get_closest_marker("integration"):
            why = f"it uses {', '.join(sorted(uses))}" if uses else "marked `integration`"
            raise pytest.UsageError(f"{item.nodeid} is an integration test ({why}): move it to a file named "
                                    "`*_integration.py` beside this one, unmarked (docs/testing.md)")
    # `make test`'s two workers take the files in this order (--no-loadscope-reorder): the integration files
    # longest first (FILE_SECONDS), so that no long file starts near the end while the other worker runs out of
    # work, then the other integration files, then the many short unit tests, which fill the end of both.
    items.sort(key=lambda item: (item.get_closest_marker("integration") is None, -_file_seconds(item.path)))


def _file_seconds(path: Path) -> float:
    tests = REPO / "tests"
    return FILE_SECONDS.get(path.relative_to(tests).as_posix(), 0) if path.is_relative_to(tests) else 0


# The integration files' seconds in `make test` (their tests' setup, call and teardown, summed; tests/conftest.py
# orders the files by it), the 32 longest, from a run on 2 cores, AMD EPYC without AVX-512 (2026-11-27; the
# Accelerate file's dispatcher tests and the script diffs of the nanoGPT, Llama and Lightning files, added after,
# measured alone): what matters is their order. A new long file belongs here; the others run after these in
# collection order.
FILE_SECONDS = {
    "examples/test_accelerate_integration.py": 354, "launch/test_multinode_integration.py": 246,
    "examples/test_hf_trainer_integration.py": 232, "examples/test_lightning_integration.py": 240,
    "store/test_s3_store_integration.py": 215, "examples/test_nanogpt_integration.py": 280,
    "bisect/test_narrow_integration.py": 184, "examples/test_streaming_integration.py": 179,
    "test_results_integration.py": 159, "examples/test_dataloader_integration.py": 155,
    "recorder/test_zero_integration.py": 143, "kernels/test_triton_fa2_integration.py": 141,
    "recorder/test_fsdp2_integration.py": 133, "examples/test_llama_integration.py": 144,
    "launch/test_record_deepspeed_integration.py": 118, "analysis/test_jobs_integration.py": 108,
    "recorder/test_loop_integration.py": 83, "recorder/test_environment_integration.py": 72,
    "replayer/test_replays_integration.py": 72, "launch/test_pool_integration.py": 69,
    "analysis/test_cluster_integration.py": 68, "launch/test_script_integration.py": 68,
    "launch/test_forkserver_integration.py": 60, "replayer/test_reach_integration.py": 59,
    "launch/test_lifeline_integration.py": 57, "launch/test_soak_integration.py": 57,
    "test_bad_input_integration.py": 47, "train/test_fewer_ranks_integration.py": 43,
    "replayer/test_diff_integration.py": 36, "analysis/test_series_integration.py": 32,
    "analysis/test_compare_integration.py": 25, "recorder/test_loader_integration.py": 24,
}


def pytest_collection_finish(session):
    # What collection imported (torch, transformers, zarr, the package: millions of objects) is set aside from
    # the garbage collector (gc.freeze, Python's own): a full collection, which accelerate runs after every
    # Trainer.train (free_memory) and Python whenever enough objects were made, then visits only what was made
    # since. Nothing frozen is freed; what the tests make is collected as before.
    gc.freeze()


def pytest_unconfigure(config):
    _worker_ranks.close()
    _worker_forks.close()
    gc.unfreeze()   # the interpreter's exit frees them as usual (nanobind's modules count what is left as leaked)


_running_unit_test: list[str] = []   # the node id of the unit test running in this process, if one is
PROCESS_EVENTS = {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system", "os.exec"}


def _refuse_processes(event: str, args: tuple) -> None:
    if event == "subprocess.Popen" and list(args[1]) == ["uname", "-p"]:
        return   # the standard library's platform.platform() asks uname once a process (the run's fingerprint)
    if _running_unit_test and event in PROCESS_EVENTS:
        raise RuntimeError(f"{_running_unit_test[0]} is a unit test but starts a process ({event}): move it to a "
                           "file named `*_integration.py` (docs/testing.md)")


sys.addaudithook(_refuse_processes)


def _as_unit_test(item: pytest.Item) -> Iterator[None]:
    # A GPU test's Triton kernels start the host's C compiler on their first launch; GPU tests never run in CI.
    if item.get_closest_marker("integration") is None and item.get_closest_marker("gpu") is None:
        _running_unit_test.append(item.nodeid)
    try:
        return (yield)
    finally:
        _running_unit_test.clear()


# The tests in this process compute on one thread: their tensors are small (thousands of tiny ops: a second
# OpenMP thread gains nothing on them and, on a busy machine, loses many-fold, each op waiting for a
# descheduled sibling: tests/kernels/test_flash_emu.py took 0.7 s on one thread, 12-16 s on two, 2 cores,
# 2026-11-26). A run's own thread count is its config's or the script's (recorded, and set again by its
# replays), so a test that starts one, or sets them itself, gets what it asks for; the next test gets one again.
TEST_THREADS = 1


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    if torch.get_num_threads() != TEST_THREADS:
        torch.set_num_threads(TEST_THREADS)
    return (yield from _as_unit_test(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _as_unit_test(item))


T = TypeVar("T")


def made_once(tmp_path_factory, name: str, make: Callable[[Path], T]) -> T:
    """`make(folder)` once for the whole test run, its result returned to every caller. Under pytest-xdist
    (`make test`) the first worker to ask makes it while the others wait on a lock, then they read it
    (pytest-xdist's documented recipe for session fixtures); serially it is an ordinary session fixture."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return make(tmp_path_factory.mktemp(name))
    root = tmp_path_factory.getbasetemp().parent   # the run's, shared by its workers
    done = root / f"{name}.made"
    with FileLock(root / f"{name}.lock"):
        if done.exists():
            return pickle.loads(done.read_bytes())
        folder = root / name
        shutil.rmtree(folder, ignore_errors=True)   # a worker that failed to make it left this
        folder.mkdir()
        value = make(folder)
        done.write_bytes(pickle.dumps(value))
        return value


@pytest.fixture(scope="session")
def rank_pool() -> Iterator[RankPool]:
    """Two warm ranks for this worker (launch/pool.py), started at their first use. Nothing runs on them
    unless it asks: the shared recordings are made on them (how a fixture's ranks start is no test's
    subject), and so are the in-process runs of a module that says so with
    `pytestmark = pytest.mark.usefixtures("on_rank_pool")`. Every other run starts its ranks as the
    user's command does."""
    pool = RankPool(2, forks=_worker_forks)   # forked from the worker's fork server, which has imported already
    yield pool
    pool.close()


@pytest.fixture
def on_rank_pool(rank_pool) -> Iterator[None]:
    """The test's in-process local 2-rank runs go to the worker's warm ranks."""
    _lent_for_test.append(rank_pool)
    try:
        yield
    finally:
        _lent_for_test.clear()


@pytest.fixture(scope="session")
def ray_local() -> Iterator[str]:
    """A real local Ray cluster, started once (about 3 s) and shared by the tests that use Ray: in this
    process, and by the commands a test starts with RAY_ADDRESS set to the address it yields. Its
    processes end with the test run, however that ends (lifeline.py)."""
    import ray

    with guarded():
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.ERROR,
                 _system_config=SYSTEM_CONFIG)   # workers at the tests' niceness (launch/ray_cluster.py)
        yield ray.get_runtime_context().gcs_address
        ray.shutdown()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Iterator[S3Server]:
    """This worker's S3 server (SeaweedFS on 127.0.0.1, tests/s3server.py), started at its first use (about
    1.5 s) and stopped at the end of the session."""
    server = S3Server(tmp_path_factory.mktemp("s3"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_store(s3_server, monkeypatch, request) -> Location:
    """A fresh, empty prefix of the S3 server's bucket, with the AWS_* variables that reach it set for the
    test (and for the processes it starts)."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ALLOW_HTTP"):
        monkeypatch.delenv(name, raising=False)
    name = "".join(c if c.isalnum() else "-" for c in request.node.name)[:60]
    return Location.parse(f"s3://{s3_server.bucket}/{name}-{uuid.uuid4().hex[:8]}")


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Callable[[int], Tmpfs]]:
    """`small_disk(size_kib)`: a tmpfs of that size mounted for the test (tests/disks.py: `fill` it, `free`
    it); the test is skipped, saying why, where this machine or user cannot mount one."""
    with contextlib.ExitStack() as mounted:
        def mount(size_kib: int) -> Tmpfs:
            try:
                return mounted.enter_context(Tmpfs(tmp_path / f"disk-{uuid.uuid4().hex[:6]}", size_kib))
            except Unavailable as e:
                pytest.skip(f"no disk to fill: {e}")
        yield mount


@pytest.fixture
def read_only() -> Iterator[Callable[[Path], Path]]:
    """`read_only(path)`: where to find `path` made read-only for the test's processes, for real (tests/disks.py:
    a read-only bind mount as root, chmod a-w otherwise); skipped, saying why, where neither can be made."""
    with contextlib.ExitStack() as made:
        def make(path: Path) -> Path:
            try:
                return made.enter_context(disks.read_only(path))
            except Unavailable as e:
                pytest.skip(f"no read-only folder: {e}")
        yield make


BENCHMARKS = sorted(p.name for p in (REPO / "benchmarks").glob("bench_*.py"))


def wait_for_descendants(pid: int, want, timeout: float = 120) -> dict[int, int]:
    """Poll until the descendants of `pid` whose command line satisfies `want(cmdline)` are found; returns
    every descendant then ({pid: start time})."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = descendants(pid)
        if want([_cmdline(p) for p in found]):
            return found
        time.sleep(0.05)
    raise AssertionError(f"the processes wanted never appeared under pid {pid}: {[_cmdline(p) for p in found]}")


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def assert_gone(procs: dict[int, int], within: float = 2.0) -> None:
    """Every one of `procs` ({pid: start time}) has ended within `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(alive(p, s) for p, s in procs.items()):
        time.sleep(0.02)
    left = {p: _cmdline(p) for p, s in procs.items() if alive(p, s)}
    assert not left, f"still running {within} s later: {left}"


def killed_by_fault(fault: str, *args: str, env: dict | None = None) -> None:
    """Run `python -m replay ARGS` with the fault hook REPLAY_FAULT=fault, which SIGKILLs it, then kill
    what it left behind (the local Ray processes it started share its new process group)."""
    proc = subprocess.Popen([sys.executable, "-m", "replay", *args],
                            env=os.environ | (env or {}) | {"REPLAY_FAULT": fault}, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    assert proc.wait(timeout=300) == -signal.SIGKILL
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def killed_and_resumed(store: Path, args: list[str], fault: str = "shard-half:8:0") -> None:
    """`replay record --store STORE ARGS` with rank 0 SIGKILLed at `fault` (one line says so), then `--resume`."""
    killed = replay_cli("record", "--store", str(store), *args, env={"REPLAY_FAULT": fault})
    assert "rank 0 was killed by signal 9" in error_line(killed)
    resumed = replay_cli("record", "--store", str(store), "--resume")
    assert resumed.returncode == 0, resumed.stderr


def error_line(result: subprocess.CompletedProcess) -> str:
    """The one `error:` line a failing command must print (and no traceback)."""
    assert result.returncode != 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


# The reference 2-rank recording: several tests read it, one resumes a killed copy and compares to it.
TWO_RANK_ARGS = ["--steps", "30", "--nproc", "2", "--checkpoint-every", "10"]


def _recorded(tmp_path_factory, request, name: str, *args: str) -> Path:
    def record(folder: Path) -> Path:
        result = replay_cli("record", "--store", str(folder / "run"), *args,
                            ranks=request.getfixturevalue("rank_pool"))
        assert result.returncode == 0, result.stderr
        return folder / "run"

    return made_once(tmp_path_factory, name, record)


@pytest.fixture(scope="session")
def two_rank_store(tmp_path_factory, request) -> Path:
    return _recorded(tmp_path_factory, request, "two_rank", *TWO_RANK_ARGS)


@pytest.fixture(scope="session")
def spike_store(tmp_path_factory, request) -> Path:
    """The `spike` preset on 2 ranks (400 steps, about 25 s): a real recorded loss spike."""
    return _recorded(tmp_path_factory, request, "spike", "--preset", "spike", "--nproc", "2")


# The reference DeepSpeed recording (ZeRO-1, 2 ranks): its own tests read it, the replay test replays a copy.
DS_ARGS = ["--steps", "12", "--nproc", "2", "--launcher", "deepspeed", "--zero-stage", "1", "--checkpoint-every", "4"]


@pytest.fixture(scope="session")
def zero1_store(tmp_path_factory, request) -> Path:
    return _recorded(tmp_path_factory, request, "zero1", *DS_ARGS)


@pytest.fixture(scope="session")
def reported_spike(spike_store, tmp_path_factory, request) -> Path:
    """The spike run, a plain replay checkpointing every 2 steps up to the spike, analysed, reported
    (shared by the report's test and the results pipeline's, which treat it as read-only)."""
    from replay.store import RunStore

    def report(folder: Path) -> Path:
        request.getfixturevalue("ray_local")   # the analysis's cluster, started only by the worker making this
        store = folder / "spike"
        shutil.copytree(spike_store, store)
        spike = int(RunStore.open(store).spikes[0]["step"])
        result = replay_cli("run", str(store), "--from", str(spike - 20), "--to", str(spike - 1),
                            "--checkpoint-every", "2", "--verify", ranks=request.getfixturevalue("rank_pool"))
        assert result.returncode == 0 and "bit for bit" in result.stdout, result.stderr
        for args in (("analyze", str(store), "--workers", "2"), ("report", str(store))):
            result = replay_cli(*args)
            assert result.returncode == 0, result.stderr
        return store

    return made_once(tmp_path_factory, "reported_spike", report)


@pytest.fixture
def store_copy(two_rank_store, tmp_path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(two_rank_store, dst)
    return dst


def new_store(path: Path, config=None, replay=None, first_step: int = 0):
    """A store for tests of the store itself: a manifest that says little, a step log that starts at
    `first_step`; `replay` (a ReplaySpec) makes it a replay."""
    from replay.config import Launcher, RunConfig
    from replay.store import RunStore
    from replay.store.manifest import DataInfo, Manifest

    data = DataInfo(embedded=False, path=None, bytes=0, method="none", digest="", source="a test")
    manifest = Manifest(kind="replay" if replay else "run", config=config or RunConfig(), world_size=1,
                        launcher=Launcher.CUSTOM, data=data, created=0.0, replay=replay)
    return RunStore.create(path, manifest, first_step=first_step)


def corrupt_tensor(store_path: Path, step: int, rank: int, key: str, byte: int = 100) -> str:
    """Flip one bit of one stored tensor in place, behind the store's back (as a bad disk would); returns
    the damaged chunk's path relative to the store."""
    from replay.store import RunStore

    store = RunStore.open(store_path)
    offset = store.shard_index(step, rank)[key]["offset"] + byte
    chunk_bytes = json.loads((store_path / f"checkpoints/{step:08d}/rank{rank}/zarr.json").read_text())[
        "attributes"]["chunk_bytes"]
    chunk = f"checkpoints/{step:08d}/rank{rank}/tensors/c/{offset // chunk_bytes}"
    data = bytearray((store_path / chunk).read_bytes())
    data[offset % chunk_bytes] ^= 0x01
    (store_path / chunk).write_bytes(bytes(data))
    return chunk


def tree_snapshot(path: Path) -> dict[str, tuple[int, int]]:
    """Every file under path with its size and mtime: to show a failed command changed nothing."""
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(path.rglob("*")) if p.is_file()}


def tensors_equal(a: Any, b: Any) -> bool:
    """Bitwise equality of two state trees (used by tests and verification)."""
    if isinstance(a, torch.Tensor):   # by their bits (NaN equals NaN, -0.0 does not equal 0.0)
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and bool(
            torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(tensors_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return a == b
