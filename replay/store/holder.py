"""Who holds a store's lease (store/lease.py on disk, store/object_lease.py on an object store), and the leases
this process holds."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Any

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


