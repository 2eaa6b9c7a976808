"""One rank of a local recording: `python -m replay.launch.worker STORE [--resume]` (started by ranks.py)."""

from __future__ import annotations

import sys

from replay.errors import ReplayError


def main(argv: list[str]) -> int:
    from replay.train.trainer import train

    store, resume = argv[0], "--resume" in argv[1:]
    try:
        train(store, resume=resume)
    except ReplayError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
