"""Who holds a store's lease (store/lease.py on disk, store/object_lease.py on an object store), and the leases
this process holds."""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from replay.errors import StoreError
from replay.processes import alive

ENV = "REPLAY_LEASE"   # the spec of the lease a child process writes under


# this process's leases (store/lease.py's `Lease`, store/object_lease.py's `ObjectLease`) by (store, scope):
# taking one again is re-entrant
HELD: dict[tuple[str, str], Any] = {}


def lease_timeout() -> float:
    return float(os.environ.get("REPLAY_LEASE_TIMEOUT", "60"))


@dataclass
class Holder:
    command: str
    pid: int
    host: str
    since: float
    token: str
    start: int | None = None          # the pid's start time (clock ticks since boot), where /proc has it
    took_over: dict[str, Any] | None = None     # the dead holder this one replaced

    def describe(self) -> str:
        return (f"`{self.command}` (pid {self.pid} on {self.host} since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.since))})")

    def alive(self, heartbeat: float, timeout: float) -> bool:
        if self.host != socket.gethostname():
            return time.time() - heartbeat < timeout
        if self.start is not None and os.path.isdir("/proc"):
            return alive(self.pid, self.start)
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True




class HeldLease:
    """What a held lease of either kind (store/lease.py's `Lease`, store/object_lease.py's `ObjectLease`) does
    alike: its holder, re-entrant holding, a heartbeat every `timeout / 6` s, the refusal once taken over."""

    def __init__(self, store: Any, scope: str, holder: Holder):
        self.store, self.scope, self.holder = store, scope, holder
        self._count = 1
        self._lost: str | None = None   # who took it over
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name=f"lease-{scope}", daemon=True)
        self._beat.start()

    @property
    def token(self) -> str:
        return self.holder.token

    def _heartbeat(self) -> None:
        period = lease_timeout() / 6
        while not self._stop.wait(period):
            self._renew()

    def _renew(self) -> None:
        """Renew the lease, or note who took it over."""
        raise NotImplementedError

    def _refuse_if_lost(self) -> None:
        if self._lost:
            raise StoreError(f"{self.store}: this process lost its lease to {self._lost}, which took over the "
                             "store (this process was considered dead); it stops writing")

    def release(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> HeldLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
