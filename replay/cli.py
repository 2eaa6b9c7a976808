"""`replay`: the command line. Thin: it parses, calls the components, and prints their answers."""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import os
import shlex
import sys
import traceback
from pathlib import Path

import click

from replay.analysis import series
from replay.analysis.jobs import analyze as run_analysis
from replay.analysis.jobs import compare as run_compare
from replay.analysis.localise import localise_store
from replay.analysis.report import write_report
from replay.bisect.narrow import BisectConfig
from replay.bisect.narrow import bisect as run_bisect
from replay.config import PRECISIONS, Launcher, build_config
from replay.demo import run_demo
from replay.errors import ReplayError, UsageError
from replay.launch import ranks
from replay.launch.forkserver import ForkServer
from replay.launch.job import RankLauncher
from replay.launch.ray_cluster import exit_process
from replay.launch.ray_ranks import Placing
from replay.launch.script import ScriptServer
from replay.lifeline import follow_parent
from replay.replayer.overrides import parse_drop, parse_fix, parse_heads, parse_steps
from replay.replayer.replays import NotBitForBit, ReplayRequest, check_replayable, run_on_ray
from replay.replayer.replays import run as run_replay
from replay.store import RunStore
from replay.store.lease import current_spec, writing
from replay.store.location import Location
from replay.store.overrides import Overrides
from replay.store.run_store import check_outside_stores
from replay.views import diff_lines, info_lines, sample_lines, step_batch, summarize


class LocationType(click.ParamType):
    """A store's location, parsed here once: a directory or s3://bucket/prefix."""

    name = "STORE"

    def convert(self, value, param, ctx):
        if isinstance(value, Location):
            return value
        try:
            return Location.parse(value)
        except ReplayError as e:
            self.fail(str(e), param, ctx)


STORE = LocationType()
_UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT)   # what a write meets, not a bug


def _main_errors(fn):
    """One line and a non-zero exit for errors (a traceback only with --debug)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        debug = click.get_current_context().find_root().params.get("debug", False)
        try:
            return fn(*args, **kwargs)
        except ReplayError as e:
            if debug:
                traceback.print_exc()
            click.echo(f"error: {e}", err=True)
            sys.exit(e.exit_code)
        except BrokenPipeError:  # `replay batch ... | head`: the reader left; not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(0)
        except KeyboardInterrupt:
            click.echo("interrupted; what was committed is intact (`record` and `run` continue with --resume; "
                       "`analyze` and `bisect` continue when run again)", err=True)
            sys.exit(130)
        except Exception as e:
            if debug:
                raise
            click.echo(f"error: unexpected {type(e).__name__}: {e} (run with --debug for the traceback)", err=True)
            sys.exit(1)

    return wrapper


class _UsageLine(click.ClickException):
    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"error: {self.message}", err=True)


class _Commands(click.Group):
    """click's usage errors (a bad option, value or argument) in one line, as every other error, instead of
    click's usage, hint and message."""

    def make_context(self, *args, **kwargs):
        try:
            return super().make_context(*args, **kwargs)
        except click.UsageError as e:
            raise _one_line(e) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.UsageError as e:
            raise _one_line(e) from None


def _one_line(e: click.UsageError) -> click.ClickException:
    if isinstance(e, click.exceptions.NoArgsIsHelpError):   # `replay` alone: the help, as click prints it
        return e
    names: list[str] = []
    ctx = e.ctx
    while ctx is not None and ctx.parent is not None:   # the root is `replay`, however it was started
        names.append(ctx.info_name or "")
        ctx = ctx.parent
    where = " ".join(["replay", *reversed(names)])
    return _UsageLine(f"{e.format_message().rstrip('.')}; see `{where} --help`")


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
@click.version_option(package_name="replay")
def main(debug: bool) -> None:
    """Record, replay and bisect training instabilities of GPT-2 runs.

    A run store (a Zarr directory) holds everything about one run: its config and environment, the
    exact samples of every step on every rank, metrics, spikes and committed checkpoints.
    """
    follow_parent()   # started by a script of ours (lifeline.py): end with it
    if debug:
        os.environ["REPLAY_DEBUG"] = "1"   # rank processes print tracebacks too


@main.command()
@click.option("--store", required=True, type=STORE,
              help="Where to create the run store: a directory or s3://bucket/prefix.")
@click.option("--preset", default="tiny", show_default=True, help="tiny, spike, gpt2-small or gpt2-medium.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML file with config fields.")
@click.option("--data", help="nanoGPT-style token file (train.bin); default: the built-in byte corpus.")
@click.option("--steps", type=int, help="Optimizer steps to train.")
@click.option("--nproc", type=int, help="Local ranks to start (torch.distributed; gloo on CPU, nccl on GPU).")
@click.option("--launcher", type=click.Choice([Launcher.LOCAL.value, Launcher.DEEPSPEED.value]),
              help="local ranks or a DeepSpeed engine.")
@click.option("--zero-stage", type=click.IntRange(0, 2), help="DeepSpeed ZeRO stage (with --launcher deepspeed).")
@click.option("--precision", type=click.Choice(PRECISIONS), help="BF16 autocast or FP32.")
@click.option("--attention", help="Attention implementation (eager, sdpa).")
@click.option("--checkpoint-every", type=int, help="Steps between committed checkpoints.")
@click.option("--seed", type=int, help="Seed of the initialisation and of the data order.")
@click.option("--numerics", is_flag=True, default=None,
              help="Also record per-step attention numerics (tied maxima, delta error, W_Q gradient error) of "
                   "the emulated flash backends; needs --attention reference-emu or fa2-emu.")
@click.option("--resume", is_flag=True, help="Continue a stopped or crashed run from its last committed checkpoint.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override any config field, e.g. optim.lr=3e-3.")
@_main_errors
def record(store, preset, config_file, data, steps, nproc, launcher, zero_stage, precision, attention,
           checkpoint_every, seed, numerics, resume, sets) -> None:
    """Train the built-in GPT-2 and record the run into STORE.

    Every optimizer step records the sample ids of every micro-batch of every rank, per-rank and global
    loss, grad norm (before clipping), learning rate, tokens and step time. Every K steps each rank
    writes its shard of a checkpoint (model, optimizer, scheduler, RNG states) off the training thread;
    it becomes visible once committed. A spike detector flushes recent in-memory snapshots on a spike.
    """
    if ranks.outer_launcher(nproc) is not None:
        return _record_as_rank(store, resume, preset, config_file, data, steps, launcher, zero_stage, precision,
                               attention, checkpoint_every, seed, numerics, sets)
    if resume:
        given = [n for n, v in [("--preset", preset != "tiny"), ("--config", config_file), ("--data", data),
                                ("--steps", steps), ("--set", sets), ("--seed", seed), ("--numerics", numerics)] if v]
        if given:
            raise ReplayError(f"--resume continues the recorded config; drop {', '.join(given)}")
        ranks.record_resume(store, nproc or _recorded_world(store), progress=lambda m: click.echo(m, err=True),
                            ranks=_lent_ranks())
    else:
        cfg = build_config(preset, config_file, list(sets), steps=steps, nproc=nproc, launcher=launcher,
                           zero_stage=zero_stage, precision=precision, checkpoint_every=checkpoint_every,
                           seed=seed, numerics=numerics, data={"path": data} if data else None,
                           model={"attention": attention} if attention else None)
        ranks.record_new(store, cfg, progress=lambda m: click.echo(m, err=True), ranks=_lent_ranks())
    _print_info(store, as_json=False)


def _lent_ranks() -> RankLauncher | None:
    """Ranks a caller running the CLI in its own process lends its commands (`main(..., obj=launcher)`: a
    test session's warm ranks); the commands' own choice is launch/ranks.py's `choose_launcher`."""
    lent: RankLauncher | None = click.get_current_context().obj
    return lent


def _recorded_world(store: Location) -> int:
    return RunStore.open(store).manifest.world_size


def _record_as_rank(store, resume, preset, config_file, data, steps, launcher, zero_stage, precision, attention,
                    checkpoint_every, seed, numerics, sets) -> None:
    """Under torchrun / deepspeed (multi-node): rank 0 prepares the store, every rank trains."""
    # lazy: the CLI starts without torch and transformers (2 s)
    from replay.train.trainer import train

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    launch_id = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT", "launch")
    if rank != 0:   # rank 0 holds the store's lease; the other ranks write under it
        ranks.wait_for_prepared(store, launch_id)
        train(store, current_spec(store), resume=resume and bool(RunStore.open(store).checkpoints()))
        return
    if not resume:
        check_outside_stores(store)   # before the lease: a location inside a store would take that store's
    with writing(store, f"replay record (rank 0 of {world})") as lease:
        if resume:
            prepared = ranks.prepare_resume(store, world_size=world)
            store_obj, resume = prepared.store, prepared.start is not None
        else:
            cfg = build_config(preset, config_file, list(sets), steps=steps, nproc=world, launcher=launcher,
                               zero_stage=zero_stage, precision=precision, checkpoint_every=checkpoint_every,
                               seed=seed, numerics=numerics, data={"path": data} if data else None,
                               model={"attention": attention} if attention else None)
            store_obj = ranks.prepare_new(store, cfg, world_size=world, local_world=local_world)
        store_obj.update_manifest(launch_id=launch_id)
        train(store, lease.spec, resume=resume)


@main.command()
@click.argument("store", type=STORE)
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
@_main_errors
def info(store, as_json) -> None:
    """What STORE holds: steps recorded, committed checkpoints, spikes, replays."""
    _print_info(store, as_json)


def _print_info(store: Location, as_json: bool) -> None:
    summary = summarize(series.analysis_store(store))
    click.echo(json.dumps(summary, indent=2) if as_json else "\n".join(info_lines(summary)))


@main.command()
@click.argument("store", type=STORE)
@click.option("--step", required=True, type=int, help="Optimizer step (0-based).")
@click.option("--rank", type=int, help="Only this rank's micro-batches.")
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
@_main_errors
def batch(store, step, rank, as_json) -> None:
    """The exact samples trained on at STEP: decoded text for the byte corpus, token ids otherwise."""
    rows = step_batch(store, step, rank)
    click.echo(json.dumps(rows, indent=2) if as_json else "\n".join(line for row in rows for line in sample_lines(row)))


def _attention_options(fn):
    """The overrides of a step's computation, as `replay run` and `replay diff` (its side B) take them."""
    for option in reversed([
        click.option("--attention", help="Attention backend for the whole model, or for --layers / --heads."),
        click.option("--layers", help="Layers the attention override or --lr-scale applies to, e.g. 1 or 0,2-3."),
        click.option("--heads", help="Heads the override applies to: 7,8 (within --layers) or layer.head pairs, "
                     "e.g. 1.0,0.3."),
        click.option("--precision", type=click.Choice(PRECISIONS), help="Train at this precision."),
        click.option("--fix", help="safe-softmax[:BETA]: Qiu & Yao's fix on the flash backends in scope (BETA 7)."),
        click.option("--hp-delta", is_flag=True,
                     help="Backward delta from an FP32 O on the flash backends in scope.")]):
        fn = option(fn)
    return fn


def _step_overrides(attention, layers, heads, precision, fix, hp_delta) -> Overrides:
    """The overrides `_attention_options` gives, parsed."""
    head_list, units = parse_heads(heads) if heads else (None, None)
    return Overrides(attention=attention, precision=precision, hp_delta=hp_delta, heads=head_list, units=units,
                     layers=parse_steps(layers, "--layers") if layers else None, fix=parse_fix(fix) if fix else None)


@main.command("run")
@click.argument("store", type=STORE)
@click.option("--from", "start", required=True, type=int, help="First step of the window (0-based).")
@click.option("--to", "stop", required=True, type=int, help="Last step of the window (inclusive).")
@click.option("--verify", is_flag=True, help="Compare each replayed step with the record, bit for bit.")
@click.option("--name", help="Replay id inside the store (default steps-A-B).")
@click.option("--checkpoint-every", type=int, default=0, show_default=True,
              help="Also checkpoint every K steps (0: only at the end).")
@_attention_options
@click.option("--skip", help="Steps whose batches are not trained on, e.g. 260-262,265.")
@click.option("--drop", help="Samples left out of their step's loss, as step:sample, e.g. 261:3,261:5.")
@click.option("--lr-scale", type=float, help="Multiply the learning rate by X (of --layers/--heads only, if given).")
@click.option("--resume", is_flag=True, help="Continue an interrupted replay from its last committed checkpoint.")
@click.option("--discard", is_flag=True, help="Remove an interrupted replay and run it anew.")
@click.option("--ranks", type=int, default=None, help="Processes to replay on: fewer than the recorded ranks, each "
              "plays its share of them (built-in local runs; docs/multi-node.md).")
@click.option("--allow-changed", is_flag=True, help="A run of your own script: replay it even if its files changed.")
@click.option("--ray-address", help="host:port of a Ray cluster's head: run the ranks on a placement group there, on "
              "nodes as recorded (its nodes must see the store at the same path, or reach its bucket).")
@click.option("--pack", is_flag=True, help="With --ray-address: let ranks share nodes the recording spread them over.")
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
@_main_errors
def run_cmd(store, start, stop, verify, name, checkpoint_every, attention, layers, heads, precision, fix, hp_delta,
            skip, drop, lr_scale, resume, discard, ranks, allow_changed, ray_address, pack, as_json) -> None:
    """Re-execute steps A..B of the run in STORE from its checkpoints, and store the replay inside it.

    Restores the latest committed checkpoint (or pre-spike snapshot) at or before A on every rank, with
    the recorded world size and launcher, and trains on exactly the recorded sample ids: bit for bit, or
    with the overrides (each recorded in the replay's manifest; several may be combined). A run of your
    own script (replay.recorder.Loop) is replayed by starting its recorded command again.
    """
    overrides = dataclasses.replace(_step_overrides(attention, layers, heads, precision, fix, hp_delta),
                                    lr_scale=lr_scale, skip=parse_steps(skip) if skip else [],
                                    drop=parse_drop(drop) if drop else [])
    if resume and discard:
        raise ReplayError("--resume and --discard exclude each other")
    req = ReplayRequest(start, stop, name=name, checkpoint_every=checkpoint_every, overrides=overrides,
                        resume=resume, discard=discard, allow_changed=allow_changed, ranks=ranks)
    if pack and not ray_address:
        raise ReplayError("--pack places ranks on a Ray cluster: give its --ray-address too")
    if ranks and ray_address:
        raise ReplayError("--ranks replays on this machine's processes: drop --ray-address")
    def warn(message: str) -> None:
        click.echo(f"warning: {message}", err=True)

    result = (run_on_ray(store, req, ray_address, Placing(pack=pack), warn=warn) if ray_address else
              run_replay(store, req, ranks=_lent_ranks(), warn=warn))
    v = result.verification
    assert v is not None, "run() verifies every replay"
    plain = not overrides.to_dict()
    if as_json:
        click.echo(json.dumps({"replay": str(result.location), "ran": result.created,
                               "environment_differences": result.environment_notes, "warnings": result.warnings,
                               "verification": v.to_dict(),
                               "reached": result.reached.to_dict() if result.reached else None},
                              indent=2))
    else:
        for note in result.environment_notes:
            click.echo(f"environment differs from the recording: {note} (bitwise equality is not guaranteed)",
                       err=True)
        click.echo(f"replay {result.location} ({'ran' if result.created else 'already complete; not re-run'}): "
                   f"steps {v.steps[0]}..{v.steps[-1]}"
                   + (f", overrides {overrides.to_dict()}" if not plain else ""))
        if result.reached is not None:
            click.echo(f"reached: {result.reached.describe()}")
        if verify and not (plain and not v.bitwise):
            click.echo(f"verify: {v.describe()}")
    if plain and not v.bitwise:
        raise NotBitForBit(f"the replay is not bit for bit: {v.describe()}")


@main.command()
@click.argument("store", type=STORE)
@click.option("--file", "lines", type=click.File("r"), default="-", show_default="standard input",
              help="The replays to run: the options of one `replay run` of STORE per line ('#' starts a comment).")
@_main_errors
def session(store, lines) -> None:
    """Run replays of the run in STORE one after another on ranks kept up between them.

    Each line is what follows `replay run STORE` (a leading `run` may be written too), and runs and prints as
    that command would. A script of your own is started once and each next replay is restored into it in place
    (checked against the record, else the script starts afresh, said in one line); the built-in trainer's
    ranks are forked from one fork server. A line that fails says why in one line and the session goes on; the
    exit status is non-zero if any failed.
    """
    ctx = click.get_current_context()
    parent = RunStore.open(store)
    check_replayable(parent, "replay session")
    manifest = parent.manifest
    lent = _lent_ranks()   # a caller's warm ranks, where they take this run's
    taken = lent is not None and lent.takes(manifest.launcher, manifest.world_size)
    own = None if taken else ranks.kept_up(manifest)
    kept = own or lent
    failed: dict[int, int] = {}   # line -> its exit status
    replays = 0
    try:
        for number, line in enumerate(lines, 1):
            try:
                args = shlex.split(line, comments=True)
            except ValueError as e:   # an unclosed quote
                replays += 1
                click.echo(f"error: line {number} of the input: {e}", err=True)
                failed[number] = 2
                continue
            if args[:1] == ["run"]:
                args = args[1:]
            if not args:
                continue
            replays += 1
            click.echo(f"$ replay run {store} {shlex.join(args)}", err=True)
            if isinstance(kept, ScriptServer):
                kept.refused = None   # said for the line whose replay it refused
            code = _session_line(ctx, store, args, kept)
            if code != 0:
                failed[number] = code
            if isinstance(kept, ScriptServer) and kept.refused is not None:
                click.echo(f"the script is started afresh from here on: {kept.refused}", err=True)
        forked = isinstance(kept, ForkServer) and kept.pid is not None
    finally:
        if own is not None:
            own.close()
    summary = f"session: {replays} replay{'s' if replays != 1 else ''}"
    if failed:
        lines_of = "line" + ("s" if len(failed) > 1 else "")
        summary += f", {len(failed)} failed ({lines_of} {', '.join(map(str, failed))} of the input)"
    if isinstance(kept, ScriptServer) and kept.starts:
        summary += "; the script was started " + ("once" if kept.starts == 1 else f"{kept.starts} times")
    if forked:
        summary += "; the ranks were forked from one fork server"
    click.echo(summary, err=True)
    if failed:   # each failed line said why in its own `error:` line; their status if they share one
        codes = set(failed.values())
        sys.exit(codes.pop() if len(codes) == 1 else 2)


def _session_line(ctx: click.Context, store: Location, args: list[str], kept: RankLauncher | None) -> int:
    """`replay run STORE ARGS` in this process on `kept`; its exit status."""
    try:
        with run_cmd.make_context("run", [str(store), *args], parent=ctx.find_root()) as sub:
            sub.obj = kept
            run_cmd.invoke(sub)
    except click.UsageError as e:
        _one_line(e).show()
        return 2
    except click.exceptions.Exit as e:   # --help: printed
        return e.exit_code
    except SystemExit as e:   # `_main_errors` said the error
        if e.code == 130:   # interrupted: the session ends with its line
            raise
        return e.code if isinstance(e.code, int) else 1
    return 0


def _csv(kind, parse):
    def convert(ctx, param, value):
        if value is None:
            return None
        try:
            return tuple(parse(v) for v in value.split(",") if v.strip())
        except ValueError:
            raise click.BadParameter(f"expected a comma-separated list of {kind}, got {value!r}") from None
    return convert


def _rank(text: str) -> int | None:
    if text == "all":
        return None
    try:
        return int(text)
    except ValueError:
        raise click.BadParameter(f"expected a rank or 'all', got {text!r}") from None


def _tile(text: str) -> tuple[int, int]:
    r, sep, c = text.strip().lower().partition("x")
    if not sep:
        raise ValueError(text)
    return int(r), int(c)


@main.command("diff")
@click.argument("store", type=STORE)
@click.argument("other", type=STORE, required=False)
@click.option("--step", required=True, type=int, help="The step to run twice (a built-in run's: a committed "
              "checkpoint there; a script's: replayed through the script from the checkpoint before it).")
@_attention_options
@click.option("--capture", help="Write this side's trace (every tensor's digest and statistics) into the store "
              "under this name, to compare in another process or on another machine, instead of diffing.")
@click.option("--against", help="Compare this process's step with the trace of this name (from --capture).")
@click.option("--keep", multiple=True, help="With --capture: keep whole the tensors of this module or attention call "
              "(e.g. 'attention 1', 'transformer.h.0.mlp'; repeatable), for their deviations and per-head signals.")
@click.option("--save", help="Keep the answer in the store under this name (replay report shows it).")
@click.option("--rank", default="0", show_default=True, callback=lambda ctx, param, value: _rank(value),
              help="Whose micro-batches and RNG states the step runs (a DDP run's ranks train different samples); "
              "`all`: every rank's, one after the other, their gradients averaged as DDP's.")
@click.option("--top", type=int, default=8, show_default=True, help="How many differences after the first to list.")
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
@_main_errors
def diff_cmd(store, other, step, attention, layers, heads, precision, fix, hp_delta, capture, against, keep, save,
             rank, top, as_json) -> None:
    """Run step N of the run in STORE twice from its checkpoint (a script's run: through the script), as
    recorded (A) and with the overrides (B), or as STORE and OTHER (two runs or replays with the same state and
    samples at N) each ran it, and say
    where they first part: every module's output and gradient, every attention call's O, dO, dQ, dK and dV,
    and every weight gradient, compared as they are produced; per attention head, the deviations and Qiu &
    Yao's signals (delta's sign bias, W_Q's gradient error alignment)."""
    overrides = _step_overrides(attention, layers, heads, precision, fix, hp_delta)
    # lazy: torch and transformers (the launching commands load neither: tests/test_layers_integration.py)
    from replay.replayer.diff import capture as capture_trace
    from replay.replayer.diff import check_name
    from replay.replayer.diff import diff as step_diff
    from replay.replayer.diff import save as save_diff

    if capture and against:
        raise ReplayError("--capture writes a trace and --against reads one: give one of them")
    if other is not None and (capture or against):
        raise UsageError("--capture and --against take one store: replay diff STORE --step N --capture NAME")
    if keep and not capture:
        raise UsageError("--keep says what a trace keeps whole: give it with --capture NAME")
    if save is not None:
        if capture:
            raise UsageError("--capture writes a trace, --save a diff's answer: give one of them")
        check_name(save, "--save")
    if capture:
        count, notes = capture_trace(store, step, overrides, capture, rank, tuple(keep))
        for note in notes:
            click.echo(f"note: {note}", err=True)
        click.echo(f"trace {capture} of step {step}: {count} tensors' digests and statistics"
                   + (f", whole those of {', '.join(keep)}" if keep else "") + f", in {store}/traces/{capture}")
        return
    result = step_diff(store, step, overrides, against=against, other=other, rank=rank)
    if save is not None:
        save_diff(store, result, save)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        for line in diff_lines(result, top):
            click.echo(line)


@main.command("export")
@click.argument("store", type=STORE)
@click.option("--step", required=True, type=int, help="The committed checkpoint to export.")
@click.option("--to", "out", required=True, type=click.Path(file_okay=False),
              help="DCP directory to write (new or empty).")
@_main_errors
def export_cmd(store, step, out) -> None:
    """Write checkpoint STEP of the run in STORE as a torch.distributed.checkpoint (DCP) directory, for
    torchtitan, OLMo-core or `dcp.load`: the model's whole tensors under "model", by state-dict name (a
    sharded run's assembled). The optimizer needs the model and optimizer objects: replay.store.dcp.export."""
    # lazy: torch and DCP (2 s); the other commands start without them
    from replay.store.dcp import export

    click.echo(export(store, step, out).line())


@main.command()
@click.option("--mode", type=click.Choice(["sweep", "mechanism", "all", "flash"]), default="all", show_default=True,
              help="Golden et al.'s deviation sweep, Qiu & Yao's tied-maxima bias, or both; flash (a CUDA GPU): "
              "the real flash kernel against FP64 and, bit for bit, against the emulation.")
@click.option("--precisions", callback=_csv("precisions", str), help="e.g. bf16,fp16,fp32")
@click.option("--seq-lens", callback=_csv("integers", int), help="e.g. 128,256,512,1024,2048")
@click.option("--tiles", callback=_csv("tiles BRxBC", _tile), help="e.g. 32x32,64x64,128x128,64x128,128x64")
@click.option("--head-dims", callback=_csv("integers", int), help="e.g. 64,128")
@click.option("--trials", type=int, help="Rows of the mechanism mode (default 20000).")
@click.option("-o", "--out", "out_dir", default="runs/microbench", show_default=True,
              type=click.Path(file_okay=False), help="Directory for the CSV, Zarr and PNG files.")
@_main_errors
def microbench(mode, precisions, seq_lens, tiles, head_dims, trials, out_dir) -> None:
    """Numerics of the attention backends against FP64 baseline attention.

    The sweep (Golden et al.): max, mean and std of |difference| from FP64 baseline attention, for O and
    dQ, dK, dV, of the FA2 emulation (both rounding placements) and of baseline attention at each
    precision, over sequence lengths, tile shapes and head dims; prints the Flash/Baseline ratio at BF16.
    The mechanism (Qiu & Yao): the signed bias of O and of delta on rows with tied maxima and a V of one
    sign, with and without the safe-softmax fix, with 95% confidence intervals.
    """
    # lazy: the CLI starts without torch (1 s)
    from replay.experiments import flash_check, golden, mechanism

    out = Path(out_dir)
    given = {k: v for k, v in dict(precisions=precisions, seq_lens=seq_lens, tiles=tiles, head_dims=head_dims).items()
             if v}
    if mode == "flash":
        flash = flash_check.run_flash_check(flash_check.FlashCheckConfig(**given), out / "flash",
                                            progress=lambda m: click.echo(m, err=True))
        click.echo("\n".join(flash.summary_lines()))
    if mode in ("sweep", "all"):
        sweep = golden.run_sweep(golden.SweepConfig(**given), out / "sweep", progress=lambda m: click.echo(m, err=True))
        click.echo("\n".join(sweep.summary_lines()))
    if mode in ("mechanism", "all"):
        bias = mechanism.run_mechanism(mechanism.MechanismConfig(**({"trials": trials} if trials is not None else {})),
                                       out / "mechanism", progress=lambda m: click.echo(m, err=True))
        click.echo("\n".join(bias.summary_lines()))
    click.echo(f"wrote {out}/", err=True)


def _ray_options(fn):
    fn = click.option("--workers", type=int, help="Most work items at once (default: every CPU of the cluster).")(fn)
    return click.option("--ray-address", envvar="RAY_ADDRESS", default=None,
                        help="host:port of a Ray cluster's head (default: RAY_ADDRESS, else a local cluster). "
                        "Its workers must see the store at the same path, or reach its bucket.")(fn)


def _series_options(fn):
    """What checkpoints replay did not record may not say (analysis/series.py)."""
    fn = click.option("--layout", help="Where their attention weights are: hf-gpt2, nanogpt, hf-llama or a JSON "
                      "mapping of their keys (default: found from their config or tensor names).")(fn)
    return click.option("--heads", type=int, help="Attention heads of their model, where the checkpoints do not "
                        "say it (DCP).")(fn)


def _layout_option(value: str | None):
    if value is None or not value.lstrip().startswith("{"):
        return value
    try:
        return json.loads(value)
    except ValueError as e:
        raise ReplayError(f"--layout is neither a layout name nor a JSON mapping: {e}") from None


@main.command()
@click.argument("store", type=STORE)
@_ray_options
@_series_options
@click.option("--spike", "spikes", type=int, multiple=True,
              help="Checkpoints replay did not record: a step to rank the heads before (besides their losses' spikes).")
@click.option("--into", type=STORE, help="Checkpoints replay did not record: the store of their analysis "
              f"(default: {series.INTO} in their folder).")
@click.option("--top", default=5, show_default=True, type=click.IntRange(min=0),
              help="Rows of the localisation ranking to print.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary and rankings as JSON.")
@_main_errors
def analyze(store, ray_address, workers, heads, layout, spikes, into, top, as_json) -> None:
    """Per-layer and per-head metrics of every checkpoint, and replay weight distances, on Ray.

    Spectral norms (W_Q, W_K, W_V, W_O per head and whole, W_Q,h W_K,h^T per head, MLP), update
    statistics between checkpoints, probe-batch attention logits and BF16 tied maxima, and each
    replay's weight distances against the run, into STORE/analysis. Only what is not done yet is
    computed. Then, for every recorded spike, ranks the layers and heads whose metrics moved most
    against their own history before it.

    STORE may also be a folder (or s3:// prefix) of checkpoints replay did not record: transformers
    Trainer checkpoint-* folders, torch.distributed.checkpoint folders or nanoGPT ckpt.pt files.
    """
    _for_series_only(store, {"--heads": heads, "--layout": layout, "--spike": spikes, "--into": into})
    summary = run_analysis(store, ray_address, workers, progress=lambda m: click.echo(m, err=True), heads=heads,
                           layout=_layout_option(layout), spikes=spikes, into=into)
    store = into or series.analysis_store(store)
    found = localise_store(store)
    if as_json:
        click.echo(json.dumps({"computed": summary.computed, "already_done": summary.skipped,
                               "nodes": len(summary.nodes), "seconds": summary.seconds,
                               "spikes": [f.to_dict() for f in found]}, indent=2))
        return
    click.echo(f"analysed {store}: {summary.computed} work items computed on {len(summary.nodes)} node(s) in "
               f"{summary.seconds:.1f} s, {summary.skipped} already done")
    click.echo("\n".join(line for f in found for line in f.lines(top)) or "no spike recorded: nothing to localise")


def _for_series_only(store: Location, options: dict[str, object]) -> None:
    """Refuse the options of checkpoints replay did not record given with a store, which says them itself."""
    given = [name for name, value in options.items() if value not in (None, ())]
    if given and series.is_store(store):
        raise UsageError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for folders of checkpoints replay "
                         f"did not record; {store} is a store, whose run says them: leave them out")


@main.command()
@click.argument("store", type=STORE)
@click.option("--spike", type=int, help="Step of the spike to bisect (default: the largest recorded one).")
@click.option("--by", type=click.Choice(["steps", "layers", "heads", "data", "all"]), default="all", show_default=True,
              help="What to narrow down: the step window, layers, heads (after layers), batches and samples.")
@click.option("--fix", default="safe-softmax", show_default=True,
              help="The counterfactual: safe-softmax[:BETA], hp-delta, attention=BACKEND, precision=bf16|fp32 or "
                   "lr-scale=X, joined with + (e.g. attention=fa2-emu+safe-softmax).")
@click.option("--horizon", type=int, default=10, show_default=True,
              help="Steps after the spike that must stay quiet for a probe to prevent it.")
@click.option("--threshold", type=float, help="The detector's robust-z threshold (default: the recording's).")
@click.option("--min-delta", type=click.FloatRange(min=0.0),
              help="The detector's smallest rise above the median, in nats (default: the recording's "
                   "spike.min_delta, 0): set it for a loss memorised near 0, whose wobbles otherwise count.")
@click.option("--max-probes", type=int, default=200, show_default=True,
              help="Probe budget of the session; past it, the answer is not minimal (and says so).")
@_ray_options
@click.option("--pack", is_flag=True, help="A run recorded on several nodes, on a cluster: let a probe's ranks share "
              "nodes (default: each probe's ranks on nodes as recorded, a placement group per probe).")
@click.option("--allow-changed", is_flag=True, help="A run of your own script: replay it even if its files changed.")
@click.option("--json", "as_json", is_flag=True, help="Print the session (verdict, phases, probes) as JSON.")
@_main_errors
def bisect(store, spike, by, fix, horizon, threshold, min_delta, max_probes, ray_address, workers, pack,
           allow_changed, as_json) -> None:
    """Narrow a loss spike in STORE down with replays ("probes") run in parallel as Ray tasks.

    First a plain replay from the nearest checkpoint before the spike must reproduce it. Then: the
    latest checkpoint and step from which the counterfactual (--fix) still prevents the spike; a
    minimal set of layers, then heads, it must be applied to; a minimal set of batches, then samples,
    whose removal prevents it. "Prevents" is the recording's own spike-detector rule, applied up to
    --horizon steps after the spike. Probes are replays stored in STORE; the session is stored in
    STORE/bisect/, so the same command resumes an interrupted bisect. Exit code 3: no spike recorded;
    4: the plain replay does not reproduce the record.
    """
    cfg = BisectConfig(spike=spike, by=by, fix=fix, horizon=horizon, threshold=threshold, min_delta=min_delta,
                       max_probes=max_probes, workers=workers, address=ray_address, pack=pack,
                       allow_changed=allow_changed)
    lent = _lent_ranks()   # a caller's fork server: the probes' warm ranks are forked from it
    forks = lent if isinstance(lent, ForkServer) and lent.script is None else None
    session = run_bisect(store, cfg, progress=lambda m: click.echo(m, err=True), forks=forks)
    if as_json:
        click.echo(json.dumps(session.to_dict(), indent=2))
        return
    assert session.verdict is not None, "a bisect ends with its verdict, or raises"
    click.echo("\n".join(session.verdict.lines(_sample_lines(store))))


def _sample_lines(store: Location):
    """How a bisect answer shows one of the samples it names: as `replay batch` prints it."""
    def sample(step: int, sample_id: int) -> list[str]:
        return next((sample_lines(row) for row in step_batch(store, step) if row["sample_id"] == sample_id), [])

    return sample


@main.command()
@click.argument("store", type=STORE)
@click.option("-o", "--out", "out", type=click.Path(dir_okay=False),
              help="HTML file to write (default STORE/report.html).")
@_main_errors
def report(store, out) -> None:
    """One self-contained HTML page: loss and grad norm with spikes and replays, the localisation
    ranking, per-head spectral-norm heatmaps and weight distances (PNGs embedded; no server needed)."""
    store = series.analysis_store(store)
    try:
        written = write_report(store, out, warn=lambda m: click.echo(f"warning: {m}", err=True))
    except OSError as e:
        if e.errno not in _UNWRITABLE:
            raise
        raise ReplayError(f"the report cannot be written to {e.filename} ({e.strerror}): write it elsewhere with "
                          "-o FILE") from None
    click.echo(f"wrote {written}")


@main.command()
@click.argument("store_a", type=STORE)
@click.argument("store_b", type=STORE)
@_ray_options
@_series_options
@click.option("--json", "as_json", is_flag=True, help="Print every distance as JSON.")
@_main_errors
def compare(store_a, store_b, ray_address, workers, heads, layout, as_json) -> None:
    """Weight distances of STORE_B against STORE_A at their common checkpoints.

    Per tensor: max |difference|, Frobenius, relative Frobenius and Wasserstein-1 of the value
    distributions (scipy); the table prints each step's largest over tensors, and all of it is stored in
    STORE_A/analysis/distances/.
    """
    result = run_compare(store_a, store_b, ray_address, workers, progress=lambda m: click.echo(m, err=True),
                         heads=heads, layout=_layout_option(layout))
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(f"{result['other']} against {result['reference']} ({len(result['tensors'])} tensors; "
               f"stored in {result['table']})")
    click.echo(f"{'step':>8} {'max |diff|':>12} {'frobenius':>12} {'relative':>12} {'wasserstein':>12}")
    for i, step in enumerate(result["steps"]):
        row = [max(result[m][i]) for m in ("max_abs", "frobenius", "relative", "wasserstein")]
        click.echo(f"{step:>8} " + " ".join(f"{v:>12.4e}" for v in row))
    click.echo("(each column: the largest over tensors)")


@main.command()
@click.option("--out", default="runs/demo", show_default=True, type=STORE,
              help="Run store of the demo (reused if the demo already ran there).")
@_main_errors
def demo(out) -> None:
    """The whole story on the embedded default, on a laptop: record the `spike` preset on 2 CPU ranks,
    bisect its spike, replay the steps before it densely, diff the decisive step operation by operation,
    analyse every checkpoint on a local Ray cluster and write the report. Stages already done in OUT are
    reused."""
    result = run_demo(out, progress=lambda m: click.echo(m, err=True))
    click.echo("\n".join(result.lines(_sample_lines(result.store))))


def run() -> None:
    """The `replay` program (its console script, `python -m replay`): `main`, ended by `exit_process`."""
    try:
        main()
    except SystemExit as e:
        exit_process(e.code)


if __name__ == "__main__":
    run()
