"""Errors a user can act on. The CLI prints them as one line and exits non-zero, without a traceback."""


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
