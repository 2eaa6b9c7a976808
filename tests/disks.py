"""Real full and read-only filesystems, for the fault tests and the soak (tests/soak.py): a small tmpfs
mounted for the purpose and filled to a chosen free space by a filler file, and a folder made read-only for
real. Both need privileges (mounting needs root); where they are missing, `Unavailable` says why in one line
(a test skips with it, the soak prints it).

    with Tmpfs(tmp_path / "disk", size_kib=16384) as disk:
        ... put a store on disk.path ...
        disk.fill(leave_kib=100)     # the command under test meets a full disk
        disk.free()                  # space freed: the command must work again
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path


class Unavailable(Exception):
    """This machine or user cannot make the filesystem asked for; the message says why."""


def _mount(*args: str) -> None:
    if shutil.which("mount") is None:
        raise Unavailable("no `mount` command here")
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise Unavailable(f"`mount {' '.join(args)}` failed ({why}): it needs root (CAP_SYS_ADMIN)")


def _unmount(path: Path) -> None:
    subprocess.run(["umount", "--lazy", str(path)], capture_output=True)


class Tmpfs:
    """A tmpfs of `size_kib` mounted at `path` (made if missing) for the `with` block."""

    FILLER = ".filler"

    def __init__(self, path: Path, size_kib: int):
        self.path, self.size_kib = Path(path), size_kib

    def __enter__(self) -> Tmpfs:
        self.path.mkdir(parents=True, exist_ok=True)
        _mount("-t", "tmpfs", "-o", f"size={self.size_kib}k", "tmpfs", str(self.path))
        return self

    def __exit__(self, *exc: object) -> None:
        _unmount(self.path)

    def available_kib(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize // 1024

    def fill(self, leave_kib: int) -> None:
        """Take all but `leave_kib` of the free space with a filler file."""
        size = (self.available_kib() - leave_kib) * 1024
        if size > 0:
            fd = os.open(self.path / self.FILLER, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)

    def free(self) -> None:
        """Space freed: the filler removed."""
        (self.path / self.FILLER).unlink(missing_ok=True)


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[Path]:
    """`path` as this process cannot write it, for real; yields where to use it. As root, whom file modes do not
    stop, it is a read-only bind mount of `path` beside it; otherwise `path` itself, its write bits cleared
    (chmod a-w, every file and folder in it) and restored after."""
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in [path, *path.rglob("*")]}
        for p, mode in modes.items():
            p.chmod(mode & ~0o222)
        try:
            yield path
        finally:
            for p, mode in modes.items():
                p.chmod(mode)
        return
    mount = path.with_name(path.name + "-read-only")
    mount.mkdir()
    try:
        _mount("--bind", str(path), str(mount))
        try:
            _mount("-o", "remount,bind,ro", str(mount))
            yield mount
        finally:
            _unmount(mount)
    finally:
        mount.rmdir()
