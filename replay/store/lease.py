"""One writer per store: a lease that names its holder, taken before anything is written.

Every command that writes a run store (`record`, `record --resume`, `run`, `bisect`, `analyze`, `compare`,
a Python `Recorder`) first takes the lease of the run: `STORE/leases/run.json`. Processes working for
the holder (its ranks, a bisect's probes, an analysis's Ray tasks) write under that lease: they are given
its token and check it is still held with that token before each write, so a process whose holder lost
the lease stops instead of writing. A replay is also written under a lease of its own,
`STORE/leases/replays/<id>.json`, so that two of a bisect's parallel probes never write one replay.
Readers (`info`, `batch`, `report`) take nothing. This module is the lease of a store in a directory; on an
object store the same lease is kept by conditional puts (store/object_lease.py), behind the same functions.

The lease file is written once, whole, and then made visible with an atomic exclusive create (a hard
link of a complete temporary file): it holds who (command, pid, host, process start time), since when,
and a random token. The holder's heartbeat is the file's modification time, touched every
`timeout / 6` seconds through an open descriptor (so it only ever touches its own file). A lease whose
holder is gone is taken over, and the takeover is reported:

- same host: the pid no longer runs, or runs another process (a different start time);
- another host: no heartbeat for `timeout` seconds (REPLAY_LEASE_TIMEOUT, default 60).

A takeover first creates `<lease>.takeover-<token of the dead lease>` exclusively, so that of several
processes taking over one dead lease exactly one wins; the winner checks the lease still holds that
token before replacing it.

What this assumes of a shared filesystem (NFS, Lustre): exclusive create by hard link, and unlink, are
atomic at the server; a file opened on one host shows what another host wrote and closed before
(close-to-open consistency); modification times set by a client stay as set; and the hosts' clocks
agree to well within the timeout (NTP). A holder that is frozen (SIGSTOP, a suspended VM) for longer
than the timeout on another host than its challenger loses its lease and stops at its next check.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

from replay.errors import StoreError, disk_errors
from replay.processes import start_time
from replay.store import object_lease
from replay.store.holder import HELD, HeldLease, Holder, lease_timeout
from replay.store.location import Location, Where
from replay.store.object_lease import ObjectLease


def lease_file(store: Where, scope: str = "run") -> Path:
    """The lease file of a store in a directory."""
    local = Location.parse(store).local
    assert local is not None, "an object store's lease is an object (store/object_lease.py)"
    return local / "leases" / f"{scope}.json"


def read_holder(path: Path) -> tuple[Holder, float, tuple[int, int]] | None:
    """The lease at `path`: its holder, heartbeat (mtime) and identity (device, inode); None if there is none."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)   # after open(): fresh attributes even on NFS
        raw = os.read(fd, 1 << 16)
    finally:
        os.close(fd)
    try:
        holder = Holder(**json.loads(raw))
    except (ValueError, TypeError) as e:
        raise StoreError(f"the lease file {path} is damaged ({e}); if no command is writing the store, delete it") \
            from None
    return holder, st.st_mtime, (st.st_dev, st.st_ino)


def holder_of(store: Where, scope: str = "run") -> Holder | None:
    """Who holds the lease now, if anyone living does (for `replay info`)."""
    location = Location.parse(store)
    if location.local is None:
        return object_lease.holder_of(location, scope)
    found = read_holder(lease_file(location, scope))
    if found is None:
        return None
    holder, beat, _ = found
    return holder if holder.alive(beat, lease_timeout()) else None


class Lease(HeldLease):
    """A held lease. `acquire` refuses with one line naming the living holder, or takes over a dead one."""

    _lock = threading.Lock()

    def __init__(self, store: Path, scope: str, holder: Holder, fd: int, created_dir: bool):
        self.path = lease_file(store, scope)
        self._fd: int | None = fd
        self._created_dir = created_dir
        super().__init__(store, scope, holder)

    @property
    def spec(self) -> str:
        """What a child process needs to write under this lease (the ENV variable's value)."""
        return json.dumps({"file": str(self.path), "token": self.token})

    # -- taking ----------------------------------------------------------------------------------------------

    @classmethod
    def acquire(cls, store: Where, command: str, scope: str = "run",
                report: Callable[[str], None] | None = None) -> Lease | ObjectLease:
        location = Location.parse(store)
        key = (str(location), scope)
        with cls._lock:
            held: Lease | ObjectLease | None = HELD.get(key)
            if held is not None and held.held():
                held._count += 1
                return held
            if location.local is None:
                held = HELD[key] = ObjectLease.take(location, command, scope, report or _report)
                return held
            store = location.local
            created_dir = not store.exists()
            path = lease_file(store, scope)
            holder = Holder(command=command, pid=os.getpid(), host=socket.gethostname(), since=time.time(),
                            token=uuid.uuid4().hex, start=start_time(os.getpid()))
            try:
                elsewhere = "choose a location you may write" if created_dir else "copy the store where you may write"
                with disk_errors(f"the lease of {store} (for `{command}`)", path.parent, elsewhere):
                    _make_dirs(path.parent)
                    fd = cls._take(store, path, holder, report or _report)
            except OSError as e:   # refused otherwise than a full, read-only or forbidden filesystem
                _remove_empty(store, created_dir)
                raise StoreError(f"{store} cannot be written ({e.strerror}: {e.filename}): {elsewhere}") from None
            except BaseException:
                _remove_empty(store, created_dir)
                raise
            lease = cls(store, scope, holder, fd, created_dir)
            HELD[key] = lease
            return lease

    @classmethod
    def _take(cls, store: Path, path: Path, holder: Holder, report: Callable[[str], None]) -> int:
        timeout = lease_timeout()
        taken: str | None = None
        for _ in range(200):
            fd = _create_exclusive(path, holder)
            if fd is not None:
                if taken:
                    report(taken)
                return fd
            found = read_holder(path)
            if found is None:
                continue                       # released a moment ago: try again
            current, beat, _ = found
            if current.alive(beat, timeout):
                gone = f"; last heartbeat {time.time() - beat:.0f} s ago" if current.host != holder.host else ""
                raise StoreError(f"{store} is being written by {current.describe()}{gone}: wait for it or stop it")
            if cls._take_over(path, current, holder, timeout):
                why = "" if current.host == holder.host else f" (no heartbeat for {time.time() - beat:.0f} s)"
                taken = f"{store}: took over the lease of {current.describe()}, which is no longer running{why}"
                holder.took_over = asdict(current)
        raise StoreError(f"could not take the lease {path}: it keeps changing hands; try again")

    @staticmethod
    def _take_over(path: Path, dead: Holder, me: Holder, timeout: float) -> bool:
        """Remove the dead holder's lease, if this process is the one taking it over; True if removed."""
        marker = path.with_name(f"{path.name}.takeover-{dead.token}")
        if _create_exclusive(marker, me, keep_open=False) is None:
            found = read_holder(marker)        # another process is taking it over right now ...
            if found is not None and not found[0].alive(found[1], timeout):
                with contextlib.suppress(FileNotFoundError):
                    marker.unlink()            # ... or was, and died doing it
            time.sleep(0.05)
            return False
        try:
            found = read_holder(path)
            if found is None or found[0].token != dead.token:
                return False                   # someone else replaced it already
            path.unlink()
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                marker.unlink()

    # -- holding -----------------------------------------------------------------------------------------------

    def _renew(self) -> None:   # the heartbeat: the file's modification time, touched
        if self._lost or self._fd is None:
            return
        try:
            os.utime(self._fd)
            mine = os.fstat(self._fd)
            now = os.stat(self.path)
            same = (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)
        except FileNotFoundError:
            same = False
        if not same:
            found = read_holder(self.path)
            self._lost = found[0].describe() if found else "nobody (the lease file was removed)"

    def check(self) -> None:
        """Raise if this lease was taken over (this process must stop writing)."""
        self._renew()
        self._refuse_if_lost()

    def release(self) -> None:
        with self._lock:
            self._count -= 1
            if self._count > 0 or self._fd is None:
                return
            self._stop.set()
            with contextlib.suppress(OSError):
                mine, now = os.fstat(self._fd), os.stat(self.path)
                if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                    self.path.unlink()
            os.close(self._fd)
            self._fd = None
            HELD.pop((str(Location.parse(self.store)), self.scope), None)
            _remove_empty(self.store, self._created_dir)

    def held(self) -> bool:
        return self._fd is not None


def current_spec(where: Where) -> str:
    """The spec of the lease `store` is held under now (for ranks of an outer launcher, whose rank 0 took it)."""
    store = Location.parse(where)
    if store.local is None:
        return object_lease.current_spec(store)
    found = read_holder(lease_file(store))
    if found is None:
        raise StoreError(f"nobody holds the lease of {store}: its writer is gone")
    return json.dumps({"file": str(lease_file(store)), "token": found[0].token})


def require(spec: str) -> None:
    """In a process writing for a lease holder (ENV): refuse unless that lease is still held with its token."""
    want = json.loads(spec)
    if "object" in want:
        object_lease.require(want)
        return
    found = read_holder(Path(want["file"]))
    if found is None or found[0].token != want["token"]:
        now = f"now held by {found[0].describe()}" if found else "no longer held"
        raise StoreError(f"the lease this process writes under ({want['file']}) is {now}: the command that "
                         "started it is gone or was taken over; it stops writing")


def _create_exclusive(path: Path, holder: Holder, keep_open: bool = True) -> int | None:
    """Make `path` hold `holder`, atomically, only if it does not exist. Returns a descriptor of it (-1
    with keep_open=False), or None if it exists."""
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
    fd = _open_new(tmp)
    try:
        os.write(fd, json.dumps(asdict(holder)).encode())
        os.fsync(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            os.close(fd)
            return None
        except OSError:
            if os.fstat(fd).st_nlink != 2:   # NFS: the link may be made although its reply was lost
                os.close(fd)
                raise
        if keep_open:
            return fd
        os.close(fd)
        return -1
    finally:
        tmp.unlink()


# Another writer releasing its own lease removes the lease folders once they are empty (leases/replays/ is
# every replay's): a writer about to create its lease file there makes them again, as often as it takes.
_ATTEMPTS = 100


def _make_dirs(folder: Path) -> None:
    for _ in range(_ATTEMPTS - 1):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            return
        except FileNotFoundError:   # a parent removed between pathlib's making it and the child
            continue
        except FileExistsError:     # there when made, removed before pathlib looked whether it is a folder
            continue
    folder.mkdir(parents=True, exist_ok=True)


def _open_new(tmp: Path) -> int:
    """Create `tmp` for writing, its folder made again if it went in the meantime."""
    for _ in range(_ATTEMPTS - 1):
        try:
            return os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except FileNotFoundError:
            _make_dirs(tmp.parent)
    return os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)


def _remove_empty(store: Path, created: bool) -> None:
    """Remove the lease directories once empty, and the store directory if taking the lease made it."""
    for d in [store / "leases" / "replays", store / "leases"] + ([store] if created else []):
        with contextlib.suppress(OSError):
            d.rmdir()


def _report(message: str) -> None:
    print(f"note: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def writing(store: Where, command: str, under: str | None = None,
            report: Callable[[str], None] | None = None) -> Iterator[Lease | ObjectLease]:
    """Hold what a writer of `store` must hold, and yield the lease its helpers write under: the run's
    lease (or, with `under`, the spec of the lease of the process this one works for, checked), and for
    a replay (`RUN/replays/<id>`), the replay's own lease as well."""
    location = Location.parse(store)
    is_replay = location.parent.name == "replays" and (location.parent.parent / "zarr.json").exists()
    run = location.parent.parent if is_replay else location
    if run.local is not None and run.local.exists() and not run.local.is_dir():
        raise StoreError(f"{run} is not a directory")
    with contextlib.ExitStack() as stack:
        lease: Lease | ObjectLease | None = None
        if under is not None:
            require(under)
        else:
            lease = Lease.acquire(run, command, report=report)
            stack.callback(lease.release)
        if is_replay:
            lease = Lease.acquire(run, command, scope=f"replays/{location.name}", report=report)
            stack.callback(lease.release)
        assert lease is not None, "a helper writes into a replay of the run it works for"
        yield lease
