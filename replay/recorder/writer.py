"""A background thread that writes to the run store, so that training never waits on the disk.

Jobs run in the order they were submitted: on the coordinator, the step log is flushed before a
checkpoint's shard and its commit, so a committed checkpoint at step c implies steps [0, c) are logged.
An error in the thread is raised on the training thread at its next call.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from replay.errors import StoreError, disk_error


class BackgroundWriter:
    """`guard()` runs before every job and raises if this process may no longer write (a lost lease)."""

    def __init__(self, name: str, guard: Callable[[], None] | None = None):
        self._guard = guard
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if self._error is None:
                    if self._guard is not None:
                        self._guard()
                    job()
            except BaseException as e:  # kept for the training thread; later jobs are skipped
                self._error = e
            finally:
                self._jobs.task_done()
        self._jobs.task_done()

    def submit(self, job: Callable[[], None]) -> None:
        self.raise_if_failed()
        self._jobs.put(job)

    def flush(self) -> None:
        self._jobs.join()
        self.raise_if_failed()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            e = self._error
            said = disk_error(e, "to the run store", None)
            if said is not None:
                raise said from e
            if isinstance(e, StoreError):   # says what went wrong where, and what to do, itself
                raise StoreError(f"writing to the run store failed: {e}") from e
            first = (str(e).strip().splitlines() or [""])[0]   # an object store's error goes on with a debug dump
            raise StoreError(f"writing to the run store failed: {type(e).__name__}: {first}") from e
