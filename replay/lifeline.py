"""Every process the tool starts dies with the process that started it, whatever signal killed that one.

Two mechanisms, one for each kind of child:

- Our own children (ranks, warm ranks, fork servers, `replay` commands started by scripts of this
  repository) are started with `child_env()`, which names the parent's pid in REPLAY_PARENT_PID. The child's first
  act (`follow_parent()`) asks the kernel for SIGKILL when its parent dies (Linux PR_SET_PDEATHSIG),
  then checks that its parent is still the one named: a parent that died while the child was starting,
  before the request, is caught by that check. A rank forked by a fork server (launch/forkserver.py) is
  given the server's pid and calls `follow_parent()` too: it dies with the server, which dies with the
  command. SIGKILL because a rank whose launcher is gone must stop
  writing at once; what it had not committed is invisible anyway. Without PR_SET_PDEATHSIG (macOS), a
  thread polls the parent pid every 0.2 s instead. The kernel ties the signal to the *thread* that
  started the child, so children are started from long-lived threads (the main thread, a Ray actor's
  task thread).
- Processes started by libraries we do not control (a local Ray cluster: its GCS and raylet share the
  driver's fate, but its dashboard and runtime-env agents outlive it, measured) are covered by a
  `Guardian`: a small process that holds the read end of a pipe whose only write end is in the driver,
  keeps a list of the driver's descendants (pid and start time, refreshed every 0.25 s), and when the
  pipe reports the driver's death, stops every one of them that is still the same process, adds what
  they started, and SIGKILLs them all.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

from replay.processes import descendants, start_time

PARENT_ENV = "REPLAY_PARENT_PID"
_PR_SET_PDEATHSIG = 1
_SCAN_EVERY = 0.25


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child that must die with this process (see `follow_parent`)."""
    return {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}


def follow_parent() -> None:
    """In a child started with `child_env()`: die with the parent. A no-op in any other process (a
    `replay` command a user starts from a shell keeps running if that shell goes)."""
    value = os.environ.pop(PARENT_ENV, None)   # our own children name us anew; nothing inherits it
    if not value:
        return
    parent = int(value)
    if not _set_parent_death_signal(signal.SIGKILL):
        threading.Thread(target=_poll_parent, args=(parent,), name="parent-watch", daemon=True).start()
    if os.getppid() != parent:   # it died before the request above took effect
        os._exit(1)


def follow_library_parent() -> None:
    """In a process a library started for us (a Ray worker, whose parent is its node's raylet): die when that
    parent dies, as the node it stands for would (polled: the library's threads are not ours to tie to)."""
    threading.Thread(target=_poll_parent, args=(os.getppid(),), name="parent-watch", daemon=True).start()


def _set_parent_death_signal(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def _poll_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(1)


# -- the guardian ----------------------------------------------------------------------------------------------


class Guardian:
    """Kills every descendant of this process when it dies (by any signal). Linux (/proc) only; elsewhere
    the processes of a local Ray cluster are left to Ray's own clean-up."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._write_fd: int | None = None

    def start(self) -> None:
        if self._proc is not None or not os.path.isdir("/proc"):
            return
        read_fd, self._write_fd = os.pipe()   # both close-on-exec: no other child inherits the write end
        # In a session of its own: whatever kills the driver's process group (a Ctrl-C, `kill -- -PGID`) must
        # not stop the guardian half-way through its work (a process it had frozen would stay frozen).
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "replay.lifeline", str(os.getpid()), str(read_fd)],
            pass_fds=(read_fd,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
        os.close(read_fd)

    def stop(self) -> None:
        """The driver lives on: the guardian leaves without killing anything."""
        if self._proc is None or self._write_fd is None:
            return
        os.write(self._write_fd, b"x")   # "stand down", as opposed to EOF: "I died"
        os.close(self._write_fd)
        self._proc.wait()
        self._proc, self._write_fd = None, None


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    guardian = Guardian()
    guardian.start()
    try:
        yield
    finally:
        guardian.stop()


def _guard(driver: int, read_fd: int) -> None:
    known: dict[int, int] = {}
    me = os.getpid()
    while True:
        known.update({p: s for p, s in descendants(driver).items() if p != me})
        ready, _, _ = select.select([read_fd], [], [], _SCAN_EVERY)
        if ready:
            if os.read(read_fd, 1):   # the driver stood us down
                return
            break                     # EOF: the driver is gone
    # Freeze each one first, so that what it started since the last scan is still its child, and found.
    frozen, todo = [], dict(known)
    while todo:
        pid, start = todo.popitem()
        if pid in frozen or start_time(pid) != start:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
            frozen.append(pid)
            todo.update({p: s for p, s in descendants(pid).items() if p != me})
    for pid in frozen:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    _guard(int(sys.argv[1]), int(sys.argv[2]))
