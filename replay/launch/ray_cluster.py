"""Ray: connecting to a cluster (or starting a local one) and running work items on it.

Work items are plain Ray tasks of one CPU each; at most `max_in_flight` are submitted at a time
(`ray.wait` as they finish), transient I/O errors (OSError) and dead workers are retried by Ray, and
each finished result is handed to the caller at once, so a crash loses only what was in flight.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn

from replay import faults
from replay.errors import ReplayError, UsageError
from replay.kernels.plan import plugin_env
from replay.lifeline import Guardian
from replay.store.s3 import configuration

RETRIES = 3
_connected = False   # whether this process has connected to Ray (see `exit_process`)

# Ray starts its workers at niceness 15, below every other process on the machine: beside busy processes a
# probe's ranks or an analysis task get a sliver of a core (a bisect's probes ran 20x slower beside two busy
# processes on 2 cores). The clusters replay starts run their workers as any other process.
SYSTEM_CONFIG = {"worker_niceness": 0}


def cluster_address(address: str | None = None) -> str | None:
    """The Ray cluster a command joins: --ray-address, else RAY_ADDRESS; None: no cluster (a local one, or none)."""
    return address or os.environ.get("RAY_ADDRESS") or None


def session_open() -> bool:
    """Whether this process is already connected to Ray (a test's or a notebook's session, reused)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


@contextlib.contextmanager
def ray_session(address: str | None = None, workers: int | None = None) -> Iterator[int]:
    """Yields how many tasks may run at once. An address (or RAY_ADDRESS) joins that cluster; without
    one a local cluster of `workers` CPUs (default: all) is started and stopped afterwards. A session
    already open in this process (tests, notebooks) is reused and left open."""
    # lazy, as every ray import here: ray (0.3 s) only once Ray work starts; the CLI imports this module
    import ray

    if workers is not None and workers < 1:
        raise UsageError(f"--workers must be >= 1, got {workers}")
    address = cluster_address(address)
    owned = not ray.is_initialized()
    if not owned and address and ":" in address and address != ray.get_runtime_context().gcs_address:
        raise UsageError(f"this process is connected to the Ray cluster at {ray.get_runtime_context().gcs_address}, "
                         f"not {address}: call ray.shutdown() first, or run the command in a process of its own")
    guardian = Guardian()
    if owned and address:
        _check_reachable(address)
    if owned:
        kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": "ERROR", "log_to_driver": False}
        if address:
            kwargs["address"] = address
        else:   # a cluster of our own, even where `ray start` left one running on this machine
            kwargs.update(address="local", num_cpus=workers or os.cpu_count() or 1, _system_config=SYSTEM_CONFIG)
        if not address:   # the local cluster's processes must not outlive this one (lifeline.py)
            guardian.start()
        global _connected
        _connected = True   # Ray's native threads start with the attempt, connected or not
        try:
            with _quiet_stderr():
                ray.init(**kwargs)
        except Exception as e:   # ray raises ConnectionError, RuntimeError, AuthenticationError, ...
            guardian.stop()
            where = f"the Ray cluster at {address}" if address else "a local Ray cluster"
            if "auth" in f"{type(e).__name__} {e}".lower():
                raise UsageError(f"{where} refused this client's authentication token: give it the cluster's "
                                 "token (RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH), or start a trusted cluster with "
                                 "RAY_AUTH_MODE=disabled") from None
            raise UsageError(f"cannot connect to {where}: {str(e).splitlines()[0] if str(e) else type(e).__name__}; "
                             "check --ray-address / RAY_ADDRESS (host:port of the head node)") from None
    restore = _cluster_errors_off_stdout() if owned else None
    try:
        cpus = int(ray.cluster_resources().get("CPU", 1))
        yield max(1, min(cpus, workers) if workers else cpus)
    finally:
        if owned:
            ray.shutdown()
        if restore is not None:
            restore()
        guardian.stop()


def _cluster_errors_off_stdout() -> Callable[[], None]:
    """Ray's driver prints the cluster's error messages (a raylet's death, with its last log lines) on stdout,
    which holds this command's answer: they go to stderr under --debug, else nowhere (the command says what
    failed, in its own words). Returns what undoes it."""
    # lazy (see ray_session); Ray's own module, whose printer its error listener looks up at each message
    import ray._private.worker as ray_worker

    printer = ray_worker.print_to_stdstream

    def to_stderr(data: dict[str, Any], ignore_prefix: bool) -> None:
        if os.environ.get("REPLAY_DEBUG"):
            printer({**data, "is_err": True}, ignore_prefix)

    ray_worker.print_to_stdstream = to_stderr

    def restore() -> None:
        ray_worker.print_to_stdstream = printer

    return restore


def exit_process(code: object) -> NoReturn:
    """End the `replay` program with `code` (a SystemExit's). Once Ray has been connected in this process,
    ray.shutdown() leaves native threads of Ray behind (its GCS client's process-wide I/O thread, gRPC's
    timers and executors) that run on while the C++ library's static objects are destroyed at exit, and
    can abort the process there (SIGABRT, "Mutex corrupt") after its work is done: the exit then does
    Python's part (atexit handlers, flushed output) and skips the native one."""
    if not _connected:
        raise SystemExit(code)
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:   # sys.exit("message"), as the interpreter does it
        print(code, file=sys.stderr)
        status = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def cluster_cpus() -> tuple[int, int]:
    """(CPUs of the connected cluster, CPUs of its largest node)."""
    # lazy (see ray_session)
    import ray

    nodes = [int(n.get("Resources", {}).get("CPU", 0)) for n in ray.nodes() if n.get("Alive")]
    return max(1, sum(nodes)), max(1, max(nodes, default=1))


def _check_reachable(address: str) -> None:
    """Ray retries an unreachable head for minutes; a plain TCP connect answers in seconds."""
    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise UsageError(f"--ray-address {address!r} is not host:port (the head node's GCS address)")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise UsageError(f"cannot connect to the Ray cluster at {address}: {e.strerror or e}; is `ray start "
                         "--head` running there? check --ray-address / RAY_ADDRESS") from None


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Ray prints start-up banners on the driver's stderr; keep them out of the user's way unless --debug."""
    if os.environ.get("REPLAY_DEBUG"):
        yield
        return
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    sys.stderr.flush()
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def worker_options() -> dict[str, Any]:
    """What Ray workers must see of this process's environment that they may not inherit (they can be on
    other nodes, or started before it was set): attention plugins (kernels/plan.py), how to reach a store
    on an object store (store/s3.py) and a test's armed fault (replay/faults.py)."""
    env = {**plugin_env(), **configuration(), **faults.armed()}
    return {"runtime_env": {"env_vars": env}} if env else {}


def run_tasks(fn: Callable, items: Iterable[Any], max_in_flight: int, on_result: Callable[[Any, Any], None],
              retries: int = RETRIES) -> None:
    """Run `fn(item)` as a Ray task for every item, at most `max_in_flight` at once; `on_result(item,
    result)` runs on the driver as each finishes (in completion order)."""
    # lazy (see ray_session)
    import ray

    options = {"num_cpus": 1, "max_retries": retries, "retry_exceptions": [OSError], **worker_options()}
    remote = ray.remote(**options)(fn)
    pending: dict[Any, Any] = {}
    queue = list(items)
    queue.reverse()
    while queue or pending:
        while queue and len(pending) < max_in_flight:
            item = queue.pop()
            pending[remote.remote(item)] = item
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            item = pending.pop(ref)
            try:
                result = ray.get(ref)
            except ray.exceptions.RayTaskError as e:
                if isinstance(e.cause, ReplayError):   # a user-facing error inside a task: its own line
                    raise e.cause from None
                raise
            on_result(item, result)
