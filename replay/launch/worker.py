"""One rank: `python -m replay.launch.worker STORE [--resume]` (a recording or replay, started by ranks.py),
or `python -m replay.launch.worker --serve` (a warm rank of launch/pool.py: one store per line of its request
pipe), started fresh or forked from a fork server.

Errors are one line, prefixed with the rank; the launching `replay record` adds the summary line.
REPLAY_DEBUG=1 (set by `replay --debug`) prints the traceback as well.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import TYPE_CHECKING

from replay.errors import ReplayError, disk_error
from replay.launch.local import collector_paused
from replay.lifeline import follow_parent

if TYPE_CHECKING:
    from replay.store.location import Location


def main(argv: list[str]) -> int:
    # lazy: follow_parent() comes first, before these seconds of imports (the end of this file)
    with collector_paused():
        from replay.store.holder import ENV as LEASE_ENV
        from replay.store.location import Location
        from replay.train.trainer import train

    rank = os.environ.get("RANK", "?")
    # A rank prints progress and libraries' chatter, never answers: all of it goes to stderr (at the file
    # descriptor, so C++ extensions too), keeping the launching command's stdout for its answer (--json).
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    if argv[:1] == ["--serve"]:
        requests, replies = (int(fd) for fd in os.environ[POOL_FDS].split(","))
        return serve(train, requests, replies)
    store, resume = Location.parse(argv[0]), "--resume" in argv[1:]
    error, code = _attempt(train, store, resume, lease=os.environ[LEASE_ENV])
    if error and not error.startswith(_SAID):
        print(f"rank {rank}: {error}", file=sys.stderr, flush=True)
    return code


POOL_FDS = "REPLAY_POOL_FDS"   # a warm rank's descriptors: "REQUESTS,REPLIES" (launch/pool.py)


def serve(train, request_fd: int, reply_fd: int) -> int:
    """Train one store per request line on `request_fd` until it ends; answer each on `reply_fd`, keeping the
    process group between them."""
    # lazy (see main)
    import torch.distributed as dist

    from replay.store.location import Location

    with os.fdopen(request_fd) as requests, os.fdopen(reply_fd, "w") as replies:
        for line in requests:
            request = json.loads(line)
            os.environ.update(request.get("env", {}))   # the command's plugins (kernels/plan.py)
            error, code = _attempt(train, Location.parse(request["store"]), request["resume"], lease=request["lease"],
                                   keep_group=True)
            replies.write(json.dumps({"error": error, "code": code} if error else {"ok": True}) + "\n")
            replies.flush()
            if error:
                break   # a peer may be stuck in a collective: the pool is torn down
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


_SAID = "(said by the launcher) "   # an error the launching command says itself: this rank does not print it


def _attempt(train, store: Location, resume: bool, lease: str, **kwargs) -> tuple[str | None, int]:
    try:
        train(store, lease, resume=resume, **kwargs)
    except ReplayError as e:
        return (_SAID if e.said_by_launcher else "") + str(e), e.exit_code
    except OSError as e:   # a full or read-only disk is said as such; other OSErrors as below
        said = disk_error(e, f"the run store {store}", store)
        if said is None:
            return _unexpected(e)
        return str(said), said.exit_code
    except Exception as e:  # e.g. a peer rank died and the collective broke
        return _unexpected(e)
    return None, 0


def _unexpected(e: Exception) -> tuple[str, int]:
    if os.environ.get("REPLAY_DEBUG"):
        traceback.print_exc()
    first_line = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first_line}", 1


if __name__ == "__main__":
    follow_parent()   # first, before the imports of seconds: a rank never outlives the command that started it
    sys.exit(main(sys.argv[1:]))
