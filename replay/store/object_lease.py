"""One writer per store on an object store: the lease of store/lease.py, by conditional puts.

An object store has no link, no mtime to touch and no exclusive create of a file, but it has conditional
puts, atomic at the server: `leases/<scope>.json` is created with If-None-Match (exactly one of several
creators succeeds), and every later write of it (the heartbeat, a takeover) is a put with If-Match on the
ETag its writer last saw, so a write succeeds only if nobody else wrote the lease in between.

- take: create the lease object; if it exists, read it with its ETag and the server's time of its last
  write, and refuse in one line if its holder lives (same host: its pid runs with its start time; another
  host: its last write is less than `timeout` old);
- take over a dead holder: If-Match on the ETag read: of several challengers exactly one wins, and a
  holder that was only frozen finds its next heartbeat refused and stops;
- heartbeat: rewrite the lease (a new beat count) with If-Match on the holder's own last ETag every
  `timeout / 6` s; a refused heartbeat means the lease was taken over;
- check (before a write): the lease object still has the holder's ETag;
- release: delete the lease object if it still has the holder's ETag.

It assumes what S3 promises (strong read-after-write, conditional puts; SeaweedFS and MinIO do the same)
and, across hosts, clocks that agree with the server's to well within the timeout.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from replay.errors import StoreError
from replay.processes import start_time
from replay.store.holder import HELD, HeldLease, Holder, lease_timeout
from replay.store.location import Location
from replay.store.s3 import S3Backend, backend


def lease_object(store: Location, scope: str = "run") -> Location:
    return store / "leases" / f"{scope}.json"


def _backend(where: Location) -> S3Backend:
    return backend(where.bucket)


def _encode(holder: Holder, beat: int) -> bytes:
    return json.dumps({**asdict(holder), "beat": beat}).encode()


def read_holder(where: Location) -> tuple[Holder, float, str] | None:
    """The lease at `where`: its holder, the server's time of its last write, and its ETag; None if none."""
    found = _backend(where).read_versioned(where.key)
    if found is None:
        return None
    raw, e_tag, written = found
    try:
        doc = json.loads(raw)
        doc.pop("beat", None)
        return Holder(**doc), written, e_tag
    except (ValueError, TypeError) as e:
        raise StoreError(f"the lease object {where} is damaged ({e}); if no command is writing the store, "
                         "delete it") from None


class ObjectLease(HeldLease):
    """A held lease on an object store (store/lease.py's `Lease` for a directory)."""

    def __init__(self, store: Location, scope: str, holder: Holder, e_tag: str):
        self.where = lease_object(store, scope)
        self._e_tag: str | None = e_tag
        self._beats = 0
        self._mutex = threading.Lock()
        super().__init__(store, scope, holder)

    @property
    def spec(self) -> str:
        return json.dumps({"object": str(self.where), "token": self.token})

    @classmethod
    def take(cls, store: Location, command: str, scope: str, report: Callable[[str], None]) -> ObjectLease:
        where = lease_object(store, scope)
        s3 = _backend(where)
        holder = Holder(command=command, pid=os.getpid(), host=socket.gethostname(), since=time.time(),
                        token=uuid.uuid4().hex, start=start_time(os.getpid()))
        timeout = lease_timeout()
        for _ in range(200):
            e_tag = s3.create_versioned(where.key, _encode(holder, 0))
            if e_tag is not None:
                return cls(store, scope, holder, e_tag)
            found = read_holder(where)
            if found is None:
                continue                       # released a moment ago: try again
            current, written, seen = found
            if current.alive(written, timeout):
                gone = f"; last heartbeat {time.time() - written:.0f} s ago" if current.host != holder.host else ""
                raise StoreError(f"{store} is being written by {current.describe()}{gone}: wait for it or stop it")
            holder.took_over = asdict(current)
            e_tag = s3.replace(where.key, _encode(holder, 0), seen)
            if e_tag is not None:
                why = "" if current.host == holder.host else f" (no heartbeat for {time.time() - written:.0f} s)"
                report(f"{store}: took over the lease of {current.describe()}, which is no longer running{why}")
                return cls(store, scope, holder, e_tag)
            holder.took_over = None            # another challenger won it: look again
        raise StoreError(f"could not take the lease {where}: it keeps changing hands; try again")

    def _renew(self) -> None:   # the heartbeat: the object rewritten, if it is still the one this holder wrote
        with self._mutex:
            if self._lost or self._e_tag is None:
                return
            try:
                e_tag = _backend(self.where).replace(self.where.key, _encode(self.holder, self._beats + 1),
                                                     self._e_tag)
            except StoreError:
                return                         # the server is away: the next beat tries again
            if e_tag is None:
                self._lose()
            else:
                self._beats += 1
                self._e_tag = e_tag

    def _lose(self) -> None:
        found = read_holder(self.where)
        self._lost = found[0].describe() if found else "nobody (the lease object was removed)"

    def check(self) -> None:
        """Raise if this lease was taken over (this process must stop writing)."""
        with self._mutex:
            if not self._lost and self._e_tag is not None:
                head = _backend(self.where).head(self.where.key)
                if head is None or head["e_tag"] != self._e_tag:
                    self._lose()
        self._refuse_if_lost()

    def release(self) -> None:
        with self._mutex:
            self._count -= 1
            if self._count > 0 or self._e_tag is None:
                return
            self._stop.set()
            s3 = _backend(self.where)
            head = s3.head(self.where.key)
            if head is not None and head["e_tag"] == self._e_tag and not self._lost:
                s3.delete(self.where.key)
            self._e_tag = None
        HELD.pop((str(self.store), self.scope), None)

    def held(self) -> bool:
        return self._e_tag is not None


def holder_of(store: Location, scope: str = "run") -> Holder | None:
    found = read_holder(lease_object(store, scope))
    if found is None:
        return None
    holder, written, _ = found
    return holder if holder.alive(written, lease_timeout()) else None


def current_spec(store: Location) -> str:
    found = read_holder(lease_object(store))
    if found is None:
        raise StoreError(f"nobody holds the lease of {store}: its writer is gone")
    return json.dumps({"object": str(lease_object(store)), "token": found[0].token})


def require(want: dict[str, Any]) -> None:
    where = Location.parse(want["object"])
    found = read_holder(where)
    if found is None or found[0].token != want["token"]:
        now = f"now held by {found[0].describe()}" if found else "no longer held"
        raise StoreError(f"the lease this process writes under ({where}) is {now}: the command that started it "
                         "is gone or was taken over; it stops writing")
