"""Processes as Linux's /proc shows them: who is whose child, and whether a pid is still the same process."""

from __future__ import annotations

import os


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None if it is gone, or there is no /proc): a pid
    that shows another start time is another process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def descendants(pid: int) -> dict[int, int]:
    """Every living descendant of `pid`: {pid: start time}. One read of each process's stat file (a guardian
    calls this four times a second for as long as its driver runs: lifeline.py)."""
    children: dict[int, list[tuple[int, int]]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fd = os.open(f"/proc/{name}/stat", os.O_RDONLY)
        except OSError:
            continue
        try:
            fields = os.read(fd, 4096).rsplit(b")", 1)[1].split(maxsplit=20)
        except (OSError, IndexError):
            continue
        finally:
            os.close(fd)
        if fields[0] != b"Z":   # a zombie has finished: only its parent's wait() is missing
            children.setdefault(int(fields[1]), []).append((int(name), int(fields[19])))
    out: dict[int, int] = {}
    todo = [pid]
    while todo:
        for child, start in children.get(todo.pop(), []):
            if child not in out:
                out[child] = start
                todo.append(child)
    return out


def alive(pid: int, start: int | None = None) -> bool:
    """Whether `pid` runs (and, given its start time, is still that process); zombies do not count."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != b"Z" and (start is None or int(fields[19]) == start)
