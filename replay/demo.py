"""`replay demo`: the whole story on the embedded default, on a laptop. Read it top to bottom.

Record the `spike` preset on 2 CPU ranks (a real loss spike), bisect it, replay the steps before it
densely and bit for bit, diff the decisive step operation by operation under the papers' mechanism (emulated
BF16 attention on the layers the bisect named), analyse every checkpoint on a local Ray cluster, and write
the report. Every stage is the same code the commands run, and every stage that is already done is reused, so
running the demo again (or after an interruption) only does what is missing.

The spike of the `spike` preset is a memorisation spike: an Adam instability of a tiny model on 8
fixed sequences, not the papers' BF16 attention mechanism. Its counterfactual is therefore a halved
learning rate (`lr-scale=0.5`), which the bisect applies from a step, to layers and to heads; on a
BF16 flash-attention run the default is the safe-softmax fix.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from replay.analysis.jobs import analyze
from replay.analysis.localise import Localisation, localise_store
from replay.analysis.report import write_report
from replay.bisect.narrow import BisectConfig, bisect
from replay.bisect.session import Session
from replay.config import build_config
from replay.errors import UsageError
from replay.launch import ranks
from replay.launch.forkserver import ForkServer
from replay.launch.pool import RankPool
from replay.launch.ray_cluster import ray_session
from replay.replayer.replays import ReplayRequest
from replay.replayer.replays import run as replay
from replay.store import RunStore
from replay.store.location import Location, Where
from replay.store.overrides import Overrides
from replay.store.step_diff import StepDiff

PRESET, NPROC = "spike", 2
FIX = "lr-scale=0.5"
DENSE_BEFORE, DENSE_AFTER, DENSE_EVERY = 24, 3, 2   # the dense replay: spike - 24 .. spike + 3, every 2 steps
MECHANISM = "reference-emu:dtype=bf16"   # the decisive step's diff: attention with BF16 rounding, emulated


@dataclass
class DemoResult:
    store: Location
    report: Path
    bisect: Session
    localisation: list[Localisation]
    stages: dict[str, float]   # seconds per stage
    diff: StepDiff | None      # the decisive step under MECHANISM (None: the bisect decided no window)
    diff_command: str

    def lines(self, sample: Callable[[int, int], list[str]]) -> list[str]:
        """The story's answer in words; `sample(step, id)` shows one sample."""
        v = self.bisect.verdict
        assert v is not None, "run_demo's bisect ends with its verdict"
        out = ["", f"The recorded spike, bisected ({v.probes} probe replays in {v.seconds:.0f} s):", *v.lines(sample)]
        for f in [f for f in self.localisation if f.found][:1]:
            top = f.heads[0]
            out.append(f"Analysis: at checkpoint {f.checkpoint}, just before the spike, the most unusual head is "
                       f"{top.unit} ({top.signal} {top.value:.3g} against a median of {top.baseline:.3g}, robust z "
                       f"{top.score:.1f})")
        if self.diff is not None:
            out.append(_diff_line(self.diff))
            out.append(f"  (all of it: {self.diff_command})")
        out.append("Stages: " + ", ".join(f"{k} {s:.0f} s" for k, s in self.stages.items()))
        out.append(f"Where to look: {self.report} (open it in a browser); `replay info {self.store}`; "
                   f"`replay batch {self.store} --step {v.spike}`")
        return out


def run_demo(store: Where, progress: Callable[[str], None]) -> DemoResult:
    store = Location.parse(store)
    stages: dict[str, float] = {}
    t = time.perf_counter()

    # the recording and the dense replay run on the same warm ranks; they and the bisect's are forked from one server
    with ForkServer() as forks, RankPool(NPROC, forks=forks) as pool:
        progress(f"[1/6] record: the `{PRESET}` preset on {NPROC} CPU ranks into {store}")
        _record(store, progress, pool)
        stages["record"], t = time.perf_counter() - t, time.perf_counter()

        with ray_session():   # one local Ray cluster for the bisect (where its probes need one) and the analysis
            progress(f"[2/6] bisect the largest spike with the counterfactual {FIX}")
            session = bisect(store, BisectConfig(fix=FIX), progress=lambda m: progress("      " + m), forks=forks)
            stages["bisect"], t = time.perf_counter() - t, time.perf_counter()

            assert session.verdict is not None, "a bisect ends with its verdict, or raises"
            spike = session.verdict.spike
            start, stop = max(0, spike - DENSE_BEFORE), spike + DENSE_AFTER
            progress(f"[3/6] replay steps {start}..{stop} with a checkpoint every {DENSE_EVERY} steps, "
                     "verified bit for bit")
            dense = replay(store, ReplayRequest(start, stop, checkpoint_every=DENSE_EVERY, resume=True), ranks=pool)
            divergence = dense.verification.divergence if dense.verification else None
            if divergence is not None:
                progress(f"      warning: {divergence.describe()}")
            stages["replay"], t = time.perf_counter() - t, time.perf_counter()

            step_diff, diff_command = _decisive_diff(store, dense.location, session, pool, progress)
            stages["diff"], t = time.perf_counter() - t, time.perf_counter()

            progress("[5/6] analyse every checkpoint of the run and its replays")
            analyze(store, progress=lambda m: progress("      " + m), every=10)
            stages["analyze"], t = time.perf_counter() - t, time.perf_counter()

    progress("[6/6] write the report")
    report = write_report(store, None)
    stages["report"] = time.perf_counter() - t
    return DemoResult(store, Path(report), session, localise_store(store), stages, step_diff, diff_command)


def _decisive_diff(store: Location, dense: Location, session: Session, pool: RankPool,
                   progress: Callable[[str], None]) -> tuple[StepDiff | None, str]:
    """The first step of the bisect's window, run twice from its checkpoint, as recorded and with MECHANISM on the
    layers the bisect named: which operation first parts, and the papers' signals per head. The dense replay
    holds the checkpoint when the step falls on its cadence, else a one-step replay writes it. Kept in the store
    for the report (`replay diff --save`)."""
    from replay.replayer.diff import diff, save  # lazy: torch and transformers in this process

    verdict = session.verdict
    assert verdict is not None, "a bisect ends with its verdict"
    if not verdict.window:
        return None, ""
    step, layers = verdict.window[0], verdict.layers
    where = "every layer" if not layers else "layer" + ("s " if len(layers) > 1 else " ") + ", ".join(map(str, layers))
    progress(f"[4/6] diff step {step} operation by operation with {MECHANISM} attention on {where}")
    source = dense
    if not any(c.step == step for c in RunStore.open(dense).checkpoints()):
        source = replay(store, ReplayRequest(step, step, checkpoint_every=1, name=f"at-{step}", resume=True),
                        ranks=pool).location
    overrides = Overrides(attention=MECHANISM, layers=layers)
    result = diff(source, step, overrides)
    save(store, result, f"demo-step-{step}")
    command = (f"replay diff {source} --step {step} --attention {MECHANISM}"
               + (f" --layers {','.join(map(str, layers))}" if layers else ""))
    return result, command


def _diff_line(result: StepDiff) -> str:
    """The decisive step's diff in words: where it first parts and the papers' signal per head."""
    layers = result.overrides.get("layers")
    head = (f"Operation by operation at step {result.step}, {MECHANISM} attention on "
            + (f"layer {', '.join(map(str, layers))}" if layers else "every layer") + ": ")
    if result.first is None:
        return head + "no difference (the layer's attention rounds the same at BF16 here)"
    first = result.first
    bias = ", ".join(f"{h.layer}.{h.head} {h.delta_sign_bias:+.2f}" for h in result.heads if h.delta != 0)
    return (head + f"{len(result.differences)} of {result.compared} tensors differ, first {first.phase} "
            f"{first.where} {first.what}; sign bias of delta's error per head {bias or 'none'} (one sign "
            "throughout is Qiu & Yao's biased rounding)")


def _record(store: Location, progress: Callable[[str], None], pool: RankPool) -> None:
    if store.children():
        existing = RunStore.open(store)
        if existing.manifest.config.preset != PRESET or existing.kind != "run":
            raise UsageError(f"{store} holds another run; give `replay demo` a new --out directory")
        if existing.manifest.status == "complete":
            progress(f"      {store} already holds the recording: reusing it")
            return
        ranks.record_resume(store, NPROC, command="replay demo", ranks=pool)
        return
    ranks.record_new(store, build_config(PRESET, None, [], nproc=NPROC), command="replay demo", ranks=pool)
