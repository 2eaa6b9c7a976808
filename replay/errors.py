"""Errors a user can act on. The CLI prints them as one line and exits non-zero, without a traceback.

A write the filesystem refuses for good (no space left, a read-only filesystem, no permission) is an
`OSError` where it happens; `disk_errors` turns it into a `DiskError` that names the place and what to do.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator


class ReplayError(Exception):
    """A problem with the user's input or store; the message says what is wrong and what to do."""

    exit_code = 2
    said_by_launcher = False   # raised in a rank, whose launcher says it (in one line): the rank stays silent


class UsageError(ReplayError, ValueError):
    """Bad arguments, config keys or values (a ValueError to Python callers of the API)."""


class StoreError(ReplayError):
    """The run store is missing, of the wrong kind, in the wrong state, or corrupted."""


class ChecksumError(StoreError):
    """A stored array does not match the checksum written when it was committed."""


class DiskError(StoreError):
    """The filesystem refused a write: no space left, read-only, or not permitted."""


# errno -> (what happened, what to do; {elsewhere}: how to write it somewhere else)
_REFUSALS = {
    errno.ENOSPC: ("no space left on the device", "free space there"),
    errno.EDQUOT: ("the disk quota is exceeded", "free space there or raise the quota"),
    errno.EROFS: ("the filesystem is read-only", "make it writable (remount it) or {elsewhere}"),
    errno.EACCES: ("permission denied", "make the folder writable for this user (chmod, chown) or {elsewhere}"),
    errno.EPERM: ("the operation is not permitted", "make the folder writable for this user (chmod, chown) or "
                                                    "{elsewhere}"),
}


def refused(e: BaseException) -> OSError | None:
    """The OSError of a refused write that `e` is or was caused by (a library may wrap it), if any."""
    seen: set[int] = set()
    cause: BaseException | None = e
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, OSError) and cause.errno is not None and cause.errno in _REFUSALS:
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def disk_error(e: BaseException, what: str, where: object, elsewhere: str = "choose another place"
               ) -> DiskError | None:
    """`e` as the one line a user reads, if a full, read-only or forbidden filesystem caused it: `what` was
    being written (e.g. "the analysis of runs/a"), at `where` (a path or Location; None: not known) unless
    the error names the file; `elsewhere` says how to write it somewhere else."""
    cause = refused(e)
    if cause is None:
        return None
    assert cause.errno is not None, "refused() finds only errors with a refusal's errno"
    problem, fix = _REFUSALS[cause.errno]
    place = _shown(os.fsdecode(cause.filename)) if cause.filename else where
    named = place is None or str(place) in what   # "the analysis of runs/a" names its place already
    return DiskError(f"cannot write {what}: {problem}" + ("" if named else f" ({place})")
                     + f": {fix.format(elsewhere=elsewhere)}, then run the command again")


@contextlib.contextmanager
def disk_errors(what: str, where: object, elsewhere: str = "choose another place") -> Iterator[None]:
    """Raise a refused write inside the block as its `DiskError` (see `disk_error`)."""
    try:
        yield
    except OSError as e:
        found = disk_error(e, what, where, elsewhere)
        if found is None:
            raise
        raise found from None


def _shown(path: str) -> str:
    """A temporary file's folder (its name means nothing to a user), else the path."""
    return os.path.dirname(path) if path.endswith((".partial", ".tmp")) else path
