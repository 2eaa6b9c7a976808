"""`replay report`: one self-contained HTML file (PNG plots embedded) telling where a spike comes from.

Everything is read from the store (the run, its replays, the analysis group); nothing is computed
here but plots. The page carries a small script that records, once loaded, how many of its figures
the browser decoded (`data-figures-rendered` on <body>): a check any browser can make of the page.
"""

from __future__ import annotations

import base64
import contextlib
import html
import io
import operator
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from replay import faults
from replay.analysis.localise import WARN_Z, Localisation, localise_store
from replay.analysis.names import HEAD_MATRICES
from replay.analysis.results import read_distances, read_metrics
from replay.bisect.session import Session
from replay.config import Launcher
from replay.errors import disk_errors
from replay.replayer.listing import list_replays
from replay.store import RunStore
from replay.store.location import Location, Where
from replay.store.overrides import Reached
from replay.store.step_diff import HeadDiff, StepDiff
from replay.store.verification import Verification


def _figure(draw, width: float = 9.0, height: float = 3.2) -> str:
    """Render `draw(fig)` to an <img> tag holding the PNG as a data URL."""
    # lazy: matplotlib (0.3 s) only for the report's figures; every command imports this module (cli.py)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(width, height), dpi=100)
    try:
        draw(fig)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
    finally:
        plt.close(fig)
    data = base64.b64encode(buf.getvalue()).decode()
    return f'<img class="figure" alt="figure" src="data:image/png;base64,{data}">'


def _mark_spikes(ax, spikes: list[int]) -> None:
    for i, s in enumerate(spikes):
        ax.axvline(s, color="red", alpha=0.4, lw=1, label="spike" if i == 0 else None)


def _curves(run: RunStore, replays: list[dict[str, Any]], spikes: list[int]) -> str:
    series = run.manifest.series
    if series is not None:   # checkpoints replay did not record: the training losses they say, if any
        logged = np.array(series.losses, dtype=float).reshape(-1, 2)
        steps = {"step": logged[:, 0], "loss": logged[:, 1], "grad_norm": np.full(len(logged), np.nan)}
    else:
        steps = run.read_steps(["loss", "grad_norm"])

    def draw(fig):
        ax1, ax2 = fig.subplots(1, 2)
        ax1.plot(steps["step"], steps["loss"], color="black", lw=1, label="run")
        ax2.plot(steps["step"], steps["grad_norm"], color="black", lw=1, label="run")
        for r in replays:
            rep = RunStore.open(run.location / "replays" / r["id"]).read_steps(["loss", "grad_norm"])
            label = f"{r['id']}" + (f" {r['overrides']}" if r["overrides"] else "")
            ax1.plot(rep["step"], rep["loss"], lw=1, alpha=0.8, label=label)
            ax2.plot(rep["step"], rep["grad_norm"], lw=1, alpha=0.8, label=label)
        for ax, name, values in ((ax1, "loss", steps["loss"]), (ax2, "grad norm", steps["grad_norm"])):
            _mark_spikes(ax, spikes)
            if np.any(np.asarray(values) > 0):   # checkpoints replay did not record may log none
                ax.set_yscale("log")
            ax.set_xlabel("step")
            ax.set_title(name)
        ax1.legend(fontsize=6, loc="upper right")

    return _figure(draw, 10, 3.6)


def _heatmaps(table: dict[str, Any], title: str, spikes: list[int]) -> str:
    """Per layer: per-head spectral norms of W_Q and of W_Q,h W_K,h^T over checkpoints."""
    steps = table["step"]
    n_layer, n_head = table["spectral_qk"].shape[1:]
    edges = np.concatenate([steps - 0.5, [steps[-1] + 0.5]]) if len(steps) < 2 else \
        np.concatenate([[steps[0] - (steps[1] - steps[0]) / 2], (steps[1:] + steps[:-1]) / 2,
                        [steps[-1] + (steps[-1] - steps[-2]) / 2]])

    def draw(fig):
        axes = np.atleast_2d(fig.subplots(n_layer, 2, squeeze=False))
        for layer in range(n_layer):
            for j, (name, values) in enumerate((
                    ("W_Q per head", table["spectral_head"][:, layer, HEAD_MATRICES.index("q")]),
                    ("W_Q,h W_K,h^T per head", table["spectral_qk"][:, layer]))):
                ax = axes[layer, j]
                mesh = ax.pcolormesh(edges, np.arange(n_head + 1) - 0.5, values.T, shading="flat", cmap="viridis")
                fig.colorbar(mesh, ax=ax, pad=0.01)
                for s in spikes:
                    if edges[0] <= s <= edges[-1]:
                        ax.axvline(s, color="red", lw=1)
                ax.set_title(f"layer {layer}: {name}", fontsize=8)
                ax.set_ylabel("head", fontsize=7)
                ax.set_yticks(range(0, n_head, max(1, n_head // 6)))
                ax.tick_params(labelsize=6)
        for ax in axes[-1]:
            ax.set_xlabel("step", fontsize=7)
        fig.suptitle(title, fontsize=9)

    return _figure(draw, 10, 1.6 + 1.7 * n_layer)


_HEAD_QUANTITIES = (("s", "S"), ("p", "P"), ("o", "O"), ("do", "dO"), ("dq", "dQ"), ("dk", "dK"), ("dv", "dV"),
                    ("delta", "delta = rowsum(dO * O)"))


def _diff_html(name: str, result: StepDiff) -> str:
    """A saved `replay diff`: its two sides, how many tensors differ and the first that does."""
    if result.other is not None:
        changes = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in (result.changes or {}).items())
        sides = f"A = this run as it ran, B = {result.other} as it ran ({changes or 'the same config'})"
    elif result.against is not None:
        sides = f"A = the trace {result.against['trace']!r} (taken on {result.against['machine']}), B = this run"
    else:
        sides = f"A = as the store ran it, B = with {result.overrides or 'nothing changed'}"
    first = result.first
    if first is None:
        said = "no difference: every tensor of the step is the same bit for bit"
    else:
        v = first.deviation
        said = (f"first difference: {first.phase} {first.where} {first.what} {first.shape} {first.dtype}"
                + (f", max abs {v.max_abs:.3e}, relative {v.relative:.3e}, {v.ulps:.0f} ulps" if v else ""))
    return (f"<h3>{html.escape(name)}: step {result.step}, {result.whose}</h3>"
            f"<p>{html.escape(sides)}. {result.compared} tensors compared in execution order, "
            f"{len(result.differences)} differ; {html.escape(said)}.</p>")


def _diff_heatmaps(result: StepDiff) -> str:
    """Per layer and head: the largest deviation of each attention quantity over the step's calls (log10; a
    head whose quantity is the same bit for bit is left blank), delta's error sign bias and W_Q's gradient
    error alignment."""
    n_layer = max(h.layer for h in result.heads) + 1
    n_head = max(h.head for h in result.heads) + 1

    def grid(value: Callable[[HeadDiff], float]) -> np.ndarray:
        g = np.full((n_layer, n_head), np.nan)
        for h in result.heads:
            g[h.layer, h.head] = value(h)
        return g

    panels: list[tuple[str, Any, str, float | None, float | None]] = []
    for key, label in _HEAD_QUANTITIES:
        g = grid(operator.attrgetter(key))
        with np.errstate(invalid="ignore", divide="ignore"):   # a head without a call (NaN), or one alike (0)
            logged = np.log10(np.where(g > 0, g, np.nan))
        panels.append((f"log10 max |B - A|: {label}", np.ma.masked_invalid(logged), "viridis", None, None))
    panels.append(("sign bias of delta's error", np.ma.masked_invalid(grid(lambda h: h.delta_sign_bias)), "RdBu_r",
                   -1.0, 1.0))
    panels.append(("W_Q gradient error alignment", np.ma.masked_invalid(grid(lambda h: h.wq_alignment)), "magma",
                   0.0, 1.0))

    def draw(fig):
        axes = fig.subplots(2, 5).reshape(-1)
        for ax, (title, values, cmap, lo, hi) in zip(axes, panels, strict=True):
            mesh = ax.pcolormesh(np.arange(n_head + 1) - 0.5, np.arange(n_layer + 1) - 0.5, values, cmap=cmap,
                                 vmin=lo, vmax=hi, shading="flat")
            fig.colorbar(mesh, ax=ax, pad=0.01)
            ax.set_title(title, fontsize=8)
            ax.set_xlabel("head", fontsize=7)
            ax.set_ylabel("layer", fontsize=7)
            ax.set_xticks(range(0, n_head, max(1, n_head // 6)))
            ax.set_yticks(range(0, n_layer, max(1, n_layer // 6)))
            ax.tick_params(labelsize=6)

    return _figure(draw, 15, 1.2 + 2.6 * max(1.0, min(n_layer, 12) / 4))


def _distance_plot(tables: dict[str, dict[str, Any]], spikes: list[int]) -> str:
    def draw(fig):
        ax1, ax2 = fig.subplots(1, 2)
        for name, t in tables.items():
            if len(t["step"]):
                ax1.plot(t["step"], t["max_abs"].max(axis=1), marker=".", label=name)
                ax2.plot(t["step"], t["wasserstein"].max(axis=1), marker=".", label=name)
        for ax, title in ((ax1, "max |difference| (largest tensor)"), (ax2, "Wasserstein-1 (largest tensor)")):
            _mark_spikes(ax, spikes)
            ax.set_yscale("symlog", linthresh=1e-9)
            ax.set_xlabel("step")
            ax.set_title(title, fontsize=9)
        ax1.legend(fontsize=6)

    return _figure(draw, 10, 3.4)


def _ranking_html(found: Localisation, top: int) -> str:
    rows = []
    for title, ranking in (("head", found.heads), ("layer", found.layers)):
        for a in ranking[:top]:
            rows.append(f"<tr><td>{title}</td><td>{html.escape(a.unit)}</td><td>{a.score:.1f}</td>"
                        f"<td>{html.escape(a.signal)}</td><td>{a.value:.4g}</td><td>{a.baseline:.4g}</td></tr>")
    where = "the run's checkpoints" if found.trajectory == "run" else \
        f"replay {html.escape(found.trajectory)} (bit for bit the record, checkpointed more densely)"
    return (f"<p>Spike at step <b>{found.spike}</b>: checkpoint {found.checkpoint} against {len(found.history)} "
            f"earlier checkpoints ({found.history[0]}..{found.history[-1]}) of {where}.</p>"
            "<table class='ranking'><tr><th>unit</th><th>name</th><th>robust z</th><th>signal</th>"
            "<th>value</th><th>median before</th></tr>" + "".join(rows) + "</table>" + _leads_html(found, top))


def _leads_html(found: Localisation, top: int) -> str:
    if not found.leads:
        return (f"<p>Early warnings: no signal stayed {WARN_Z:g} robust z-scores away from its own history up to "
                "the spike.</p>")
    rows = "".join(f"<tr><td>{html.escape(w.unit)}</td><td>{html.escape(w.signal)}</td><td>{w.lead}</td>"
                   f"<td>{w.since}</td><td>{w.z:.1f}</td></tr>" for w in found.leads[:top])
    return (f"<p>Early warnings: {len(found.leads)} signal(s) left their own history and stayed out (|z| &ge; "
            f"{WARN_Z:g}) until the spike; the longest leads first.</p><table class='leads'><tr><th>unit</th>"
            "<th>signal</th><th>lead (steps)</th><th>since checkpoint</th><th>z at the last</th></tr>"
            + rows + "</table>")


def _bisect_html(session: Session) -> str:
    e = html.escape
    rows = [("status", session.status), ("spike", session.params["spike"]), ("narrowed by", session.params["by"]),
            ("rule", session.rule), *(session.verdict.rows() if session.verdict else [])]
    table = "".join(f"<tr><th>{e(str(k))}</th><td>{e(str(x))}</td></tr>" for k, x in rows)
    probe_rows = "".join(
        f"<tr><td>{e(q.phase)}</td><td>{e(key)}</td><td>{q.window[0]}..{q.window[1]}</td>"
        f"<td>{e(q.overrides.as_args() or '-')}</td>"
        f"<td>{'prevents' if q.prevented else 'spike at ' + str(q.spike_at)}</td></tr>"
        for key, q in session.probes.items())
    return (f"<h3>Session {e(session.id)}</h3><table>{table}</table>"
            "<details><summary>every probe</summary><table><tr><th>phase</th><th>replay</th><th>window</th>"
            f"<th>overrides</th><th>verdict</th></tr>{probe_rows}</table></details>")


def _probe_plot(run: RunStore, session: Session) -> str:
    """The record's loss around the spike, with every probe: green where it prevents the spike, red where not."""
    spike = session.params["spike"]
    steps = run.read_steps(["loss"])

    def draw(fig):
        ax = fig.subplots()
        lo = min(q.window[0] for q in session.probes.values())
        hi = max(q.window[1] for q in session.probes.values())
        keep = (steps["step"] >= lo) & (steps["step"] <= hi)
        for q_id, q in session.probes.items():
            rep = RunStore.open(run.location / "replays" / q_id).read_steps(["loss"])
            ax.plot(rep["step"], rep["loss"], lw=0.8, alpha=0.5, color="tab:green" if q.prevented else "tab:red")
        ax.plot(steps["step"][keep], steps["loss"][keep], color="black", lw=1.5, label="record")
        ax.plot([], [], color="tab:green", label="probe: prevents")
        ax.plot([], [], color="tab:red", label="probe: spikes")
        _mark_spikes(ax, [spike])
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(f"bisect probes around the spike at step {spike}", fontsize=9)
        ax.legend(fontsize=7)

    return _figure(draw, 10, 3.2)


_STYLE = """body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}
img.figure{max-width:100%;display:block;margin:1em 0}code{background:#f3f3f3;padding:0 3px}"""

_CHECK = """<script>window.addEventListener('load',function(){var n=0;
document.querySelectorAll('img.figure').forEach(function(i){if(i.complete&&i.naturalWidth>0)n++;});
document.body.setAttribute('data-figures-rendered',String(n));});</script>"""


def write_report(store_path: Where, out: str | Path | None = None, top: int = 10,
                 warn: Callable[[str], None] = lambda m: None) -> Path:
    """The report, as one HTML file: `out`, or the store's report.html (a store on an object store: the
    store's name with -report.html, in the current directory)."""
    store_path = Location.parse(store_path)
    run = RunStore.open(store_path)
    local = store_path.local
    out = Path(out) if out else local / "report.html" if local else Path(f"{store_path.name}-report.html")
    m = run.manifest
    cfg = m.config
    spikes = [int(e["step"]) for e in run.spikes]
    sessions = [Session.from_dict(doc) for doc in run.bisect_sessions()]
    probes = {key for b in sessions for key in b.probes}
    listed = list_replays(store_path)
    unreadable = [r for r in listed if "error" in r]
    for r in unreadable:
        warn(f"replay {r['id']} cannot be read and is left out of the report: {r['error']}")
    replays = [r for r in listed if "error" not in r and r["id"] not in probes]   # probes: in the bisect section
    table = read_metrics(store_path)
    found = localise_store(store_path)
    figures = []
    own = m.launcher is Launcher.CUSTOM and m.model is None   # a model of the user's own: its attention is its own
    attention = ("its own (replay's overrides reach its SDPA calls)" if own
                 else f"<code>{html.escape(cfg.model.attention)}</code>")
    autocast = f" (autocast {m.environment['autocast']})" if m.environment.get("autocast") else ""
    what = (f"{cfg.preset} preset: {cfg.model.n_layer} layers, {cfg.model.n_head} heads, d={cfg.model.n_embd}, "
            f"{cfg.precision}{autocast}, attention {attention}, {m.world_size} ranks "
            f"({m.launcher}); {run.n_steps} steps recorded" if m.series is None else
            f"{m.series.format} checkpoints replay did not record, at "
            f"{html.escape(str(store_path.resolve(m.series.location)))}: {cfg.model.n_layer} layers, "
            f"{cfg.model.n_head} heads, d={cfg.model.n_embd}; {len(m.series.losses)} training losses logged")
    parts = [f"<h1>replay report: {html.escape(str(store_path))}</h1>",
             f"<p>{what}; spikes at {spikes or 'none'}. Generated {time.strftime('%Y-%m-%d %H:%M:%S')}.</p>",
             *[f"<p class=warning>Replay {html.escape(r['id'])} cannot be read and is left out: "
               f"{html.escape(r['error'])}</p>" for r in unreadable],
             "<h2>Loss and grad norm</h2><p>The run in black, its replays overlaid (with their overrides); "
             "red lines mark detected spikes.</p>"]
    figures.append(_curves(run, replays, spikes))
    parts.append(figures[-1])

    parts.append("<h2>Bisect</h2>")
    if not sessions:
        parts.append("<p>No bisect yet: run <code>replay bisect</code> on this store.</p>")
    for session in sessions:
        parts.append(_bisect_html(session))
        if session.probes:
            figures.append(_probe_plot(run, session))
            parts.append(figures[-1])

    parts.append("<h2>Operation by operation</h2>")
    saved = run.diffs()
    if not saved:
        parts.append("<p>No saved diff yet: <code>replay diff STORE --step N ... --save NAME</code> keeps one here "
                     "(where one step, run twice from its checkpoint, first parts).</p>")
    for name, doc in saved.items():
        result = StepDiff.from_dict(doc)
        parts.append(_diff_html(name, result))
        if result.heads and result.first is not None:
            parts.append("<p>Per layer and head, over the step's attention calls: each quantity's largest deviation "
                         "(blank: the same bit for bit, or S and P where a side's backend does not hand them out), "
                         "the mean sign of delta's error (Qiu &amp; Yao's biased rounding has one sign) and how "
                         "aligned the tokens' terms of W_Q's gradient error are.</p>")
            figures.append(_diff_heatmaps(result))
            parts.append(figures[-1])

    parts.append("<h2>Localisation</h2>")
    if table is None:
        parts.append("<p>No analysis yet: run <code>replay analyze</code> on this store.</p>")
    elif not found:
        parts.append("<p>No spike was recorded.</p>")
    for f in found:
        parts.append(_ranking_html(f, top) if f.found else
                     f"<p>Spike at step {f.spike}: too few analysed checkpoints before it.</p>")
    parts.append("<p>Rule: each signal's last value before the spike against its own history, "
                 "z = (x - median) / max(1.4826 MAD, 1% of |median|); a unit's score is its largest |z|.</p>")

    if table is not None and len(table["step"]):
        parts.append("<h2>Per-head spectral norms</h2>")
        figures.append(_heatmaps(table, "run checkpoints", spikes))
        parts.append(figures[-1])
        for f in found:
            if f.found and f.trajectory != "run":
                dense = read_metrics(store_path / "replays" / f.trajectory)
                assert dense is not None, "a localisation's trajectory is analysed"
                figures.append(_heatmaps(dense, f"replay {f.trajectory} (bit for bit the record)", spikes))
                parts.append(figures[-1])

    distances = {f"{r['id']} vs run": d for r in replays
                 for d in [read_distances(store_path / "replays" / r["id"]).get("parent")] if d is not None}
    distances.update({name: t for name, t in read_distances(store_path).items()})
    parts.append("<h2>Weight distances</h2>")
    if distances:
        parts.append("<p>Each replay against the run at matching checkpoints, and every <code>replay compare</code> "
                     "stored here; per step, the largest value over the model's tensors.</p>")
        figures.append(_distance_plot(distances, spikes))
        parts.append(figures[-1])
    else:
        parts.append("<p>No weight distances yet (replays with checkpoints at the run's steps, or "
                     "<code>replay compare</code>).</p>")

    if replays:
        parts.append("<h2>Replays</h2><table><tr><th>id</th><th>window</th><th>overrides</th><th>reached (the "
                     "attention path taken)</th><th>outcome</th><th>verification</th></tr>")
        for r in replays:
            v = Verification.from_dict(r["verification"]) if r["verification"] else None
            verdict = "-" if v is None else html.escape(v.describe())
            reached = Reached.from_dict(r["reached"]) if r.get("reached") else None
            taken = "-" if reached is None else html.escape(
                "; ".join([reached.describe(), *(p.describe() for p in reached.path)]))
            parts.append(f"<tr><td>{html.escape(r['id'])}</td><td>{r['window']['from']}..{r['window']['to']}</td>"
                         f"<td>{html.escape(str(r['overrides'] or '-'))}</td><td>{taken}</td>"
                         f"<td>{html.escape(r['outcome'])}</td><td>{verdict}</td></tr>")
        parts.append("</table>")
    page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>replay report</title><style>{_STYLE}</style>"
            f"</head><body data-figures='{len(figures)}'>" + "\n".join(parts) + _CHECK + "</body></html>")
    _write_page(out, page)
    return out


def _write_page(out: Path, page: str) -> None:
    """`out` replaced whole or not at all: the page goes to a temporary file beside it, renamed over it; a
    failed write removes it (a killed one leaves it, to be written over by the next report)."""
    tmp = out.with_name(out.name + ".tmp")
    try:
        with disk_errors(f"the report {out}", out.parent, elsewhere="write it elsewhere with -o FILE"):
            tmp.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(page)
            faults.hit("report-written")
            tmp.replace(out)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
