"""Bad input, as a careless user types it, through every command of the command line: each case must end in one
`error:` line that says what is wrong, exit status 2, no traceback, and every store as it was (issue 41). The
cases run in this process, except those that need an environment of their own (a rank's variables left over,
a read-only store), which run together in one process."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from replay.cli import main
from replay.launch.local import free_port
from replay.replayer.replays import ReplayRequest, prepare
from replay.store import RunStore
from replay.store.integrity import seal
from tests.conftest import REPO, corrupt_tensor, error_line, replay_cli, tree_snapshot


@dataclasses.dataclass(frozen=True)
class Damage:
    """What is done to a copy of the run before a case (the copy is its STORE then)."""

    name: str
    do: Callable[[Path], None]


@dataclasses.dataclass(frozen=True)
class Case:
    args: str                     # after `replay`; the names of NAMES stand for the paths of `Places`
    says: str                     # in its one `error:` line
    damage: Damage | None = None
    env: dict[str, str] | None = None
    read_only: bool = False       # STORE on a read-only filesystem


def _manifest(change: Callable[[dict], object], reseal: bool = True) -> Callable[[Path], None]:
    """Edit the manifest's JSON: sealed again as a replay writes it (a newer version's), or not (damage)."""
    def edit(store: Path) -> None:
        doc = json.loads((store / "zarr.json").read_text())
        change(doc["attributes"])
        if reseal:
            doc["attributes"] = seal({k: v for k, v in doc["attributes"].items() if k != "crc32c"})
        (store / "zarr.json").write_text(json.dumps(doc))
    return edit


def _running(store: Path) -> None:
    """As a recording killed after its last commit leaves it."""
    RunStore.open(store, mode="a").update_manifest(status="running")


def _flip_a_bit(store: Path) -> None:
    corrupt_tensor(store, 10, 0, next(iter(RunStore.open(store).shard_index(10, 0))))


def _bad_lease(store: Path) -> None:
    (store / "leases").mkdir(exist_ok=True)
    (store / "leases" / "run.json").write_text("{not json")


NO_SAMPLE_IDS = Damage("no sample ids", lambda s: shutil.rmtree(s / "steps" / "sample_ids"))
KILLED = Damage("killed", _running)
KILLED_NO_SAMPLE_IDS = Damage("killed, no sample ids", lambda s: (_running(s), NO_SAMPLE_IDS.do(s)))
BAD_STEP_LOG = Damage("step log's zarr.json", lambda s: (s / "steps" / "zarr.json").write_text("{not json"))
NO_SPIKES = Damage("no spikes", lambda s: shutil.rmtree(s / "spikes"))
NO_DATA = Damage("no embedded data", lambda s: shutil.rmtree(s / "data" / "tokens"))
NEWER_KEY = Damage("a newer config key", _manifest(lambda a: a["config"]["model"].update(rope=True)))
NEWER_FIELD = Damage("a newer field", _manifest(lambda a: a.update(rope_scaling={"factor": 2})))
NEWER_SCHEMA = Damage("a newer schema", _manifest(lambda a: a["replay"].update(schema=3)))
FLIPPED_MANIFEST = Damage("manifest checksum", _manifest(lambda a: a.update(world_size=3), reseal=False))
BAD_MANIFEST = Damage("manifest not JSON", lambda s: (s / "zarr.json").write_text("{not json"))
FLIPPED_TENSOR = Damage("a flipped bit", _flip_a_bit)
BAD_LEASE = Damage("a damaged lease", _bad_lease)

RANKS = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29499"}
UNSET = "`unset RANK WORLD_SIZE"
NEWER = "written by a newer replay"


def _cases() -> list[Case]:
    cuda = torch.cuda.device_count()
    device = (Case("record --store NEW --set device=cuda", "no CUDA device") if not cuda else
              Case(f"record --store NEW --set device=cuda --nproc {cuda + 1} --set micro_batch_size=1 "
                   f"--set batch_size={cuda + 1}", "need a CUDA device each"))
    return [
        # record: values, checked before anything is written
        Case("record --store NEW --set threads=-1", "threads must be >= 0"),
        Case("record --store NEW --seed -1", "seed must be between 0 and"),
        Case("record --store NEW --set model.dropout=2", "model.dropout must be >= 0 and < 1, got 2.0"),
        Case("record --store NEW --set optim.lr=NaN", "optim.lr must be a finite number, got nan"),
        Case("record --store NEW --set optim.lr=Infinity", "optim.lr must be a finite number, got inf"),
        Case("record --store NEW --set model.n_head=0", "model.n_head must be >= 1, got 0"),
        Case("record --store NEW --set model.n_embd=65", "model.n_embd 65 is not divisible by model.n_head 2"),
        device,
        Case("record --store NEW --set optim.beta2=1", "optim.beta2 must be >= 0 and < 1"),
        Case("record --store NEW --set optim.eps=-1e-8", "optim.eps must be >= 0"),
        Case("record --store NEW --set spike.window=2", "spike.window must be >= 3"),
        Case("record --store NEW --set model.block_size=0", "model.block_size must be >= 1"),
        Case("record --store NEW --set model.vocab_size=-5", "model.vocab_size must be >= 0"),
        Case("record --store NEW --set data.max_samples=-3", "data.max_samples must be >= 0"),
        Case("record --store NEW --steps 0", "steps must be >= 1, got 0"),
        Case("record --store NEW --steps many", "Invalid value for '--steps'"),
        Case("record --store NEW --nproc 0", "nproc must be >= 1"),
        Case("record --store NEW --checkpoint-every -5", "checkpoint_every must be >= 1"),
        Case("record --store NEW --nproc 2 --set batch_size=6", "batch_size 6 is not a multiple"),
        Case("record --store NEW --set steps=1.5", "config key 'steps' expects a int"),
        Case("record --store NEW --set numerics=maybe", "expects true or false"),
        Case("record --store NEW --set model.rope=1", "unknown config key 'model.rope'"),
        Case("record --store NEW --set steps", "--set expects key=value"),
        Case("record --store NEW --set model=3", "config key 'model' is a section"),
        Case("record --store NEW --preset gpt5", "unknown preset 'gpt5'"),
        Case("record --store NEW --precision fp16", "Invalid value for '--precision'"),
        Case("record --store NEW --launcher slurm", "Invalid value for '--launcher'"),
        Case("record --store NEW --zero-stage 1", "--zero-stage needs --launcher deepspeed"),
        Case("record --store NEW --attention flashy", "unknown attention backend 'flashy'"),
        Case("record --store NEW --stpes 3", "No such option '--stpes'"),
        # record: files
        Case("record --store NEW --config UTF16", "is not UTF-8 text"),
        Case("record --store NEW --config NOT_TOML", "is not valid TOML"),
        Case("record --store NEW --config NAN_TOML", "optim.lr must be a finite number"),
        Case("record --store NEW --config NEW.toml", "does not exist"),
        Case("record --store NEW --config DIR", "is a directory"),
        Case("record --store NEW --data DIR", "is not a file"),
        Case("record --store NEW --data NEW.bin", "does not exist"),
        Case("record --store NEW --data EMPTY", "is empty"),
        Case("record --store NEW --data ODD", "is not a whole number of uint16 tokens"),
        Case("record --store NEW --data SHORT", "is too short"),
        # record: where the store goes
        Case("record --store STORE", "it holds a complete run: choose a new --store"),
        Case("record --store DIR", "it holds a folder of other files: choose a new --store"),
        Case("record --store FILE", "is not a directory"),
        Case("record --store STORE/replays/mine --steps 2", "lies inside the run store"),
        Case("record --store STORE/checkpoints/new --steps 2", "lies inside the run store"),
        Case("record --store ftp://host/runs", "ftp:// is not supported"),
        Case("record --store s3://", "is not a store URL"),
        Case("record --store", "Option '--store' requires an argument"),
        # record --resume
        Case("record --store STORE --resume", "is complete: all 30 steps are recorded"),
        Case("record --store REPLAY --resume", "is a replay: continue it with `replay run "),
        Case("record --store NEW --resume", "does not exist"),
        Case("record --store DIR --resume", "is not a replay run store"),
        Case("record --store STORE --resume --steps 40", "--resume continues the recorded config; drop --steps"),
        Case("record --store STORE --resume --nproc 1", "was recorded with 2", damage=KILLED),
        Case("record --store STORE --resume", "(steps/sample_ids) is missing", damage=KILLED_NO_SAMPLE_IDS),
        Case("record --store STORE --resume", NEWER, damage=NEWER_KEY),
        Case("record --store STORE --resume", "lease file", damage=BAD_LEASE),
        # record: a rank's variables without their launcher
        Case("record --store NEW --nproc 2 --steps 2", "but --nproc 2 starts this machine's ranks", env=RANKS),
        Case("record --store NEW --steps 2", UNSET, env=RANKS),
        Case("record --store NEW --steps 2", "no launcher started this process",
             env={"RANK": "1", "WORLD_SIZE": "2"}),
        Case("record --store NEW --steps 2", "no torchrun agent answers at 127.0.0.1",
             env={**RANKS, "MASTER_PORT": str(free_port()), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                  "GROUP_RANK": "0", "TORCHELASTIC_RUN_ID": "gone", "TORCHELASTIC_USE_AGENT_STORE": "True"}),
        # info
        Case("info NEW", "does not exist; record a run first with `replay record --store"),
        Case("info FILE", "is not a replay run store"),
        Case("info DIR", "is not a replay run store"),
        Case("info STORE/steps", "is part of the run store"),
        Case("info STORE/replays/typo", "lies inside the run store"),
        Case("info STORE --yaml", "No such option '--yaml'"),
        Case("info STORE", "steps/zarr.json is damaged", damage=BAD_STEP_LOG),
        Case("info STORE", "spikes is missing", damage=NO_SPIKES),
        Case("info STORE", "field 'config.model.rope', unknown to this version", damage=NEWER_KEY),
        Case("info STORE", "field 'rope_scaling', unknown to this version", damage=NEWER_FIELD),
        Case("info STORE", "upgrade replay", damage=NEWER_SCHEMA),
        Case("info STORE", "does not match its checksum", damage=FLIPPED_MANIFEST),
        Case("info STORE", "cannot be opened as a Zarr store", damage=BAD_MANIFEST),
        Case("info STORE", "lease file", damage=BAD_LEASE),
        # batch
        Case("batch STORE --step -1", "step -1 is not recorded"),
        Case("batch STORE --step 30", "step 30 is not recorded"),
        Case("batch STORE --step 3 --rank 2", "rank 2 out of range"),
        Case("batch STORE --step three", "Invalid value for '--step'"),
        Case("batch STORE", "Missing option '--step'"),
        Case("batch STORE --step 3", "(steps/sample_ids) is missing", damage=NO_SAMPLE_IDS),
        Case("batch STORE --step 3", "data/tokens is missing", damage=NO_DATA),
        Case("batch STORE --step 3", NEWER, damage=NEWER_KEY),
        # run
        Case("run STORE --from 5 --to 2", "--to 2 is before --from 5"),
        Case("run STORE --from -1 --to 2", "outside the record"),
        Case("run STORE --from 2 --to 30", "outside the record"),
        Case("run STORE --from 20 --to 22 --checkpoint-every -1", "--checkpoint-every must be >= 0"),
        Case("run STORE --from 20 --to 22 --name ../x", "is not a replay name"),
        Case("run STORE --from 20 --to 22 --attention flashy", "unknown attention backend"),
        Case("run STORE --from 20 --to 22 --layers 9 --attention eager", "out of range"),
        Case("run STORE --from 20 --to 22 --fix bogus", "unknown fix 'bogus'"),
        Case("run STORE --from 20 --to 22 --skip 99", "outside the window"),
        Case("run STORE --from 20 --to 22 --drop 21:99999", "was not trained on at step 21"),
        Case("run STORE --from 20 --to 22 --drop bad", "--drop expects step:sample pairs"),
        Case("run STORE --from 20 --to 22 --lr-scale nan", "--lr-scale must be > 0"),
        Case("run STORE --from 20 --to 22 --lr-scale inf", "--lr-scale must be > 0 and finite"),
        Case("run STORE --from 20 --to 22 --ranks 3", "does not divide"),
        Case("run STORE --from 20 --to 22 --resume --discard", "exclude each other"),
        Case("run STORE --from 20 --to 22 --pack", "give its --ray-address too"),
        Case("run STORE --from 20 --to 22 --precision fp8", "Invalid value for '--precision'"),
        Case("run STORE --from 12 --to 14", "was interrupted"),
        Case("run REPLAY --from 12 --to 14", "is a replay; replay windows of the run"),
        Case("run NEW --from 1 --to 2", "does not exist"),
        Case("run STORE --from 20 --to 22", "(steps/sample_ids) is missing", damage=NO_SAMPLE_IDS),
        Case("run STORE --from 20 --to 22", "steps/zarr.json is damaged", damage=BAD_STEP_LOG),
        Case("run STORE --from 20 --to 22", "data/tokens is missing", damage=NO_DATA),
        Case("run STORE --from 20 --to 22", NEWER, damage=NEWER_FIELD),
        Case("run STORE --from 20 --to 22", "upgrade replay", damage=NEWER_SCHEMA),
        Case("run STORE --from 10 --to 12", "checkpoint 10 rank 0", damage=FLIPPED_TENSOR),
        Case("run STORE --from 20 --to 22", "lease file", damage=BAD_LEASE),
        # session
        Case("diff NEW --step 10", "does not exist"),
        Case("diff STORE --step 11", "no committed checkpoint at step 11"),
        Case("diff STORE --step 10 --attention flashy", "unknown attention backend"),
        Case("diff STORE --step 10 --capture ../x", "a trace's name is letters, digits"),
        Case("diff STORE --step 10 --save ../x", "a saved diff's name is letters, digits"),
        Case("diff STORE --step 10 --keep x", "give it with --capture"),
        Case("diff STORE --step 10 --rank first", "expected a rank or 'all'"),
        Case("diff STORE --step 10 --against nope", "has no trace 'nope'"),
        Case("diff STORE --step 10 --capture a --against b", "give one of them"),
        Case("session NEW", "does not exist"),
        Case("session REPLAY", "is a replay; replay windows of the run"),
        Case("session STORE --file NEW", "No such file or directory"),
        Case("session STORE --file FILE", "Missing option '--from'; see `replay run --help`"),
        Case("session STORE --file DIR", "Is a directory"),
        # bisect
        Case("bisect STORE --spike 99", "--spike 99 is outside the record"),
        Case("bisect STORE --spike 20", "--fix 'safe-softmax' does not apply to this run"),
        Case("bisect STORE --spike 20 --horizon 0", "--horizon must be >= 1"),
        Case("bisect STORE --max-probes 0", "--max-probes must be >= 1"),
        Case("bisect STORE --fix bogus", "is not a counterfactual"),
        Case("bisect STORE", "REPLAY_RANKS=warm: set it to `fresh`", env={"REPLAY_RANKS": "warm"}),
        Case("bisect STORE --threshold nan", "--threshold must be a finite number"),
        Case("bisect STORE --min-delta -1", "Invalid value for '--min-delta'"),
        Case("bisect STORE --workers 0", "--workers must be >= 1"),
        Case("bisect STORE --by everything", "Invalid value for '--by'"),
        Case("bisect REPLAY", "is a replay; bisect the run"),
        Case("bisect STORE --spike 20 --fix lr-scale=0.5", "spikes is missing", damage=NO_SPIKES),
        # analyze
        Case("analyze STORE --workers 0", "--workers must be >= 1"),
        Case("analyze STORE --top -1", "Invalid value for '--top'"),
        Case("analyze DIR --layout {bad", "--layout is neither a layout name nor a JSON mapping"),
        Case("analyze STORE --layout hf-gpt2", "--layout is for folders of checkpoints replay did not record"),
        Case("analyze STORE --heads 0", "--heads is for folders of checkpoints replay did not record"),
        Case("analyze STORE --into FILE", "--into is for folders of checkpoints replay did not record"),
        Case("analyze REPLAY", "is a replay; analyze the run"),
        Case("analyze NEW", "holds no checkpoints replay can read"),
        Case("analyze DIR", "holds no checkpoints replay can read"),
        Case("analyze STORE", "(steps/sample_ids) is missing", damage=NO_SAMPLE_IDS),
        Case("analyze STORE", "data/tokens is missing", damage=NO_DATA),
        Case("analyze STORE", NEWER, damage=NEWER_KEY),
        # report
        Case("report NEW", "does not exist"),
        Case("report FILE", "is not a replay run store"),
        Case("report STORE -o DIR", "is a directory"),
        Case("report STORE", "steps/zarr.json is damaged", damage=BAD_STEP_LOG),
        Case("report STORE", "spikes is missing", damage=NO_SPIKES),
        # compare
        Case("compare STORE STORE", "compare needs two different stores"),
        Case("compare STORE NEW", "holds no checkpoints replay can read"),
        Case("compare STORE", "Missing argument 'STORE_B'"),
        Case("compare STORE STORE/replays/typo", "holds no checkpoints replay can read"),
        # export
        Case("export STORE --step 7 --to NEW", "no committed checkpoint at step 7"),
        Case("export STORE --step -1 --to NEW", "no committed checkpoint at step -1"),
        Case("export STORE --step 10 --to FILE", "is a file"),
        Case("export STORE --step 10 --to DIR", "is not an empty directory"),
        Case("export NEW --step 10 --to NEW.dcp", "does not exist"),
        Case("export STORE --step 10 --to NEW", NEWER, damage=NEWER_KEY),
        # microbench
        Case("microbench --precisions bf17 -o NEW", "unknown precision 'bf17'"),
        Case("microbench --seq-lens x -o NEW", "expected a comma-separated list of integers"),
        Case("microbench --tiles 3 -o NEW", "expected a comma-separated list of tiles"),
        Case("microbench --head-dims 0 -o NEW", "head dims must be >= 1"),
        Case("microbench --trials 0 --mode mechanism -o NEW", "trials must be >= 2"),
        Case("microbench --mode all -o FILE", "is a file"),
        Case("microbench --mode everything -o NEW", "Invalid value for '--mode'"),
        *([Case("microbench --mode flash -o NEW", "needs a CUDA GPU")] if not cuda else []),
        # demo
        Case("demo --out STORE", "holds another run"),
        Case("demo --out FILE", "is not a directory"),
        # the command itself
        Case("recrod --store NEW", "No such command 'recrod'"),
        # a read-only store: its readers read it, its writers say so
        Case("record --store STORE --resume", "the filesystem is read-only", read_only=True),
        Case("run STORE --from 20 --to 22", "the filesystem is read-only", read_only=True),
        Case("bisect STORE --spike 20 --fix lr-scale=0.5", "the filesystem is read-only", read_only=True),
        Case("analyze STORE", "the filesystem is read-only", read_only=True),
        Case("report STORE", "write it elsewhere with -o FILE", read_only=True),
    ]


class Places:
    """The paths a case names: the run (a copy of the session's recording, with a replay of it interrupted before
    its first step), its damaged copies, and files and folders of the wrong kind; each put back as it was after a
    command that changed it, so that the next case meets what it names."""

    def __init__(self, root: Path, recorded: Path, cases: list[Case]):
        self.root, self._pristine = root / "places", root / "pristine"
        shutil.copytree(recorded, self._pristine)
        prepare(RunStore.open(self._pristine), ReplayRequest(12, 14))   # as `replay run` leaves it killed at once
        self.run = self.root / "run"
        shutil.copytree(self._pristine, self.run)
        self.names = {"STORE": self.run, "REPLAY": self.run / "replays" / "steps-12-14", "NEW": self.root / "new",
                      "FILE": self.root / "notes.txt", "DIR": self.root / "folder", "UTF16": self.root / "utf16.toml",
                      "NOT_TOML": self.root / "bad.toml", "NAN_TOML": self.root / "nan.toml",
                      "EMPTY": self.root / "empty.bin", "ODD": self.root / "odd.bin", "SHORT": self.root / "short.bin"}
        self._files = {"FILE": b"not a store", "UTF16": "steps = 5\n".encode("utf-16"), "NOT_TOML": b"steps = \n",
                       "NAN_TOML": b"[optim]\nlr = nan\n", "EMPTY": b"", "ODD": b"\x01\x02\x03", "SHORT": bytes(600)}
        self._write_files()
        self._stores = {self._kind(c): self.root / f"store-{i}" for i, c in enumerate(cases) if self._kind(c)}
        for case in {self._kind(c): c for c in cases if self._kind(c)}.values():
            self._make(case)
        self._around = sorted(p.name for p in self.root.iterdir())

    @staticmethod
    def _kind(case: Case) -> str:
        return "read-only" if case.read_only else case.damage.name if case.damage else ""

    def _write_files(self) -> None:
        for name, data in self._files.items():
            self.names[name].write_bytes(data)
        shutil.rmtree(self.names["DIR"], ignore_errors=True)
        self.names["DIR"].mkdir()
        (self.names["DIR"] / "notes.txt").write_text("not a store either")

    def _make(self, case: Case) -> None:
        store = self.store(case)
        shutil.rmtree(store, ignore_errors=True)
        shutil.copytree(self._pristine, store)
        if case.damage is not None:
            case.damage.do(store)

    def store(self, case: Case) -> Path:
        return self._stores[self._kind(case)] if self._kind(case) else self.run

    def argv(self, case: Case) -> list[str]:
        names = {**self.names, "STORE": self.store(case)}
        return [_substitute(arg, names) for arg in shlex.split(case.args)]

    def watched(self, case: Case) -> dict[str, object]:
        """What a refused command must leave as it was: the run it names, the folders and files around it."""
        return {"store": _tree(self.store(case)), "run": _tree(self.run), "dir": _tree(self.names["DIR"]),
                "around": sorted(p.name for p in self.root.iterdir()),
                "files": {name: self.names[name].read_bytes() for name in self._files}}

    def put_back(self, case: Case) -> None:
        for name in set(p.name for p in self.root.iterdir()) - set(self._around):
            shutil.rmtree(self.root / name) if (self.root / name).is_dir() else (self.root / name).unlink()
        self._make(case)
        shutil.rmtree(self.run)
        shutil.copytree(self._pristine, self.run)
        self._write_files()


def _substitute(arg: str, names: dict[str, Path]) -> str:
    for name in sorted(names, key=len, reverse=True):   # NEW.toml: NEW, then its suffix
        if arg == name or arg.startswith((f"{name}/", f"{name}.")):
            return str(names[name]) + arg[len(name):]
    return arg


def _tree(path: Path) -> tuple[dict[str, tuple[int, int]], list[str]]:
    """Every file with its size and modification time, and every folder: a command that wrote changes it."""
    return tree_snapshot(path), sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_dir())


@dataclasses.dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str


def _unclean(case: Case, out: Outcome, changed: bool) -> str | None:
    """Why the answer to a bad input is not the one line it must be; None when it is."""
    both = out.stdout + out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    why = [w for w, bad in [
        (f"exit status {out.code}", out.code != 2),
        ("a traceback", "Traceback" in both),
        ("an unexpected error", any(line.startswith("error: unexpected") for line in both.splitlines())),
        (f"{len(errors)} error lines", len(errors) != 1),
        (f"not {case.says!r}", len(errors) == 1 and case.says not in errors[0]),
        ("a store or file changed", changed),
    ] if bad]
    return f"replay {case.args}: {', '.join(why)}: {both.strip()[-600:]}" if why else None


def _in_this_process(argv: list[str]) -> Outcome:
    result = replay_cli(*argv)
    return Outcome(result.returncode, result.stdout, result.stderr)


_DRIVER = """
import json, sys
from tests.conftest import replay_cli
out = []
for argv, env in json.loads(sys.argv[1]):
    r = replay_cli(*argv, env=env)
    out.append([r.returncode, r.stdout, r.stderr])
print("OUTCOMES " + json.dumps(out))
"""


def _in_a_process(runs: list[tuple[list[str], dict[str, str] | None]], read_only: Path | None = None,
                  timeout: float = 60) -> list[Outcome]:
    """The commands in one process of their own, each in it as above (a hang fails instead of waiting); with
    `read_only`, that folder mounted read-only for the process (a mount namespace of its own, as root)."""
    command = [sys.executable, "-c", _DRIVER, json.dumps(runs)]
    if read_only is not None:
        mount = f"mount --bind {read_only} {read_only} && mount -o remount,bind,ro {read_only}"
        command = ["unshare", "--mount", "sh", "-c", f"{mount} && exec {shlex.join(command)}"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "REPLAY_FAULT")}
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                                env={**env, "PYTHONPATH": str(REPO)})
    except subprocess.TimeoutExpired:
        return [Outcome(-1, "", f"no answer within {timeout:.0f} s (one of these commands hangs)")] * len(runs)
    line = next((line for line in result.stdout.splitlines() if line.startswith("OUTCOMES ")), None)
    if line is None:
        return [Outcome(result.returncode, result.stdout[-1000:], result.stderr[-1000:])] * len(runs)
    return [Outcome(*o) for o in json.loads(line.removeprefix("OUTCOMES "))]


def _can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "--mount", "true"], capture_output=True).returncode == 0


def _suggested_reads(line: str) -> list[list[str]]:
    """The commands in backticks a line suggests that only read (`replay info`, `replay batch`)."""
    quoted = line.split("`")[1::2]
    return [shlex.split(q)[1:] for q in quoted if q.startswith(("replay info ", "replay batch "))]


def test_every_command_answers_bad_input_in_one_line_and_changes_nothing(two_rank_store, tmp_path):
    cases = _cases()
    assert {shlex.split(c.args)[0] for c in cases} >= set(main.commands), "every command has its bad inputs"
    places = Places(tmp_path, two_rank_store, cases)
    outcomes: dict[int, tuple[Outcome, bool]] = {}
    for i, case in enumerate(cases):
        if case.env is None and not case.read_only:
            outcomes.update(_run(places, [i], cases, lambda argvs: [_in_this_process(argvs[0])]))
    apart = [i for i, c in enumerate(cases) if c.env is not None]
    outcomes.update(_run(places, apart, cases, lambda argvs: _in_a_process(
        [(argv, cases[i].env) for i, argv in zip(apart, argvs, strict=True)])))
    read_only = [i for i, c in enumerate(cases) if c.read_only] if _can_mount() else []
    if read_only:
        outcomes.update(_run(places, read_only, cases, lambda argvs: _in_a_process(
            [(argv, None) for argv in argvs], read_only=places.store(cases[read_only[0]]))))
    unclean = {i: why for i, (out, changed) in outcomes.items() if (why := _unclean(cases[i], out, changed))}
    for i, (out, _) in outcomes.items():   # what a line suggests reading runs as suggested
        for argv in _suggested_reads(out.stderr):
            if (answer := _in_this_process(argv)).code != 0:
                unclean[i] = f"replay {cases[i].args}: suggests `replay {shlex.join(argv)}`: {answer.stderr}"
    skipped = len(cases) - len(outcomes)
    print(f"bad input: {len(outcomes)} cases tried, {len(outcomes) - len(unclean)} clean, {len(unclean)} unclean"
          + (f", {skipped} skipped (a read-only mount needs root and unshare)" if skipped else ""))
    assert not unclean, "\n".join(unclean.values())
    assert len(outcomes) >= 150 - len(read_only)


def _run(places: Places, indices: list[int], cases: list[Case],
         run: Callable[[list[list[str]]], list[Outcome]]) -> dict[int, tuple[Outcome, bool]]:
    """The cases' outcomes, and whether each changed what it must not; what changed is put back."""
    before = {i: places.watched(cases[i]) for i in indices}
    outcomes = run([places.argv(cases[i]) for i in indices])
    changed = {i: places.watched(cases[i]) != before[i] for i in indices}
    for i in indices:
        if changed[i]:
            places.put_back(cases[i])
    return {i: (out, changed[i]) for i, out in zip(indices, outcomes, strict=True)}


def test_a_stopped_replay_names_the_command_that_continues_it_and_that_command_does(two_rank_store, tmp_path,
                                                                                     rank_pool):
    store = tmp_path / "run"
    shutil.copytree(two_rank_store, store)
    killed = replay_cli("run", str(store), "--from", "12", "--to", "18", "--checkpoint-every", "2", "--lr-scale",
                        "0.25", env={"REPLAY_FAULT": "shard-half:14:1"})   # rank 1 dies writing checkpoint 14
    line = error_line(killed)
    assert "rank 1 was killed by signal 9" in line and line.endswith(" continues)"), line
    command = line.split("`")[1]
    name = shlex.split(command)[shlex.split(command).index("--name") + 1]
    assert command == (f"replay run {store} --from 12 --to 18 --name {name} --lr-scale 0.25 --checkpoint-every 2 "
                       "--resume")
    assert f"`{command}`" in error_line(replay_cli("record", "--store", str(store / "replays" / name), "--resume"))

    resumed = replay_cli(*shlex.split(command)[1:], ranks=rank_pool)
    assert resumed.returncode == 0 and f"replay {store / 'replays' / name} (ran): steps 10..18" in resumed.stdout, \
        resumed.stderr
    replay = RunStore.open(store / "replays" / name)
    assert replay.manifest.status == "complete" and [c.step for c in replay.checkpoints()] == [12, 14, 16, 18, 19]


def test_the_command_a_refused_bisect_suggests_runs(two_rank_store):
    refused = replay_cli("bisect", str(two_rank_store))
    assert refused.returncode == 3 and "no spike recorded" in error_line(refused)
    [suggested] = _suggested_reads(error_line(refused))
    assert _in_this_process(suggested).code == 0
