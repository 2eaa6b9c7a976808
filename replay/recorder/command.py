"""The user's command, as part of the record: how the training script was started, and what it ran.

A replay of a loop of the user's own starts the recorded command again, so the record keeps the
interpreter's arguments, the working directory, the launcher and world size, the few environment variables
that change what runs (`ENV`), and a hash of every file of the user's code the process had imported: the
script and its local modules (files outside the Python installation and its site-packages). A replay
refuses a changed file unless the user allows it.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from collections.abc import Mapping
from pathlib import Path

from replay.errors import UsageError
from replay.store.manifest import CommandInfo

# kept with the command, and set again (exactly: those the record did not have are left out) for its replays:
# they change what runs and how it computes (the code found, thread counts, hashing, cuBLAS's workspace) ...
ENV = ("PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG",
       "ATEN_CPU_CAPABILITY")   # the vector width torch's kernels use, read once as torch is imported
# ... and so do the launchers' settings: accelerate's (its mixed precision, its CPU mode), DeepSpeed's,
# Lightning's (its global seed, its workers' seeding), NCCL's and torch's own for it (its algorithms). Not
# TORCHINDUCTOR_*: torch sets some of them itself as it runs (its cache directory), so a record and its replay
# would differ in them without computing anything otherwise.
ENV_PREFIXES = ("ACCELERATE_", "DS_", "DEEPSPEED_", "PL_", "NCCL_", "TORCH_NCCL_")
# what `replay run` (launch/script.py) sets for the command it starts again
STORE_ENV = "REPLAY_LOOP_STORE"      # the replay store to write
RESUME_ENV = "REPLAY_LOOP_RESUME"    # "1": continue that replay from its last committed checkpoint


def capture(world_size: int) -> CommandInfo:
    """This process's command: call it from the training script, after its imports."""
    launcher = "torchrun" if "RANK" in os.environ and "WORLD_SIZE" in os.environ else "python"
    cwd = Path.cwd()
    return CommandInfo(argv=list(sys.orig_argv[1:]), cwd=str(cwd), launcher=launcher, world_size=world_size,
                       files={_relative(p, cwd): _sha256(p) for p in _user_files()},
                       env=tracked(os.environ), env_prefixes=list(ENV_PREFIXES),
                       local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
                       imports=installed_imports())


def installed_imports() -> list[str]:
    """The top-level packages of this process that were installed (in site-packages): what a replay's script fork
    server imports ahead of the script (launch/forkserver.py), in the order they were first imported."""
    roots = tuple({p for key in ("purelib", "platlib") if (p := sysconfig.get_paths().get(key))}
                  | {p for p in sys.path if p.endswith(("site-packages", "dist-packages"))})
    names = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if "." not in name and not name.startswith("_") and path and path.startswith(roots):
            names.append(name)
    return names


def tracked(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of `environ` a record keeps (`ENV`, `ENV_PREFIXES`)."""
    return {k: v for k, v in sorted(environ.items()) if k in ENV or k.startswith(ENV_PREFIXES)}


def environment(command: CommandInfo, base: Mapping[str, str]) -> dict[str, str]:
    """`base` (this process's environment) with the recorded variables set as they were: the tracked ones the
    record did not have are left out, so that no setting of the replayer's shell reaches the replay."""
    kept = {k: v for k, v in base.items()
            if k not in ENV and not (command.env_prefixes and k.startswith(tuple(command.env_prefixes)))}
    return {**kept, **command.env}


def changed_files(command: CommandInfo) -> list[str]:
    """The recorded files that are missing or differ now, in the recorded order."""
    changed = []
    for name, digest in command.files.items():
        path = Path(command.cwd, name)
        if not path.is_file() or _sha256(path) != digest:
            changed.append(str(path))
    return changed


def check_unchanged(command: CommandInfo, what: str, allow: str = "pass --allow-changed") -> None:
    """Refuse, in one line, to start a run again whose code changed since it was recorded."""
    changed = changed_files(command)
    if changed:
        more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
        raise UsageError(f"{changed[0]}{more} changed since the run was recorded: {what} would not run the recorded "
                         f"code; restore it, or {allow} to run the edited code")


def _user_files() -> list[Path]:
    """The script and every imported module file that is not part of Python, an installed package or replay."""
    installed = {Path(p).resolve() for key in ("stdlib", "platstdlib", "purelib", "platlib")
                 if (p := sysconfig.get_paths().get(key))}
    installed |= {Path(p).resolve() for p in sys.path if "site-packages" in p or "dist-packages" in p}
    installed.add(Path(sys.prefix).resolve())
    installed.add(Path(sys.base_prefix).resolve())
    installed.add(Path(__file__).resolve().parents[1])   # the replay package itself
    files = []
    script = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] not in ("", "-c", "-m") else None
    if script is not None and script.is_file():
        files.append(script)
    # Thousands of modules in a few hundred folders: each folder is resolved and judged once (a module's file is
    # under a root where its resolved folder is, or is that root); the file itself is resolved further only where
    # it is a link. The same files as resolving every path from its start (tests/recorder/test_command.py).
    folders: dict[str, tuple[str, bool]] = {}
    real_folders: dict[str, str] = {}
    cwd = os.getcwd()
    for module in list(sys.modules.values()):
        name = getattr(module, "__file__", None)
        if not name or not name.endswith(".py"):
            continue
        folder, base = os.path.split(os.path.join(cwd, name))   # as resolve() takes a relative one
        if folder not in folders:
            real = _real_folder(folder, real_folders)
            folders[folder] = (real, any(Path(real).is_relative_to(root) for root in installed))
        real_folder, under_root = folders[folder]
        full = os.path.join(real_folder, base)
        if os.path.islink(full):
            path = Path(full).resolve()
            under_root = path in installed or any(path.is_relative_to(root) for root in installed)
        elif under_root:
            continue
        else:
            path = Path(full)
        if not under_root and path not in installed and path not in files and path.is_file():
            files.append(path)
    return files


def _real_folder(folder: str, known: dict[str, str]) -> str:
    """os.path.realpath(folder), each of its parents resolved once (`known`) rather than once per folder under it."""
    real = known.get(folder)
    if real is None:
        parent, name = os.path.split(folder)
        if not name or name in (".", "..") or parent == folder:
            real = os.path.realpath(folder)
        else:
            real = os.path.join(_real_folder(parent, known), name)
            if os.path.islink(real):
                real = os.path.realpath(real)
        known[folder] = real
    return real


def _relative(path: Path, cwd: Path) -> str:
    return str(path.relative_to(cwd)) if path.is_relative_to(cwd) else str(path)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
