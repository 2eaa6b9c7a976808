"""What every section of the results pipeline shares: the run's context, the `replay` command runner, and
markdown helpers.

A section is a function `section(ctx) -> Section`. It runs the product's own commands with `cli(...)`,
which shows each command line exactly as a user would type it (collected in the section's `commands`),
reads the numbers from what the commands printed or wrote, and writes its PNGs into `ctx.out`.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replay.launch.ray_cluster import SYSTEM_CONFIG
from replay.lifeline import child_env, guarded


def hardware() -> str:
    """CPU model and core count, and the GPU if there is one (from nvidia-smi; no torch import)."""
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    gpu = "no GPU"
    if shutil.which("nvidia-smi"):
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True).stdout.split("\n")
        gpu = ", ".join(n.strip() for n in names if n.strip()) or gpu
    return f"{model}, {os.cpu_count()} cores, {gpu}"


@dataclass
class Context:
    out: Path                        # results.md and its PNGs
    work: Path                       # run stores and the commands' outputs
    quick: bool = False              # reduced sizes: the test's run, not the published numbers
    story_store: Path | None = None  # quick mode: an existing `spike` recording to bisect instead of `replay demo`
    hardware: str = field(default_factory=hardware)
    date: str = field(default_factory=lambda: datetime.date.today().isoformat())
    log: Path = field(init=False)    # every command's stderr, one file each
    reused: list[tuple[str, str]] = field(default_factory=list, init=False)   # (section's thread, output) reused

    def __post_init__(self):
        self.log = self.work / "logs"

    def note_reused(self, output: str) -> None:
        """An earlier run's output (a store, a command's answer) that the calling section's thread reuses."""
        self.reused.append((threading.current_thread().name, output))


@dataclass
class Section:
    title: str
    body: str                        # markdown: tables, PNG links, the comparison with the paper
    commands: list[str]              # the command lines that produced it, as a user types them


class CommandFailed(RuntimeError):
    pass


def command_line(*args: Any) -> str:
    return shlex.join(["replay", *map(str, args)])


def cli(ctx: Context, *args: Any, as_json: bool = False, commands: list[str] | None = None,
        cache: Path | None = None) -> Any:
    """Run `replay ARGS` (this interpreter's, as `python -m replay`) and return its stdout, parsed when
    `as_json`. The command line is appended to `commands`, the section's list of commands to show (leave it
    out for bookkeeping such as a completeness check). With `cache`, stdout is kept in that file with the
    command line as its first line, and a later call with the same command line reads it back instead of
    running again. A non-zero exit raises CommandFailed with the end of the command's stderr."""
    line = command_line(*args)
    if commands is not None:
        commands.append(line)
    if cache is not None and cache.is_file():
        first, _, stored = cache.read_text().partition("\n")
        if first == f"$ {line}":
            print(f"  (reused) $ {line}", file=sys.stderr)
            ctx.note_reused(line)
            return json.loads(stored) if as_json else stored
    ctx.log.mkdir(parents=True, exist_ok=True)
    log = ctx.log / f"{time.strftime('%H%M%S')}-{args[0]}-{os.urandom(3).hex()}.log"
    print(f"  $ {line}", file=sys.stderr)
    t0 = time.perf_counter()
    env = child_env()   # it ends with this script, however that ends
    if _one_worker(args):   # it runs in its own process without Ray, as it does where the user types it
        env.pop("RAY_ADDRESS", None)
    with open(log, "w") as err:
        proc = subprocess.run([sys.executable, "-m", "replay", *map(str, args)], stdout=subprocess.PIPE, stderr=err,
                              text=True, env=env)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-20:])
        raise CommandFailed(f"`{line}` exited with {proc.returncode} (stderr in {log}):\n{tail}")
    print(f"    done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if cache is not None:
        tmp = cache.with_name(cache.name + ".tmp")
        tmp.write_text(f"$ {line}\n{proc.stdout}")
        tmp.replace(cache)
    return json.loads(proc.stdout) if as_json else proc.stdout


def _one_worker(args: tuple[Any, ...]) -> bool:
    """A command given `--workers 1`: an analysis or a bisect that needs no cluster (analysis/jobs.py
    `task_slots`, bisect/narrow.py), so it is not sent to the shared one."""
    return any(str(a) == "--workers" and str(b) == "1" for a, b in zip(args, args[1:], strict=False))


@contextlib.contextmanager
def shared_ray() -> Iterator[None]:
    """One local Ray cluster for every command of the pipeline that uses Ray (each would otherwise start
    and stop a cluster of its own: seconds each, and several at once compete for the cores). Commands
    reach it through RAY_ADDRESS, so the command lines shown stay the ones a user types; its processes
    end with this script, however it ends (lifeline.py). Where RAY_ADDRESS is set already, the
    commands use that cluster. A command given `--workers 1` runs without it (`cli`)."""
    if os.environ.get("RAY_ADDRESS"):
        yield
        return
    from ray.cluster_utils import Cluster

    with guarded():
        cluster = Cluster(initialize_head=True, connect=False,
                          head_node_args={"num_cpus": os.cpu_count() or 1, "include_dashboard": False,
                                          "_system_config": SYSTEM_CONFIG})
        os.environ["RAY_ADDRESS"] = cluster.address
        try:
            yield
        finally:
            del os.environ["RAY_ADDRESS"]
            cluster.shutdown()


def cli_parallel(ctx: Context, arg_lists: list[list[Any]], jobs: int, **kwargs: Any) -> list[Any]:
    """`cli` for several commands, `jobs` at a time; the command lines are recorded in the given order."""
    commands = kwargs.pop("commands", None)
    if commands is not None:
        commands += [command_line(*args) for args in arg_lists]
    section = threading.current_thread().name   # what ctx.reused attributes to

    def one(args):
        threading.current_thread().name = section
        return cli(ctx, *args, **kwargs)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, arg_lists))


def complete_store(ctx: Context, store: Path) -> bool:
    """Whether `store` holds a finished recording (an earlier pipeline run's, to reuse). A partial one (an
    interrupted run) is removed, so that it is recorded anew rather than trusted."""
    if not store.exists():
        return False
    try:
        done = cli(ctx, "info", store, "--json", as_json=True)["status"] == "complete"
    except CommandFailed:
        done = False
    if done:
        print(f"  (reused) {store}", file=sys.stderr)
        ctx.note_reused(str(store))
    else:
        print(f"  {store} is incomplete: recording it anew", file=sys.stderr)
        shutil.rmtree(store)
    return done


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def sci(x: float) -> str:
    """A deviation or distance in the doc: 3 significant digits, scientific."""
    return f"{x:.2e}"


def ratio(x: float) -> str:
    return f"{x:.2f}x"


def save_figure(fig, ctx: Context, name: str) -> str:
    """Write a matplotlib Figure into ctx.out as NAME and return its markdown image link."""
    ctx.out.mkdir(parents=True, exist_ok=True)
    fig.savefig(ctx.out / name, dpi=90)
    return f"![{name}]({name})"


def copy_png(ctx: Context, src: Path, name: str) -> str:
    """Copy a PNG a command wrote into ctx.out as NAME and return its markdown image link."""
    ctx.out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, ctx.out / name)
    return f"![{name}]({name})"
