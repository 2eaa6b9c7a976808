"""Item 3: Qiu & Yao's mechanism, in isolation (the microbenchmark's tied-maxima bias) and inside a tiny
BF16 training run with the `reference` placement (`replay record --numerics`), against replays of the
same run with an FP32 delta (`--hp-delta`) and with the safe-softmax fix."""

from __future__ import annotations

import csv
import json

import numpy as np

from results.common import Context, Section, cli, cli_parallel, command_line, complete_store, save_figure, table

TITLE = "Qiu & Yao: the tied-maxima mechanism"
VARIANTS = (("recorded", None, "reference placement (recorded)"),
            ("hp-delta", "--hp-delta", "replay with `--hp-delta`"),
            ("fix", "--fix safe-softmax", "replay with `--fix safe-softmax` (beta 7)"))


def mechanism(ctx: Context) -> Section:
    steps, trials = (12, 500) if ctx.quick else (1000, 20000)
    commands: list[str] = []
    body = [_bias_tables(ctx, trials, commands)]

    store = ctx.work / "mechanism"
    record = ["record", "--store", store, "--steps", steps, "--checkpoint-every", steps // 4, "--precision", "bf16",
              "--attention", "reference-emu", "--numerics", "--set", "threads=1"]
    if not complete_store(ctx, store):   # a finished store of an earlier run is reused
        cli(ctx, *record)
    commands.append(command_line(*record))
    paths = {"recorded": store}
    for name, flags, _ in VARIANTS[1:]:
        cli(ctx, "run", str(store), "--from", "0", "--to", str(steps - 1), "--name", name, *flags.split(),
            commands=commands)
        paths[name] = store / "replays" / name
    found = cli_parallel(ctx, [["info", path, "--json"] for path in paths.values()], len(paths), as_json=True,
                         commands=commands)
    infos = dict(zip(paths, found, strict=True))
    for name, info in infos.items():
        (ctx.work / f"mechanism-info-{name}.json").write_text(json.dumps(info, indent=1))
    body.append(_training_table(infos, steps))
    body.append(_plot_training(ctx, paths, steps))
    body.append(_training_sentence(infos))
    return Section(TITLE, "\n\n".join(body), commands)


def _bias_tables(ctx: Context, trials: int, commands: list[str]) -> str:
    out = ctx.work / "microbench"
    cli(ctx, "microbench", "--mode", "mechanism", "--trials", str(trials), "-o", str(out), commands=commands)
    with open(out / "mechanism" / "mechanism.csv") as f:
        rows = {(r["kernel"], int(r["n_tied"]), r["fix_beta"]): r for r in csv.DictReader(f)}
    cases = [("baseline", "")] + [(k, b) for k in ("reference-emu", "fa2-emu") for b in ("", "2", "7")]
    parts = []
    for key, label in (("o_rel", "O"), ("delta_rel", "delta = rowsum(dO * O)")):
        header = ["n tied"] + [f"`{k}`" + ("" if k == "baseline" else " no fix" if b == "" else f" beta {b}")
                               for k, b in cases]
        lines = []
        for n in sorted({n for _, n, _ in rows}):
            cells = [rows[(k, n, b)] for k, b in cases]
            lines.append([str(n)] + [f"{float(r[key + '_mean']):+.2e} ± {float(r[key + '_ci95']):.0e}"
                                     if r["status"] == "ok" else "refused" for r in cells])
        parts.append(f"Mean signed relative error of {label} (± 95% CI), {trials} BF16 rows per cell:\n\n"
                     + table(header, lines))
    parts.append(_bias_sentence(rows))
    return "\n\n".join(parts)


def _bias_sentence(rows: dict) -> str:
    def mean(kernel, n, beta):
        return float(rows[(kernel, n, beta)]["o_rel_mean"])
    def ci(kernel, n, beta):
        return float(rows[(kernel, n, beta)]["o_rel_ci95"])
    ref, fixed, fa2 = mean("reference-emu", 2, ""), mean("reference-emu", 2, "7"), mean("fa2-emu", 2, "")
    flips = [n for n in sorted({n for _, n, _ in rows}) if n > 1
             and mean("reference-emu", n, "7") * mean("reference-emu", n, "") < 0
             and abs(mean("reference-emu", n, "7")) > ci("reference-emu", n, "7")]
    return (f"**Against the paper.** Rows with two tied maxima and a V of one sign give the `reference` placement "
            f"a {'negative' if ref < 0 else 'positive'} bias of {ref:+.2e} in O "
            f"({'its CI excludes 0' if abs(ref) > ci('reference-emu', 2, '') else 'its CI includes 0'}); the fix "
            f"(beta 7) makes it {abs(ref / fixed):.0f}x smaller ({fixed:+.2e}). That is Qiu & Yao's mechanism; "
            ""
            + (f"At n = {', '.join(map(str, flips))} the fix flips the sign instead of removing the bias: a BF16 "
               "row sum of those Pbar values meets rounding ties of its own. " if flips else "")
            + f"With CUDA FA2's placement (`fa2-emu`, FP32 accumulators) the bias is {fa2:+.2e}, and BF16 "
            f"*baseline* attention shows {mean('baseline', 2, ''):+.2e}: in this toy the bias belongs to BF16 "
            "softmax-times-V, not to tiling.")


COLUMNS = (("tied_rate_mean", ".4f"), ("delta_err_sum", "+.3e"), ("delta_err_tied_mean", "+.2e"),
           ("wq_err_cos_median", "+.3f"), ("wq_tied_err_cos_median", "+.3f"))


def _number(x: float, spec: str) -> str:
    return "n/a" if np.isnan(x) else format(x, spec)


def _training_table(infos: dict, steps: int) -> str:
    header = ["run", "layer", "tied-maxima rate", "sum of delta error", "mean delta error, tied rows",
              "median cos, W_Q error", "median cos, tied rows' part", "final loss"]
    lines = []
    for name, _, label in VARIANTS:
        n, loss = infos[name]["numerics"], infos[name]["last_loss"]
        for layer in range(len(n["tied_rate_mean"])):
            cells = [_number(n[key][layer], spec) for key, spec in COLUMNS]
            lines.append([label, str(layer), *cells, f"{loss:.4f}"])
    return (f"Over the {steps} steps of the tiny preset (2 layers x 2 heads x 64, seq 64, batch 8, AdamW lr 1e-3), "
            "per layer, as `replay info --json` prints them (`numerics`):\n\n" + table(header, lines))


def _plot_training(ctx: Context, paths: dict, steps: int) -> str:
    from matplotlib.figure import Figure

    from replay.store import RunStore

    fig = Figure(figsize=(15, 4), layout="constrained")
    axes = fig.subplots(1, 3)
    colors = {"recorded": "tab:red", "hp-delta": "tab:blue", "fix": "tab:green"}
    window = max(1, steps // 40)
    def smooth(a):
        return np.convolve(np.nan_to_num(a), np.ones(window) / window, mode="valid")
    for name, _, label in VARIANTS:
        s = RunStore.open(paths[name]).read_steps(["tied_rate", "delta_err", "wq_tied_err_cos"])
        for layer in range(s["tied_rate"].shape[1]):
            style = dict(color=colors[name], ls="-" if layer == 0 else "--", label=f"{label}, layer {layer}")
            axes[0].plot(smooth(s["tied_rate"][:, layer]), **style)
            axes[1].plot(np.cumsum(s["delta_err"][:, layer]), **style)
            axes[2].plot(smooth(s["wq_tied_err_cos"][:, layer]), **style)
    titles = ["tied-maxima rate (running mean)", "running sum of delta_lp - delta_hp",
              "cos of successive W_Q gradient errors\n(tied rows' part, running mean)"]
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[0].legend(fontsize=7)
    return save_figure(fig, ctx, "results-qiu-yao-training.png")


def _training_sentence(infos: dict) -> str:
    rec, hp, fix = (infos[n]["numerics"] for n in ("recorded", "hp-delta", "fix"))
    cos = rec["wq_tied_err_cos_median"]
    low_rank = all(abs(c) < 0.3 for c in cos)
    spikes = {name: len(info["spikes"]) for name, info in infos.items()}
    calm = not any(spikes.values()) and all(np.isfinite(info["last_loss"]) for info in infos.values())
    return (
        "**Against the paper.** With the `reference` placement, "
        f"{', '.join(f'{r:.1%}' for r in rec['tied_rate_mean'])} of the attended rows (layers 0, 1) have tied BF16 "
        f"maxima, and delta's error sums to {', '.join(f'{s:+.2e}' for s in rec['delta_err_sum'])} over the run; "
        f"with `--hp-delta` it is {', '.join(f'{s:+.1e}' for s in hp['delta_err_sum'])} (delta from an FP32 O), "
        f"with the fix {', '.join(f'{s:+.2e}' for s in fix['delta_err_sum'])}. "
        + ("Successive W_Q gradient errors are nearly uncorrelated here (median cosine "
           f"{', '.join(f'{c:+.2f}' for c in cos)}): the low-rank accumulation that Qiu & Yao report before "
           "GPT-2 small fails does **not** appear in this tiny model over this many steps"
           + (", and no run spiked or diverged." if calm else f" (spikes detected: {spikes}).")
           if low_rank else
           f"Successive W_Q gradient errors from tied rows are correlated (median cosine "
           f"{', '.join(f'{c:+.2f}' for c in cos)}), the low-rank accumulation signature Qiu & Yao report."))
