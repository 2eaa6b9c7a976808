"""The search for a BF16 flash-attention spike at laptop scale (Qiu & Yao's failure, small enough for a
laptop): every recipe is recorded with the `reference` placement in BF16 (`reference-emu`: per-tile
Pbar @ V and the O accumulator in BF16, as their released code) and, side by side, with the same kernel
in FP32 (the control); where the BF16 arm spikes and the control does not, the same recipe runs with the
safe-softmax fix and with an FP32 delta (`hp-delta`), over three seeds. "Spikes" are the loss spikes
that matter: a step whose loss is 0.1 nats or more above the median of the 50 before it and 6 robust
z-scores out (the recorder's online detector also fires on wobbles of a loss memorised to 1e-5, which
the table counts apart).

    .venv/bin/python -m results.flash_search [--jobs 2] [--only NAME ...] [--table FILE] [--done-only]

Every run is a `replay record` (the command is in the table); a finished run in the work directory
(`runs/flash-search`) is reused, so an interrupted search continues where it stopped. A run's outcome is
its loss spikes by the rule above, how often its recorder's detector fired, its final and smallest loss;
with `numerics`, the mean tied-maxima rate per layer (`replay record --numerics`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from replay.lifeline import child_env

ARMS = {   # the attention plan of each arm; every run trains under BF16 autocast
    "bf16": "reference-emu",
    "fp32": "reference-emu:dtype=fp32",
    "fix": "reference-emu:fix=safe-softmax",
    "hp-delta": "reference-emu:hp-delta",
}
CONTROLS = ("fix", "hp-delta")
SEEDS = (1, 2, 3)
CANDIDATE = "phrase8-n16-lr3e-3-4L-noclip"   # the one recipe whose BF16 arm alone spiked (seed 1)
WINDOW, MIN_RISE, Z = 50, 0.1, 6.0   # what counts as a spike here (see above)


@dataclass
class Recipe:
    name: str
    lead: str                     # which lead of the search it follows
    data: str                     # "phrase:K:V" (a K-token phrase over V tokens, repeated), "random:V", "corpus"
    samples: int                  # data.max_samples: how many sequences the run memorises (0: all)
    steps: int
    lr: float
    sets: dict[str, object] = field(default_factory=dict)   # further --set keys
    numerics: bool = False
    screen: tuple[int, ...] = SEEDS[:1]   # the seeds whose BF16 and FP32 arms are run before any follow-up

    def args(self, store: Path, data_file: Path | None, arm: str, seed: int) -> list[str]:
        args = ["record", "--store", str(store), "--steps", str(self.steps), "--precision", "bf16", "--attention",
                ARMS[arm], "--seed", str(seed), "--checkpoint-every", str(max(self.steps // 4, 1))]
        if data_file is not None:
            args += ["--data", str(data_file)]
        if self.numerics and arm == "bf16":
            args.append("--numerics")
        sets = {"threads": 1, "snapshot_every": 0, "data.max_samples": self.samples, "optim.lr": self.lr,
                "optim.min_lr": self.lr, "optim.warmup_steps": 0, "optim.weight_decay": 0.0, **self.sets}
        for key, value in sets.items():
            args += ["--set", f"{key}={value}"]
        return args


def _r(name, lead, data, samples, steps, lr, numerics=False, screen=SEEDS[:1], **sets) -> Recipe:
    return Recipe(name, lead, data, samples, steps, lr, {k.replace("__", "."): v for k, v in sets.items()}, numerics,
                  screen)


# The recipes, in the order they were tried. Names say data, model and optimiser.
RECIPES = [
    # lead: memorised repeated phrase (ties need identical BF16 keys: repeated tokens), Adam near zero gradient
    _r("phrase8-n16-lr1e-3", "memorised phrase", "phrase:8:16", 16, 3000, 1e-3, numerics=True),
    _r("phrase8-n16-lr3e-4", "memorised phrase", "phrase:8:16", 16, 4000, 3e-4),
    _r("phrase4-n16-lr1e-3", "memorised phrase", "phrase:4:16", 16, 3000, 1e-3),
    _r("phrase16-n16-lr1e-3", "memorised phrase", "phrase:16:64", 16, 3000, 1e-3),
    _r("phrase8-n64-lr1e-3", "memorised phrase", "phrase:8:16", 64, 3000, 1e-3),
    _r("phrase8-n16-lr3e-3", "high lr", "phrase:8:16", 16, 3000, 3e-3),
    _r("phrase8-n16-lr1e-2", "high lr", "phrase:8:16", 16, 2000, 1e-2),
    # lead: the `spike` preset's regime (a memorised byte corpus), which spikes by itself in FP32
    _r("corpus-n8-lr3e-3", "spike preset's regime", "corpus", 8, 3000, 3e-3),
    _r("corpus-n8-lr1e-3", "spike preset's regime", "corpus", 8, 3000, 1e-3),
    _r("corpus-n64-lr1e-3", "less memorised", "corpus", 64, 3000, 1e-3),
    _r("corpus-all-lr1e-3", "no memorisation", "corpus", 0, 3000, 1e-3),
    _r("corpus-n8-lr1e-3-long", "long run", "corpus", 8, 6000, 1e-3),
    _r("phrase8-n16-lr1e-3-b2-0.99", "beta2", "phrase:8:16", 16, 3000, 1e-3, optim__beta2=0.99),
    _r("phrase8-n16-lr1e-3-noclip", "no clipping", "phrase:8:16", 16, 3000, 1e-3, optim__grad_clip=0.0),
    _r("phrase8-n16-lr3e-3-noclip", "no clipping", "phrase:8:16", 16, 3000, 3e-3, optim__grad_clip=0.0),
    _r("phrase8-n16-lr1e-3-4L", "depth", "phrase:8:16", 16, 3000, 1e-3, model__n_layer=4),
    _r("phrase8-n16-lr1e-3-4H", "heads", "phrase:8:16", 16, 3000, 1e-3, model__n_head=4),
    _r("phrase8-n16-lr1e-3-w128", "width", "phrase:8:16", 16, 3000, 1e-3, model__n_embd=128),
    _r("phrase8-n16-lr1e-3-seq128", "longer rows", "phrase:8:16", 16, 2000, 1e-3, model__block_size=128),
    _r("phrase2-n16-lr1e-3", "more ties", "phrase:2:4", 16, 3000, 1e-3, numerics=True),
    _r("random-n16-lr1e-3", "memorised noise", "random:64", 16, 3000, 1e-3),
    _r("phrase8-n16-lr1e-3-long", "long run", "phrase:8:16", 16, 6000, 1e-3),
    _r("phrase8-n16-lr3e-4-long", "long run", "phrase:8:16", 16, 8000, 3e-4),
    _r("phrase8-n16-lr1e-3-eps1e-12", "Adam eps", "phrase:8:16", 16, 3000, 1e-3, optim__eps=1e-12),
    _r("phrase8-n16-lr1e-3-b1-0.95", "beta1", "phrase:8:16", 16, 3000, 1e-3, optim__beta1=0.95),
    _r("phrase8-n16-lr1e-3-batch32", "batch", "phrase:8:16", 16, 3000, 1e-3, batch_size=16, micro_batch_size=8),
    _r("phrase8-n4-lr1e-3", "fewer samples", "phrase:8:16", 4, 3000, 1e-3),
    _r("phrase8-n16-lr3e-3-4L-noclip", "deep, no clipping", "phrase:8:16", 16, 3000, 3e-3, model__n_layer=4,
       optim__grad_clip=0.0),
    _r("phrase8-n16-lr1e-3-w32", "narrow", "phrase:8:16", 16, 3000, 1e-3, model__n_embd=32),
    _r("phrase8-n16-lr1e-3-8H", "head dim 8", "phrase:8:16", 16, 3000, 1e-3, model__n_head=8),
    # around the one BF16-only spike (seed 1 of phrase8-n16-lr3e-3-4L-noclip), every seed screened
    *[_r(name, f"near the candidate: {lead}", data, 16, steps, lr, screen=SEEDS, model__n_layer=layers,
         optim__grad_clip=0.0, **sets)
      for name, lead, data, steps, lr, layers, sets in [
          ("phrase8-n16-lr3e-3-4L-noclip-long", "longer", "phrase:8:16", 5000, 3e-3, 4, {}),
          ("phrase8-n16-lr5e-3-4L-noclip", "higher lr", "phrase:8:16", 3000, 5e-3, 4, {}),
          ("phrase8-n16-lr2e-3-4L-noclip", "lower lr", "phrase:8:16", 3000, 2e-3, 4, {}),
          ("phrase8-n16-lr3e-3-6L-noclip", "deeper", "phrase:8:16", 3000, 3e-3, 6, {}),
          ("phrase8-n16-lr3e-3-4L4H-noclip", "more heads", "phrase:8:16", 3000, 3e-3, 4, {"model__n_head": 4})]],
]


def write_data(spec: str, path: Path, block: int = 64, n_samples: int = 4096) -> Path | None:
    """The token file a data spec names (None: the built-in corpus); deterministic."""
    kind, *params = spec.split(":")
    if kind == "corpus":
        return None
    n = n_samples * block + 1
    rng = np.random.default_rng(0)
    if kind == "phrase":
        period, vocab = int(params[0]), int(params[1])
        tokens = np.resize(rng.permutation(vocab)[:period] if period <= vocab else rng.integers(0, vocab, period), n)
    elif kind == "random":
        tokens = rng.integers(0, int(params[0]), n)
    else:
        raise ValueError(f"unknown data spec {spec!r}")
    if not path.is_file():   # written once, whole: running recordings map it, and a rewrite under them kills them
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tokens.astype(np.uint16).tofile(tmp)
        tmp.replace(path)
    return path


@dataclass
class Outcome:
    recipe: str
    arm: str
    seed: int
    command: str
    steps: int = 0
    spikes: list[int] = field(default_factory=list)        # loss spikes by the rule above
    detector: int = 0                                       # how many times the recorder's detector fired
    final_loss: float = float("nan")
    min_loss: float = float("nan")
    max_loss_after_min: float = float("nan")
    non_finite: bool = False
    tie_rate: list[float] = field(default_factory=list)
    seconds: float = 0.0
    error: str = ""

    @property
    def verdict(self) -> str:
        if self.error:
            return "failed"
        if self.non_finite:
            return "diverged"
        return f"{len(self.spikes)} spike(s)" if self.spikes else "quiet"


def outcome_of(store: Path, recipe: Recipe, arm: str, seed: int, command: str, seconds: float) -> Outcome:
    from replay.store import RunStore

    run = RunStore.open(store)
    loss = run.read_steps(["loss"])["loss"]
    o = Outcome(recipe.name, arm, seed, command, steps=len(loss), spikes=loss_spikes(loss),
                detector=len(run.spikes), seconds=seconds)
    finite = loss[np.isfinite(loss)]
    o.non_finite = len(finite) < len(loss)
    if len(finite):
        i = int(np.argmin(loss)) if not o.non_finite else int(np.nanargmin(np.where(np.isfinite(loss), loss, np.nan)))
        o.final_loss, o.min_loss = float(loss[-1]), float(loss[i])
        o.max_loss_after_min = float(np.nanmax(np.where(np.isfinite(loss[i:]), loss[i:], np.nan)))
    if run.manifest.config.numerics:
        o.tie_rate = [float(x) for x in np.nanmean(run.read_steps(["tied_rate"])["tied_rate"], axis=0)]
    return o


def loss_spikes(loss: np.ndarray) -> list[int]:
    """The first step of each spike: a loss MIN_RISE nats above the median of the WINDOW steps before and
    Z robust z-scores out, or a non-finite one; steps within WINDOW of a spike's last step belong to it."""
    from replay.recorder.spikes import robust_z

    out: list[int] = []
    last = -WINDOW - 1
    for step in range(WINDOW, len(loss)):
        history = loss[step - WINDOW:step]
        history = history[np.isfinite(history)]
        high = not np.isfinite(loss[step]) or (len(history) > 0 and loss[step] - np.median(history) >= MIN_RISE
                                               and robust_z(history, float(loss[step]))[0] >= Z)
        if high:
            if step - last > WINDOW:
                out.append(step)
            last = step
    return out


def _paths(work: Path, recipe: str, arm: str, seed: int) -> tuple[Path, Path]:
    """(the run's store, the file of its outcome, written once the run finished)."""
    name = f"{recipe}-{arm}-s{seed}"
    return work / "runs" / name, work / "outcomes" / f"{name}.json"


def _done(work: Path, recipe: Recipe, arm: str, seed: int) -> Outcome:
    """The outcome of a finished run, read again from its store (a failed run's from its file)."""
    store, done = _paths(work, recipe.name, arm, seed)
    saved = json.loads(done.read_text())
    if saved["error"]:
        return Outcome(**saved)
    return outcome_of(store, recipe, arm, seed, saved["command"], saved["seconds"])


def run_one(work: Path, recipe: Recipe, arm: str, seed: int) -> Outcome:
    store, done = _paths(work, recipe.name, arm, seed)
    data_file = write_data(recipe.data, work / "data" / f"{recipe.data.replace(':', '-')}.bin",
                           int(recipe.sets.get("model.block_size", 64)))
    args = recipe.args(store, data_file, arm, seed)
    command = shlex.join(["replay", *args])
    if done.is_file() and json.loads(done.read_text())["command"] == command:   # finished in an earlier search
        return _done(work, recipe, arm, seed)
    if store.exists():   # an interrupted run of an earlier search: record it anew
        import shutil

        shutil.rmtree(store)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "replay", *args], capture_output=True, text=True, env=child_env())
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        o = Outcome(recipe.name, arm, seed, command, seconds=seconds, error=proc.stderr.strip().splitlines()[-1])
    else:
        o = outcome_of(store, recipe, arm, seed, command, seconds)
    done.parent.mkdir(parents=True, exist_ok=True)
    done.write_text(json.dumps(vars(o)))
    print(f"  {store.name}: {o.verdict} {o.spikes[:5]} final {o.final_loss:.4f} ({seconds:.0f} s)", file=sys.stderr)
    return o


def search(work: Path, recipes: list[Recipe], jobs: int) -> list[Outcome]:
    """Screen every recipe (BF16 and FP32 arms of its screening seeds, side by side); where BF16 alone spikes
    on one of them, run the fix and hp-delta arms and the other seeds."""
    lock = threading.Lock()
    found: list[Outcome] = []

    def one(job):
        o = run_one(work, *job)
        with lock:
            found.append(o)
        return o

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        screen = list(pool.map(one, [(r, arm, seed) for r in recipes for seed in r.screen for arm in ("bf16", "fp32")]))
        by = {(o.recipe, o.arm, o.seed): o for o in screen}
        hits = [r for r in recipes if any(by[(r.name, "bf16", s)].spikes and not by[(r.name, "fp32", s)].spikes
                                          for s in r.screen)]
        follow = [(r, arm, seed) for r in hits for seed in SEEDS for arm in ARMS
                  if not (seed in r.screen and arm in ("bf16", "fp32"))]
        list(pool.map(one, follow))
    order = {(r.name): i for i, r in enumerate(recipes)}
    return sorted(found, key=lambda o: (order[o.recipe], o.seed, list(ARMS).index(o.arm)))


def done_outcomes(work: Path, recipes: list[Recipe]) -> list[Outcome]:
    """The outcomes of the runs an earlier search finished, in the search's order (nothing is run)."""
    return [_done(work, r, arm, seed) for r in recipes for seed in SEEDS for arm in ARMS
            if _paths(work, r.name, arm, seed)[1].is_file()]


def signature(store: Path, step: int | None = None) -> dict[str, Any]:
    """The mechanism's signature at a checkpoint (default: the run's last): per layer, the largest per-head
    spectral norm of W_Q,h and of W_Q,h W_K,h^T; with --numerics, per layer, the median cosine of successive
    W_Q gradient errors and the mean tied-maxima rate over the run."""
    from replay.analysis import metrics as M
    from replay.analysis.items import Source
    from replay.analysis.tasks import read_layers
    from replay.store import RunStore

    run = RunStore.open(store)
    cfg = run.manifest.config.model
    step = run.checkpoints()[-1].step if step is None else step
    out: dict[str, Any] = {"step": step, "w_q": [], "w_qk": []}
    for mats in read_layers(Source(run.location, step), range(cfg.n_layer)):
        w = M.weight_metrics(mats, cfg.n_head)
        out["w_q"].append(float(w["spectral_head"][0].max()))
        out["w_qk"].append(float(w["spectral_qk"].max()))
    if run.manifest.config.numerics:
        s = run.read_steps(["wq_err_cos", "tied_rate"])
        out["wq_err_cos"] = [float(x) for x in np.nanmedian(s["wq_err_cos"], axis=0)]
        out["tie_rate"] = [float(x) for x in np.nanmean(s["tied_rate"], axis=0)]
    return out


def render_signatures(work: Path, recipes: list[Recipe]) -> str:
    """The signature table of every recipe whose BF16 and FP32 arms both ran (seed 1)."""
    lines = ["| recipe | arm | step | max spectral norm of W_Q,h per layer | of W_Q,h W_K,h^T | median cos of "
             "successive W_Q grad errors | tie rate |", "|---|---|---|---|---|---|---|"]
    def fmt(xs):
        return ", ".join(f"{x:.3g}" for x in xs) if xs else "–"
    for r in recipes:
        for arm in ARMS:
            store, done = _paths(work, r.name, arm, SEEDS[0])
            if not done.is_file() or not store.exists():
                continue
            sig = signature(store)
            lines.append(f"| {r.name} | {arm} | {sig['step']} | {fmt(sig['w_q'])} | {fmt(sig['w_qk'])} | "
                         f"{fmt(sig.get('wq_err_cos', []))} | {fmt(sig.get('tie_rate', []))} |")
    return "\n".join(lines) + "\n"


def render_growth(work: Path, recipe: str, seed: int) -> str:
    """The signature of every arm of one recipe and seed at each of its checkpoints: does W_Q grow in the
    BF16 arm and not in the others over the same steps?"""
    from replay.store import RunStore

    lines = ["| arm | step | max spectral norm of W_Q,h per layer | of W_Q,h W_K,h^T |", "|---|---|---|---|"]
    def fmt(xs):
        return ", ".join(f"{x:.3g}" for x in xs)
    for arm in ARMS:
        store, done = _paths(work, recipe, arm, seed)
        if not done.is_file() or not store.exists():
            continue
        for ckpt in RunStore.open(store).checkpoints()[1:]:
            sig = signature(store, ckpt.step)
            lines.append(f"| {arm} | {ckpt.step} | {fmt(sig['w_q'])} | {fmt(sig['w_qk'])} |")
    return "\n".join(lines) + "\n"


def hardware() -> str:
    model = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.partition(":")[2].strip()
            break
    return f"{model}, {os.cpu_count()} cores"


def render(outcomes: list[Outcome], recipes: list[Recipe]) -> str:
    by_name = {r.name: r for r in recipes}
    lines = [
        "| recipe | lead | data (samples) | steps | lr | other | arm | seed | outcome | spike steps | detector "
        "fired | final loss (min) | tie rate per layer | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        r = by_name[o.recipe]
        other = ", ".join(f"{k}={v}" for k, v in r.sets.items()) or "–"
        spikes = ", ".join(map(str, o.spikes[:6])) + (" …" if len(o.spikes) > 6 else "") if o.spikes else "–"
        ties = ", ".join(f"{t:.3f}" for t in o.tie_rate) if o.tie_rate else "–"
        loss = f"{o.final_loss:.4f} ({o.min_loss:.4f})" if not o.error else o.error
        lines.append(f"| {r.name} | {r.lead} | {r.data} ({r.samples or 'all'}) | {o.steps or r.steps} | {r.lr:g} | "
                     f"{other} | {o.arm} | {o.seed} | {o.verdict} | {spikes} | {o.detector} | {loss} | {ties} | "
                     f"{o.seconds:.0f} |")
    minutes = sum(o.seconds for o in outcomes) / 60
    return "\n".join(lines) + f"\n\n_{len(outcomes)} runs, {minutes:.0f} min of run time (two at a time) on " \
                              f"{hardware()}, {datetime.date.today().isoformat()}._\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m results.flash_search", description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=Path("runs/flash-search"))
    p.add_argument("--jobs", type=int, default=2, help="runs at once (each takes one core)")
    p.add_argument("--only", nargs="*", help="recipe names (default: all)")
    p.add_argument("--table", type=Path, default=None, help="write the markdown tables here")
    p.add_argument("--done-only", action="store_true", help="run nothing: the tables of the runs already done")
    args = p.parse_args(argv)
    recipes = [r for r in RECIPES if not args.only or r.name in args.only]
    unknown = set(args.only or ()) - {r.name for r in RECIPES}
    if unknown:
        p.error(f"unknown recipe(s): {', '.join(sorted(unknown))}")
    outcomes = done_outcomes(args.work, recipes) if args.done_only else search(args.work, recipes, args.jobs)
    table = render(outcomes, recipes) + "\n" + render_signatures(args.work, recipes)
    if CANDIDATE in {r.name for r in recipes}:
        table += (f"\n{CANDIDATE}, seed {SEEDS[0]}, at every checkpoint:\n\n"
                  + render_growth(args.work, CANDIDATE, SEEDS[0]))
    if args.table:
        args.table.write_text(table)
    print(table)


if __name__ == "__main__":
    main()
