"""The soak's derived commands (`make soak`, from tests/soak.py): `replay analyze`, `report`, `export` and
`bisect`, each SIGKILLed at random moments (the whole process group or the command alone) and run on a full
disk (a small tmpfs the soak mounts, the store or the target on it, filled to less free space than the
command writes); after each, the space is freed and the same command is run again. A trial is clean when
the next run works and gives the answer of an uninterrupted run, the run store's own data is as it was,
nothing half-made is left (the report's temporary file, an export marked unfinished), every process of the
killed command is gone within 2 s, and a run the full disk stopped said so in one line (`error: ...`, exit
code 2, no traceback) and removed what it had half-made.
"""

from __future__ import annotations

import contextlib
import hashlib
import html
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from replay.analysis.results import has_analysis, read_distances, read_metrics
from replay.lifeline import child_env
from replay.processes import alive, descendants
from replay.store import RunStore
from replay.store.dcp import PARTIAL, metadata_of
from replay.store.location import Location
from tests.disks import Tmpfs, Unavailable
from tests.examples.planted import plant_nanogpt_run

REPO = Path(__file__).resolve().parents[1]
COMMANDS = ("analyze", "report", "export", "bisect", "bisect-script")
BISECT = ["--by", "steps", "--fix", "lr-scale=0.5", "--workers", "1"]


@dataclass
class Trial:
    command: str
    fault: str          # what was done to it: "SIGKILL of the group at 3.1 s", "a full disk, 240 KiB free"
    landed: str         # what the fault found or left: "its table unfinished", "stopped in one line", ...
    problems: list[str] = field(default_factory=list)   # what was wrong (none: clean)

    @property
    def clean(self) -> bool:
        return not self.problems


def replay(*args: str | Location | Path, stderr: Any = subprocess.PIPE) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replay", *map(str, args)], cwd=REPO, env=child_env(),
                          stdout=subprocess.DEVNULL, stderr=stderr, text=True)


def checked(*args: str | Location | Path) -> None:
    """Run `replay ARGS`, which must succeed."""
    done = replay(*args)
    assert done.returncode == 0, f"replay {' '.join(map(str, args))}: {done.stderr}"


# -- stores as trees of files or objects ---------------------------------------------------------------


def files(root: Location, skip: frozenset[str] = frozenset()) -> dict[str, Location]:
    """Every file (or object) below `root` by its relative path, leaving out any below a name in `skip`."""
    found: dict[str, Location] = {}

    def walk(where: Location, rel: str) -> None:
        for name in where.children():
            if name in skip:
                continue
            child, sub = where / name, f"{rel}{name}"
            if child.exists():
                found[sub] = child
            else:
                walk(child, sub + "/")

    walk(root, "")
    return found


def copy_tree(src: Location, dst: Location, skip: frozenset[str] = frozenset()) -> None:
    if src.local is not None and dst.local is not None:
        shutil.copytree(src.local, dst.local, ignore=shutil.ignore_patterns(*skip))
        return
    for rel, path in files(src, skip).items():
        data = path.read()
        assert data is not None, path
        (dst / rel).write(data)


def own_data(store: Location, derived: frozenset[str]) -> dict[str, str]:
    """A digest of every file of the store that no derived command writes."""
    return {rel: hashlib.sha256(path.read() or b"").hexdigest() for rel, path in files(store, derived).items()}


def size_kib(root: Location, only: frozenset[str] | None = None) -> int:
    """What the files below `root` take (those below a name in `only`, if given), in KiB, by 4 KiB pages."""
    total = 0
    for rel, path in files(root).items():
        if only is None or only & set(rel.split("/")):
            total += -(-(path.size() or 0) // 4096) * 4
    return total


# -- the commands ----------------------------------------------------------------------------------------


class Command:
    """A derived command as the soak runs it: its input copied fresh for a trial (`prepare`), its arguments,
    its answer, what it writes in the store (`derived`: names at any depth), and what an uninterrupted run
    took (`seconds`), wrote (`written_kib`) and answered (`reference`)."""

    name = ""
    derived: frozenset[str] = frozenset({"leases"})
    begins = ""          # what it says on stderr once its start-up is over and its work begins, if anything

    def __init__(self, source: Location):
        self.source = source
        self.seconds, self.work_begins, self.written_kib, self.reference = 0.0, 0.0, 0, None

    def prepare(self, store: Location, out: Path) -> None:
        copy_tree(self.source, store, self.derived)

    def args(self, store: Location, out: Path) -> list[str | Location | Path]:
        raise NotImplementedError

    def answer(self, store: Location, out: Path) -> Any:
        raise NotImplementedError

    def stage(self, store: Location, out: Path) -> str:
        """Where a killed run stood, by what it left."""
        raise NotImplementedError

    def leftovers(self, store: Location, out: Path) -> list[str]:
        """What a run that ended (failed or not) must not leave."""
        return []

    def finished(self, store: Location, out: Path) -> bool:
        """Whether a killed run had written all of its answer (its next run may then rightly refuse)."""
        return False

    def measure(self, store: Location, out: Path) -> None:
        """An uninterrupted run: its seconds (and when its work began), what it wrote, its answer."""
        self.prepare(store, out)
        with started(self.args(store, out)) as run:
            self.work_begins = run.until_said(self.begins) if self.begins else 0.0
            assert run.proc.wait() == 0, f"{self.name}: {run.said()}"
            self.seconds = run.elapsed()
        self.written_kib = self.output_kib(store, out)
        self.reference = self.answer(store, out)

    def output_kib(self, store: Location, out: Path) -> int:
        return size_kib(store, self.derived - {"leases"})

    def input_kib(self) -> int:
        return size_kib(self.source) - size_kib(self.source, self.derived)

    def places(self, base: Location, local: Path, name: str) -> tuple[Location, Path]:
        """A trial's store (a fresh copy of the input, in `base`) and its folder of local outputs."""
        return base / name / "store", local / name


def _digest(*arrays: Any) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


class Analyze(Command):
    """`replay analyze` of the run and its one replay (a run store with a replay: 7 work items)."""

    name = "analyze"
    derived = frozenset({"analysis", "leases"})
    begins = "work items on"

    def args(self, store: Location, out: Path) -> list[str | Location | Path]:
        return ["analyze", store]

    def answer(self, store: Location, out: Path) -> Any:
        tables = [read_metrics(store), read_metrics(store / "replays" / "lr2")]
        distances = read_distances(store / "replays" / "lr2").get("parent")
        parts = [t[k] for t in tables if t is not None for k in sorted(t) if k != "attrs"]
        return _digest(*parts, *([] if distances is None else [distances[k] for k in ("step", "max_abs", "relative")]))

    def stage(self, store: Location, out: Path) -> str:
        if not (store / "analysis" / "zarr.json").exists():
            return "before its table"
        if not has_analysis(store):
            return "its table unfinished"
        analysed = read_metrics(store)
        return f"{0 if analysed is None else len(analysed['step'])} of 4 run checkpoints analysed"


class Report(Command):
    """`replay report` of the analysed run: the page in the store (or, on S3, beside the trial)."""

    name = "report"
    derived = frozenset({"report.html", "report.html.tmp", "leases"})

    def page(self, store: Location, out: Path) -> Path:
        return store.local / "report.html" if store.local is not None else out / "report.html"

    def args(self, store: Location, out: Path) -> list[str | Location | Path]:
        return ["report", store, *([] if store.local is not None else ["-o", self.page(store, out)])]

    def answer(self, store: Location, out: Path) -> Any:
        """The page, but for when and of which copy of the store it was made."""
        page = self.page(store, out).read_text().replace(html.escape(str(store)), "STORE")
        return re.sub(r"Generated [0-9: -]+\.", "", page)

    def stage(self, store: Location, out: Path) -> str:
        page = self.page(store, out)
        tmp = page.with_name(page.name + ".tmp")
        return "page written" if page.exists() else "page in its temporary file" if tmp.exists() else "before the page"

    def leftovers(self, store: Location, out: Path) -> list[str]:
        page = self.page(store, out)
        tmp = page.with_name(page.name + ".tmp")
        return [str(tmp)] if tmp.exists() else []

    def output_kib(self, store: Location, out: Path) -> int:
        return -(-self.page(store, out).stat().st_size // 4096) * 4


class Export(Command):
    """`replay export` of checkpoint 20 of the reference run (read where it is) to a folder."""

    name = "export"
    MARK = PARTIAL

    def prepare(self, store: Location, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)

    def args(self, store: Location, out: Path) -> list[str | Location | Path]:
        return ["export", store, "--step", "20", "--to", out / "dcp"]

    def answer(self, store: Location, out: Path) -> Any:
        target = out / "dcp"
        meta = metadata_of((target / ".metadata").read_bytes(), str(target / ".metadata"))
        return (sorted(p.name for p in target.iterdir()), hashlib.sha256((target / "__0_0.distcp").read_bytes())
                .hexdigest(), repr(sorted(meta.state_dict_metadata.items())))

    def stage(self, store: Location, out: Path) -> str:
        target = out / "dcp"
        if not target.exists():
            return "before its folder"
        return "its folder marked unfinished" if (target / self.MARK).exists() else "its folder complete"

    def leftovers(self, store: Location, out: Path) -> list[str]:
        target = out / "dcp"
        return [str(target / self.MARK)] if (target / self.MARK).exists() else []

    def finished(self, store: Location, out: Path) -> bool:
        """A complete export (the kill came as it exited): exporting over it is refused, as over any folder
        holding files."""
        return self.stage(store, out) == "its folder complete"

    def output_kib(self, store: Location, out: Path) -> int:
        return size_kib(Location.parse(out / "dcp"))

    def input_kib(self) -> int:
        return 0   # read where it is

    def places(self, base: Location, local: Path, name: str) -> tuple[Location, Path]:
        return self.source, local / name


class Bisect(Command):
    """`replay bisect --by steps` of the spike run (6 probes)."""

    name = "bisect"
    derived = frozenset({"bisect", "replays", "analysis", "leases"})
    begins = "probes run on"

    def args(self, store: Location, out: Path) -> list[str | Location | Path]:
        return ["bisect", store, *BISECT]

    def answer(self, store: Location, out: Path) -> Any:
        sessions = RunStore.open(store).bisect_sessions()
        v = sessions[0]["verdict"] if len(sessions) == 1 else None
        return v and {k: v[k] for k in ("spike", "window", "separation", "layers", "heads", "batches", "samples")}

    def stage(self, store: Location, out: Path) -> str:
        sessions = RunStore.open(store).bisect_sessions()
        if not sessions:
            return "before its session"
        s = sessions[0]
        return f"its session {s['status']} with {len(s['probes'])} probes"


class ScriptBisect(Bisect):
    """`replay bisect --by data` of the nanoGPT example's run with a batch planted at step 95 (6 probes), its
    probes on the script kept up between them (launch/script.py)."""

    name = "bisect-script"

    def args(self, store: Location, out: Path) -> list[str | Location | Path]:
        return ["bisect", store, "--by", "data", "--workers", "1"]


# -- trials ----------------------------------------------------------------------------------------------


@dataclass
class Running:
    """A `replay` command running in a process group of its own, its stderr going to a file (a pipe nobody
    reads could fill and stall it)."""

    proc: subprocess.Popen
    err: IO[str]
    t0: float

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def said(self) -> str:
        self.err.seek(0)
        return self.err.read()

    def until_said(self, words: str) -> float:
        """Wait until it says `words` on stderr (or ends); the seconds since it started."""
        while words not in self.said() and self.proc.poll() is None:
            time.sleep(0.02)
        return self.elapsed()

    def ends_within(self, seconds: float) -> bool:
        try:
            self.proc.wait(timeout=max(seconds, 0.0))
            return True
        except subprocess.TimeoutExpired:
            return False


@contextlib.contextmanager
def started(args: list[str | Location | Path]) -> Iterator[Running]:
    """`replay ARGS` started; killed, with its group, if still running at the end of the block."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "replay", *map(str, args)], cwd=REPO, env=child_env(),
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        try:
            yield Running(proc, err, time.monotonic())
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _gone(procs: dict[int, int], within: float = 2.0) -> list[str]:
    """Every process of a killed command ends within `within` seconds (docs/determinism-and-faults.md); those
    left are named, then killed, so the next run starts clean."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(alive(p, s) for p, s in procs.items()):
        time.sleep(0.02)
    left = [p for p, s in procs.items() if alive(p, s)]
    for p in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    return [f"{len(left)} of its processes still ran {within:g} s after the kill"] if left else []


def kill_trial(cmd: Command, store: Location, out: Path, rng: random.Random, how: str, in_work: bool) -> Trial:
    """The command on a fresh input, SIGKILLed (its process group, or itself alone) at a random moment of an
    uninterrupted run's duration, or (`in_work`) of its work, once its start-up is over; then run again."""
    cmd.prepare(store, out)
    own = own_data(store, cmd.derived)
    with started(cmd.args(store, out)) as run:
        begun = run.until_said(cmd.begins) if in_work else 0.0
        ended = run.ends_within(rng.uniform(0, cmd.seconds - (cmd.work_begins if in_work else 0.0)))
        at = run.elapsed()
        launched = descendants(run.proc.pid)
        if not ended:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.proc.pid, signal.SIGKILL) if how == "group" else os.kill(run.proc.pid, signal.SIGKILL)
        run.proc.wait()
    when = f"at {at:.1f} s" + (f", {at - begun:.1f} s into its work" if in_work else "")
    trial = Trial(cmd.name, f"SIGKILL of the {how} {when}", "it had ended" if ended else cmd.stage(store, out),
                  _gone(launched))
    if not cmd.finished(store, out):
        return again(cmd, store, out, own, trial)
    if cmd.answer(store, out) != cmd.reference:
        trial.problems.append("the answer it had written differs from an uninterrupted run's")
    return trial


def disk_trial(cmd: Command, disk: Tmpfs, store: Location, out: Path, rng: random.Random) -> Trial:
    """The command with its output on a disk that has less free space than it writes; then the space freed
    and the command run again."""
    cmd.prepare(store, out)
    own = own_data(store, cmd.derived)
    free = rng.randrange(max(1, cmd.written_kib))
    disk.fill(free)
    first = replay(*cmd.args(store, out))
    trial = Trial(cmd.name, f"a full disk, {free} KiB free of the {cmd.written_kib} KiB it writes", "")
    if first.returncode == 0:
        trial.landed = "it fit"
    else:
        lines = [line for line in first.stderr.splitlines() if line.startswith("error:")]
        trial.landed = "stopped: " + (lines[0] if lines else first.stderr.strip()[-200:])
        if first.returncode != 2 or len(lines) != 1 or "Traceback" in first.stderr or "no space left" not in lines[0]:
            trial.problems.append(f"not one line saying the disk is full (exit code {first.returncode})")
        trial.problems += [f"left behind: {p}" for p in cmd.leftovers(store, out)]
    disk.free()
    return again(cmd, store, out, own, trial)


def again(cmd: Command, store: Location, out: Path, own: dict[str, str], trial: Trial) -> Trial:
    """The same command run again after the fault: it must work and answer as an uninterrupted run did."""
    done = replay(*cmd.args(store, out))
    if done.returncode != 0:
        trial.problems.append(f"the next run failed: {(done.stderr.strip().splitlines() or [''])[-1]}")
    elif cmd.answer(store, out) != cmd.reference:
        trial.problems.append("the next run's answer differs from an uninterrupted run's")
    if own_data(store, cmd.derived) != own:
        trial.problems.append("the run store's own data changed")
    trial.problems += [f"left behind: {p}" for p in cmd.leftovers(store, out)]
    return trial


# -- the soak --------------------------------------------------------------------------------------------


def inputs(reference: Location, base: Location, local: Path) -> dict[str, Command]:
    """Each command with its input, made once with the product's own commands from the reference recording
    (in `base`): a replay of it (analyze), its analysis (report, measured as analyze's reference run), and a
    recording of the spike preset (bisect), and the nanoGPT example's run with a planted batch (bisect-script)."""
    replayed = base / "replayed"
    copy_tree(reference, replayed)
    checked("run", replayed, "--from", "10", "--to", "19", "--lr-scale", "2", "--name", "lr2")
    spike = base / "spike"
    checked("record", "--store", spike, "--preset", "spike", "--nproc", "2")
    analyze = Analyze(replayed)
    script = base / "script"
    plant_nanogpt_run(script, local / "script-data")
    return {"analyze": analyze, "report": Report(base / "measure-analyze" / "store"), "export": Export(reference),
            "bisect": Bisect(spike), "bisect-script": ScriptBisect(script)}


def run(reference: Location, base: Location, local: Path, kills: int, disks: int, rng: random.Random,
        say=print) -> list[Trial]:
    """`kills` random kills and `disks` full disks of each command; prints each trial and returns them all."""
    commands = inputs(reference, base, local)
    trials: list[Trial] = []
    for name in COMMANDS:
        cmd = commands[name]
        cmd.measure(*cmd.places(base, local, f"measure-{name}"))
        say(f"{name}: an uninterrupted run takes {cmd.seconds:.1f} s and writes {cmd.written_kib} KiB", flush=True)
        for i in range(kills):   # the group, the command alone; anywhere, in its work (once its start-up is over)
            store, out = cmd.places(base, local, f"{name}-kill-{i}")
            in_work = bool(cmd.begins) and i // 2 % 2 == 1
            trials.append(kill_trial(cmd, store, out, rng, ("group", "process")[i % 2], in_work))
            _say(say, trials[-1])
        trials += full_disks(cmd, base, local, disks, rng, say)
    return trials


def full_disks(cmd: Command, base: Location, local: Path, n: int, rng: random.Random, say=print) -> list[Trial]:
    """`n` full-disk trials of `cmd`, each on a tmpfs of its own holding what the command writes: the store (the
    target of an export, the page of a report of a store on S3)."""
    if n and cmd.source.local is None and not isinstance(cmd, (Report, Export)):
        say(f"  {cmd.name} on a full disk: skipped, its store is on S3 (no local disk to fill)", flush=True)
        return []
    trials = []
    for i in range(n):
        try:
            with Tmpfs(local / f"{cmd.name}-disk-{i}", cmd.input_kib() + 2 * cmd.written_kib + 4096) as disk:
                on_s3 = cmd.source.local is None   # only what it writes beside the store is on the disk
                store, out = cmd.places(base if on_s3 else Location.parse(disk.path), disk.path,
                                        f"{cmd.name}-disk-{i}" if on_s3 else "trial")
                trials.append(disk_trial(cmd, disk, store, out, rng))
        except Unavailable as e:
            say(f"  {cmd.name} on a full disk: skipped, {e}", flush=True)
            return trials
        _say(say, trials[-1])
    return trials


def _say(say, t: Trial) -> None:
    verdict = "clean" if t.clean else "UNCLEAN: " + "; ".join(t.problems)
    say(f"  {t.command} {t.fault} ({t.landed}): {verdict}", flush=True)


def summary(trials: list[Trial]) -> list[str]:
    lines = []
    for name in COMMANDS:
        mine = [t for t in trials if t.command == name]
        kills = [t for t in mine if t.fault.startswith("SIGKILL")]
        disks = [t for t in mine if not t.fault.startswith("SIGKILL")]
        lines.append(f"{name}: {len(kills)} kills, {sum(t.clean for t in kills)} clean; {len(disks)} full disks "
                     f"({sum(not t.landed.startswith('it fit') for t in disks)} stopped by it), "
                     f"{sum(t.clean for t in disks)} clean")
    clean = sum(t.clean for t in trials)
    lines.append(f"derived commands: {len(trials)} tried, {clean} clean, {len(trials) - clean} unclean")
    return lines
