"""One rank of a local recording: `python -m replay.launch.worker STORE [--resume]` (started by ranks.py).

Errors are one line, prefixed with the rank; the launching `replay record` adds the summary line.
REPLAY_DEBUG=1 (set by `replay --debug`) prints the traceback as well.
"""

from __future__ import annotations

import os
import sys
import traceback

from replay.errors import ReplayError


def main(argv: list[str]) -> int:
    from replay.train.trainer import train

    store, resume = argv[0], "--resume" in argv[1:]
    rank = os.environ.get("RANK", "?")
    # A rank prints progress and libraries' chatter, never answers: all of it goes to stderr (at the file
    # descriptor, so C++ extensions too), keeping the launching command's stdout for its answer (--json).
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    try:
        train(store, resume=resume)
    except ReplayError as e:
        print(f"rank {rank}: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except Exception as e:  # e.g. a peer rank died and the collective broke
        if os.environ.get("REPLAY_DEBUG"):
            traceback.print_exc()
        first_line = (str(e).strip().splitlines() or [""])[0]
        print(f"rank {rank}: {type(e).__name__}: {first_line}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
