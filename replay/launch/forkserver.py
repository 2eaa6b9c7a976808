"""The fork server: one process that has imported torch, transformers and the built-in trainer, and forks
ranks of it on request, so that a rank costs its work and not the seconds every fresh rank spends importing.

`ForkServer.start()` starts `python -m replay.launch.forkserver FD`, FD one end of a Unix socket pair whose
other end only the starting process holds. The server dies with that process (lifeline.py: PR_SET_PDEATHSIG),
and every rank it forks dies with the server (the same, set in the rank towards it): a rank never outlives the
command that asked for it. When that command closes its end (or dies), the server kills its ranks and leaves.

A fork copies only the thread that forks, so the server runs nothing that starts a thread: no process group,
no CUDA, no torch operation (its intra-op pool starts at the first), and numpy's OpenBLAS keeps no worker
threads (OPENBLAS_NUM_THREADS=1 in the server's environment only; the ranks compute with torch, whose thread
count each rank sets). It checks that it is one thread before every fork; where it is not, it says so and the
command starts fresh ranks instead.

A forked rank takes the environment the command gave it (exactly a fresh rank's: RANK, WORLD_SIZE,
MASTER_ADDR/PORT, the lease, ...), writes its output to the command's stderr (the descriptor comes with the
request), resets the signal handlers and `sys.excepthook` the server inherited, reseeds Python's `random`,
then runs as `python -m replay.launch.worker STORE` would (launch/worker.py) and exits with its code.

A script fork server (`ForkServer(script=...)`, launch/script.py) does the same for a user's training script:
started in the script's recorded environment and working directory, it imports the installed packages the
recording had imported (torch, transformers, Lightning, ...: `CommandInfo.imports`) and `replay`'s recorder, then
forks each of the script's ranks, which runs the script as `python SCRIPT ARGS` (or `-m MODULE`) would: its
`sys.argv`, `sys.path[0]` and `__main__`, numpy's BLAS threads and RNG as a fresh process has them.

Messages, one JSON object per SOCK_SEQPACKET message:
    command -> server  {"argv": [...], "envs": [{...}, ...]} + the ranks' output descriptor (and, for a script,
                       "fd_env" and "rank_fds": the other descriptors sent, by index, each rank's own, named to it
                       in that variable as "FD,FD"): fork one rank per env
                       {"kill": [pid, ...]}: SIGKILL those ranks (still the server's children)
    server -> command  {"ready": true} or {"refused": why}, once its imports are done
                       {"pids": [pid, ...]}: the ranks of a request, by local rank; or {"refused": why}
                       {"exit": pid, "status": code}: a rank ended (a signal: minus its number, as subprocess says)
"""

from __future__ import annotations

import atexit
import builtins
import ctypes
import gc
import importlib
import importlib.machinery
import io
import json
import os
import random
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from replay.config import Launcher
from replay.launch.fresh import FreshRanks
from replay.launch.job import RankJob
from replay.launch.local import TICK, collector_paused, wait_for_ranks
from replay.lifeline import PARENT_ENV, child_env, follow_parent

MESSAGE_BYTES = 1 << 20
SCRIPT_FLAGS = ("-u",)   # interpreter options a forked script takes as a fresh one would (others: a fresh process)


@dataclass(frozen=True)
class ScriptImage:
    """What a script fork server is made of: the packages it imports, and the environment and working directory
    it imports them in (the script's own, as recorded)."""

    imports: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str


def script_argv_forkable(argv: Sequence[str]) -> bool:
    """Whether a script started as `python ARGV` can be forked from a script fork server: `SCRIPT [ARGS]` or
    `-m MODULE [ARGS]`, after no interpreter option but `-u`."""
    rest = list(argv)
    while rest and rest[0] in SCRIPT_FLAGS:
        rest.pop(0)
    return bool(rest) and (rest[0] == "-m" and len(rest) > 1 or not rest[0].startswith("-"))


class ForkServer:
    """A launcher (launch/job.py) of the built-in trainer's local ranks, forked from a server that has imported
    everything a rank needs; or, given `script`, the server a user's script's ranks are forked from
    (`fork_script`). Started at its first job, or by `start()` ahead of it; `close()` ends it and its ranks."""

    def __init__(self, script: ScriptImage | None = None) -> None:
        self.script = script
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._ready: bool | None = None         # None: its imports are under way
        self.refused: str | None = None         # why it cannot fork (its ranks then start fresh)
        self._ranks: dict[int, _ForkedRank] = {}
        self.forked: list[int] = []             # the pids of the last job's ranks

    def takes(self, launcher: Launcher, world_size: int) -> bool:
        return (self.script is None and launcher is Launcher.LOCAL and world_size > 1
                and sys.platform.startswith("linux"))

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Start the server now (it imports while other work goes on); a no-op while one is up."""
        if self.alive:
            return
        self.close()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        args = [sys.executable, "-m", "replay.launch.forkserver", str(theirs.fileno())]
        base: Mapping[str, str] = os.environ
        cwd = None
        if self.script is not None:
            args += ["--imports", ",".join(self.script.imports)]
            base, cwd = self.script.env, self.script.cwd
        env = child_env({**base, "OPENBLAS_NUM_THREADS": "1"})
        # what its imports print goes where the ranks' output goes, never into the command's answer on stdout
        self._proc = subprocess.Popen(args, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=2,
                                      pass_fds=(theirs.fileno(),))
        theirs.close()
        self._sock, self._ready, self.refused = ours, None, None

    def wait_ready(self) -> bool:
        """Block until the server has imported: whether it forks (else `refused` says why)."""
        self.start()
        while self._ready is None:
            self._drain(None)
        return self._ready

    def run(self, job: RankJob) -> None:
        node = job.node_here()
        envs = [job.rank_env(node, local) for local in range(len(node.ranks))]
        ranks = self._fork(job.args(), envs) if self.wait_ready() else None
        if ranks is None:
            print(f"note: the fork server cannot fork ranks ({self.refused}): starting fresh ones", file=sys.stderr,
                  flush=True)
            FreshRanks().run(job)
            return
        failures = wait_for_ranks(ranks, ranks=node.ranks)
        if failures:
            raise job.failed(failures)

    def fork_script(self, argv: list[str], envs: list[dict[str, str]], fd_env: str,
                    rank_fds: list[tuple[int, ...]], cwd: str | None = None) -> list[_ForkedRank] | None:
        """The script's ranks forked for `envs`, as `python ARGV` in `cwd` (default: the server's, the script's),
        each given its descriptors `rank_fds[i]` (their numbers in it named in `fd_env`); None: the server cannot
        fork (`refused` says why), and the caller starts the script as a fresh process."""
        assert self.script is not None, "a script fork server"
        return self._fork(argv, envs, {"fd_env": fd_env, "cwd": cwd}, rank_fds) if self.wait_ready() else None

    def fork_warm(self, envs: list[dict[str, str]], fd_env: str, rank_fds: list[tuple[int, ...]], out: int
                  ) -> list[_ForkedRank] | None:
        """Warm ranks of the built-in trainer (launch/pool.py) forked for `envs`, each `worker --serve` on its
        descriptors `rank_fds[i]` (named to it in `fd_env`), its output to `out`; None: the server cannot fork
        (`refused` says why), and the caller starts fresh ones."""
        assert self.script is None, "the built-in trainer's fork server"
        return self._fork(["--serve"], envs, {"fd_env": fd_env}, rank_fds, out) if self.wait_ready() else None

    def _fork(self, argv: list[str], envs: list[dict[str, str]], extra: dict[str, Any] | None = None,
              rank_fds: list[tuple[int, ...]] | None = None, out: int = 2) -> list[_ForkedRank] | None:
        """The ranks forked for `envs`, their output to `out` (None: the server refused to fork)."""
        assert self._sock is not None, "wait_ready() started the server"
        sys.stderr.flush()
        fds, indices = [out], []
        for own in rank_fds or []:
            indices.append(list(range(len(fds), len(fds) + len(own))))
            fds += own
        request = {"argv": argv, "envs": envs, **(extra or {}), **({"rank_fds": indices} if rank_fds else {})}
        try:
            socket.send_fds(self._sock, [json.dumps(request).encode()], fds)
        except OSError:   # it died since it was ready: the ranks are gone before they began
            return [_ForkedRank(self, None) for _ in envs]
        pids: list[int] | None = None
        while pids is None and self._sock is not None and self._ready:
            pids = self._drain(None)
        if pids is None:   # it refused (see run), or died while forking: no rank of it began
            return None if self._ready is False and self._sock is not None else [
                _ForkedRank(self, None) for _ in envs]
        ranks = [_ForkedRank(self, pid) for pid in pids]
        self.forked = list(pids)
        self._ranks.update({r.pid: r for r in ranks if r.pid is not None})
        return ranks

    def _drain(self, timeout: float | None) -> list[int] | None:
        """Read what the server says within `timeout` seconds (None: until one message): the pids of a request
        when those came. Its death (EOF) ends every rank it held, as the kernel does (PDEATHSIG)."""
        if self._sock is None:
            return None
        pids = None
        while select.select([self._sock], [], [], timeout)[0]:
            data = self._sock.recv(MESSAGE_BYTES)
            if not data:
                self._lost()
                return None
            message = json.loads(data)
            if "exit" in message:
                rank = self._ranks.pop(message["exit"], None)
                if rank is not None:
                    rank.returncode = message["status"]
            elif "pids" in message:
                pids = message["pids"]
            else:
                self._ready, self.refused = "ready" in message, message.get("refused")
            timeout = 0
        return pids

    def _lost(self) -> None:
        for rank in self._ranks.values():
            rank.returncode = -signal.SIGKILL
        self._ranks = {}
        if self._sock is not None:
            self._sock.close()
        self._sock = None
        if self._ready is None:
            self._ready, self.refused = False, "it died while importing"

    def _send(self, message: dict[str, Any]) -> None:
        if self._sock is not None:
            try:
                self._sock.send(json.dumps(message).encode())
            except OSError:
                self._lost()

    def close(self) -> None:
        """End the server; it kills any rank of it still running."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            if self._ready is None:   # still importing: it has no rank, and would see the socket closed only after
                self._proc.kill()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        self._lost()

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _ForkedRank:
    """A rank forked by the server, as launch/local.py's wait sees a process (`pid` None: never forked)."""

    def __init__(self, server: ForkServer, pid: int | None):
        self.server, self.pid = server, pid
        self.returncode: int | None = None if pid is not None else -signal.SIGKILL

    def poll(self) -> int | None:
        if self.returncode is None:
            self.server._drain(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout or 0)
            self.server._drain(TICK)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            self.server._send({"kill": [self.pid]})


# -- the server --------------------------------------------------------------------------------------------------


def serve(sock: socket.socket, imports: Sequence[str] | None = None) -> int:
    """Import, say whether forking is safe, then fork ranks on request until the command's end of `sock` closes.
    `imports`: a script fork server's packages (else the built-in trainer's)."""
    main: Callable[[list[str]], int]
    failed = None
    # lazy: these seconds of imports are the server's purpose; the command that starts it never loads torch
    with collector_paused():
        import torch
        import torch._dynamo  # noqa: F401  (torch imports it at a process's first optimizer: seconds of CPU a rank)
        import torch.distributed as dist

        if imports is None:
            from replay.launch import worker
            from replay.train import trainer  # noqa: F401  (with it, transformers' GPT-2 and the recorder)
            main = worker.main
        else:
            import replay.recorder.loop  # noqa: F401  (what every recorded script imports)
            for name in imports:
                try:
                    importlib.import_module(name)
                except BaseException as e:   # a package's import may do anything; the script imports it then
                    failed = f"importing {name} failed ({type(e).__name__}: {e})"
                    break
            main = run_script

    def unsafe() -> str | None:
        if failed:
            return failed
        threads = len(os.listdir("/proc/self/task"))
        if threads != 1:
            return f"it runs {threads} threads"
        if torch.cuda.is_initialized():
            return "CUDA is initialised in it"
        if dist.is_initialized():
            return "it has a process group"
        return None

    # what the imports made is set aside from the garbage collector (Python's gc.freeze): a rank's collections,
    # the full one at its exit among them, then visit only what the rank made, and leave the server's pages shared
    gc.freeze()
    why = unsafe()
    sock.send(json.dumps({"refused": why} if why else {"ready": True}).encode())
    children: set[int] = set()
    try:
        while True:
            if select.select([sock], [], [], TICK)[0]:
                data, fds, _, _ = socket.recv_fds(sock, MESSAGE_BYTES, 256)
                if not data:
                    break   # the command closed its end, or died
                _answer(sock, json.loads(data), fds, children, unsafe, main)
            _reap(sock, children)
    except OSError:   # the command is gone (its end of the socket with it)
        pass
    finally:
        for pid in children:
            os.kill(pid, signal.SIGKILL)
        for pid in children:
            os.waitpid(pid, 0)
        gc.unfreeze()   # the server's own exit frees them as usual (nanobind's modules count what is left as leaked)
    return 0


def _answer(sock: socket.socket, request: dict[str, Any], fds: list[int], children: set[int],
            unsafe: Callable[[], str | None], main: Callable[[list[str]], int]) -> None:
    """Kill the ranks named, or fork one rank per environment of the request (unless forking became unsafe)."""
    if "kill" in request:
        for pid in set(request["kill"]) & children:
            os.kill(pid, signal.SIGKILL)
        return
    why = unsafe()
    pids = []
    if not why:
        rank_fds = request.get("rank_fds") or [[] for _ in request["envs"]]
        for env, own in zip(request["envs"], rank_fds, strict=True):
            if request.get("fd_env"):
                env = {**env, request["fd_env"]: ",".join(str(fds[i]) for i in own)}
            others = [fd for i, fd in enumerate(fds) if i and i not in own]
            pids.append(_fork(sock, env, request["argv"], request.get("cwd"), fds[0], others, main))
    children.update(pids)
    for fd in fds:
        os.close(fd)
    sock.send(json.dumps({"refused": why} if why else {"pids": pids}).encode())


def _reap(sock: socket.socket, children: set[int]) -> None:
    """Say which ranks have ended, with their exit codes."""
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        children.discard(pid)
        sock.send(json.dumps({"exit": pid, "status": _code(status)}).encode())


def _code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _fork(sock: socket.socket, env: dict[str, str], argv: list[str], cwd: str | None, out: int, others: list[int],
          main: Callable[[list[str]], int]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    server = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    _rank(sock, server, env, argv, cwd, out, others, main)


def _rank(sock: socket.socket, server: int, env: dict[str, str], argv: list[str], cwd: str | None, out: int,
          others: list[int], main: Callable[[list[str]], int]) -> NoReturn:
    """In a forked rank: become a fresh rank of the command's, run, exit (never back into the server's loop)."""
    code, interrupted = 1, False
    try:
        sock.close()
        for fd in others:   # the other ranks' descriptors
            os.close(fd)
        os.environ.clear()
        os.environ.update(env)
        os.environ[PARENT_ENV] = str(server)
        if cwd is not None:
            os.chdir(cwd)
        follow_parent()   # dies with the server, which dies with the command
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        signal.signal(signal.SIGINT, signal.default_int_handler)   # Python's own, which the server may not keep
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        sys.excepthook = sys.__excepthook__
        random.seed()
        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)   # as Python's own exit prints a message given to sys.exit
    except BaseException as e:
        interrupted = isinstance(e, KeyboardInterrupt)
        sys.excepthook(*sys.exc_info())   # the script's own hook, where it set one (recorder/serving.py's)
    finally:
        # what the interpreter's exit does, in its order: threading's exit hooks (an unclosed Loop's close,
        # recorder/loop.py) and a join of the non-daemon threads, the atexit hooks, then the script's own
        # `__main__` torn down (its unclosed files flushed, its objects' __del__ run) while it is still __main__
        try:
            getattr(threading, "_shutdown")()  # noqa: B009  (private: mypy's stubs do not list it)
            atexit._run_exitfuncs()
            script_main = sys.modules.get("__main__")
            if script_main is not None and vars(script_main) is not globals():
                vars(script_main).clear()
                gc.collect()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            if interrupted:   # an uncaught Ctrl-C ends Python by SIGINT itself
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
            os._exit(code)


def run_script(argv: list[str]) -> int:
    """In a forked rank of a script fork server: run `python ARGV` (script_argv_forkable) as a fresh process
    would, in this process, in the working directory the rank was given."""
    args = list(argv)
    while args and args[0] in SCRIPT_FLAGS:   # -u: unbuffered
        args.pop(0)
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, io.TextIOWrapper):
                stream.reconfigure(write_through=True)
    sys.orig_argv = [sys.executable, *argv]
    _fresh_numpy()
    # the script's own __main__ module, installed for good (until the rank exits), as the interpreter does
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]   # runpy puts the module's path in argv[0]
        sys.path[0] = os.getcwd()
        getattr(runpy, "_run_module_as_main")(args[1])   # noqa: B009  (what `python -m` runs)
    else:
        sys.argv = args
        path = os.path.abspath(args[0])
        sys.path[0] = os.path.dirname(path)
        main.__dict__.update(__file__=args[0], __cached__=None, __builtins__=builtins,
                             __loader__=importlib.machinery.SourceFileLoader("__main__", args[0]))
        with open(args[0], "rb") as f:
            code = compile(f.read(), args[0], "exec", dont_inherit=True)
        exec(code, main.__dict__)
    return 0


def _fresh_numpy() -> None:
    """numpy as a fresh process has it: its global generator seeded anew, and its BLAS's threads (one in the server,
    so that it could fork) as many as OpenBLAS takes at its start from this environment."""
    np = sys.modules.get("numpy")
    if np is None:
        return
    np.random.seed()
    threads = next((int(v) for k in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
                    if (v := os.environ.get(k, "")).isdigit() and int(v) > 0), len(os.sched_getaffinity(0)))
    with open("/proc/self/maps") as maps:
        libraries = {line.split()[-1] for line in maps if "openblas" in line.rpartition("/")[2] and ".so" in line}
    for path in libraries:
        library = ctypes.CDLL(path)
        for symbol in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                       "openblas_set_num_threads64_", "openblas_set_num_threads"):
            setter = getattr(library, symbol, None)
            if setter is not None:
                setter(threads)
                break


if __name__ == "__main__":
    follow_parent()   # first, before the imports of seconds: the server never outlives the command that started it
    # A Ctrl-C reaches the command's whole process group: the ranks stop on it (theirs is Python's own handler
    # again) and the command ends; the server ends after them, with the command, without a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    given = sys.argv[3].split(",") if sys.argv[2:3] == ["--imports"] else None
    sys.exit(serve(socket.socket(fileno=int(sys.argv[1])), [n for n in given if n] if given is not None else None))
