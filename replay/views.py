"""Read-only views of a run store for people: `replay info` and `replay batch`. They sit above everything
they show (the store, the replays, the bisect sessions, the analysis)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import numpy as np

from replay.analysis.results import analysis_status
from replay.bisect.session import Session
from replay.config import Launcher
from replay.errors import UsageError
from replay.replayer.listing import list_replays
from replay.store import RunStore
from replay.store.capabilities import Capabilities
from replay.store.lease import holder_of
from replay.store.location import Location, Where
from replay.store.overrides import Reached
from replay.store.run_store import micro_batches
from replay.store.step_diff import Difference, StepDiff
from replay.store.verification import STATE, Divergence
from replay.train.data import load_data


def summarize(path: Where) -> dict[str, Any]:
    """Everything `replay info` shows, as plain data (its --json)."""
    path = Location.parse(path)
    store = RunStore.open(path)
    m = store.manifest
    cfg = m.config
    writer = holder_of(path)
    steps = store.read_steps(["loss"])
    data = m.data
    return {
        "path": str(path),
        "kind": m.kind,
        "series": dataclasses.asdict(m.series) if m.series else None,
        "status": m.status,
        "schema": m.schema,
        "config": cfg.to_dict(),
        "world_size": m.world_size,
        "placement": dataclasses.asdict(m.placement) if m.placement else None,
        "launcher": m.launcher.value,
        "grad_accum": cfg.grad_accum,
        "command": dataclasses.asdict(m.command) if m.command else None,
        "layout": m.layout,
        "data": (f"{data.source or 'built-in'}, {data.bytes} bytes embedded" if data.embedded
                 else f"{data.source} (not in the store)" if data.method == "none"
                 else f"{data.path or data.source} ({data.bytes} bytes)")
        + (f", {data.method} {data.digest[:12]}" if data.digest else ""),
        "data_fingerprint": vars(data),
        "environment": m.environment,
        "steps_recorded": store.n_steps,
        "first_loss": float(steps["loss"][0]) if store.n_steps else None,
        "last_loss": float(steps["loss"][-1]) if store.n_steps else None,
        "checkpoints": [{"step": c.step, "kind": c.kind, "world_size": c.world_size} for c in store.checkpoints()],
        "uncommitted_checkpoints": store.uncommitted_checkpoints(),
        "damaged_checkpoints": [{"step": step, "error": why} for step, why in store.damaged_checkpoints()],
        "spikes": store.spikes,
        "replays": list_replays(path),
        "resumes": [vars(r) for r in m.resumes],
        "writer": writer.describe() if writer else None,
        "bisect": [_session(Session.from_dict(doc), writer) for doc in store.bisect_sessions()],
        "numerics": _numerics(store) if cfg.numerics else None,
        "analysis": analysis_status(path),
    }


def _session(session: Session, writer) -> dict[str, Any]:
    # A session marked running while no bisect holds the store was killed (SIGKILL leaves no trace).
    running = session.status == "running" and writer is not None and writer.command == "replay bisect"
    status = ("interrupted (run the same bisect again to resume it)" if session.status == "running" and not running
              else session.status)
    return {"id": session.id, "status": status, "params": session.params, "probes": sorted(session.probes),
            "verdict": session.verdict.to_dict() if session.verdict else None,
            "answer": session.verdict.line() if session.verdict else None}


def _numerics(store: RunStore) -> dict[str, list[float]] | None:
    """Per layer, over the recorded steps (replay/kernels/numerics.py says what each is)."""
    if not store.n_steps:
        return None
    s = store.read_steps(["tied_rate", "delta_err", "delta_err_tied", "wq_err_cos", "wq_tied_err_cos"])
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # all-NaN columns (a layer without ties) give NaN
        out = {"tied_rate_mean": np.nanmean(s["tied_rate"], axis=0),
               "delta_err_sum": np.nansum(s["delta_err"], axis=0),
               "delta_err_tied_mean": np.nanmean(s["delta_err_tied"], axis=0),
               "wq_err_cos_median": np.nanmedian(s["wq_err_cos"], axis=0),
               "wq_tied_err_cos_median": np.nanmedian(s["wq_tied_err_cos"], axis=0)}
    return {k: [float(x) for x in v] for k, v in out.items()}


def _verdict(v: dict[str, Any] | None) -> str:
    """A replay's verification, in a few words (its level: the state, or the scalars only)."""
    if not v:
        return ""
    level = "" if v.get("level") == STATE else ", scalars only"
    if v["bitwise"]:
        return f", bit for bit ({'state and scalars' if not level else 'scalars only'})"
    d = Divergence.from_dict(v["divergence"])
    return f", diverges at step {d.step} ({'the state' if d.first == 'state' else d.first} first{level})"


def info_lines(summary: dict[str, Any]) -> list[str]:
    """`replay info` in words."""
    cfg, ck = summary["config"], summary["checkpoints"]
    m = cfg["model"]
    if summary["series"]:
        return _series_lines(summary)
    lines = [f"run store   {summary['path']}  ({summary['status']})"]
    if summary["writer"]:
        lines.append(f"writer      {summary['writer']} is writing it now")
    if summary["schema"] < 2:
        lines.append(f"schema      {summary['schema']}, written by an older replay: read, replayed and analysed as "
                     "before; its run cannot be continued")
    command = summary["command"]
    if command:   # a script of the user's own: what replay knows of it is its command
        lines.append(f"command     {command['launcher']} x {command['world_size']}: python {' '.join(command['argv'])}"
                     f"  (in {command['cwd']}; {len(command['files'])} file(s) hashed)")
        autocast = (summary["environment"] or {}).get("autocast")
        lines.append(f"model       {m['n_layer']} attention layers x {m['n_head']} heads, {cfg['precision']}"
                     + (f" (its first forward ran under autocast {autocast})" if autocast else "")
                     + f", layout {(summary['layout'] or {}).get('name', 'none')}")
    else:
        lines.append(f"config      preset {cfg['preset']}, {m['n_layer']} layers x {m['n_head']} heads x "
                     f"{m['n_embd']}, seq {m['block_size']}, {cfg['precision']}, attention {m['attention']}, "
                     f"seed {cfg['seed']}")
        lines.append(f"ranks       {summary['world_size']} ({summary['launcher']}"
                     f"{', ZeRO-' + str(cfg['zero_stage']) if summary['launcher'] == Launcher.DEEPSPEED else ''}), "
                     f"batch {cfg['batch_size']} = {cfg['micro_batch_size']} x {summary['world_size']} ranks x "
                     f"{summary['grad_accum']} accumulation")
    placement = summary["placement"]
    if placement and len(placement["nodes"]) > 1:
        lines.append(f"nodes       {len(placement['nodes'])}: " + "; ".join(
            f"{name} (rank(s) {', '.join(str(r) for r, n in enumerate(placement['rank_nodes']) if n == node)})"
            for node, name in enumerate(placement["nodes"])))
    lines.append(f"data        {summary['data']}")
    lines.append(f"steps       {summary['steps_recorded']} of {cfg['steps']} recorded"
                 + (f"; loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}"
                    if summary['steps_recorded'] else ""))
    kinds = ", ".join(f"{c['step']}{'' if c['kind'] == 'regular' else ' (' + c['kind'] + ')'}" for c in ck)
    lines.append(f"checkpoints {len(ck)} committed: {kinds or 'none'}")
    if summary["uncommitted_checkpoints"]:
        lines.append(f"            {len(summary['uncommitted_checkpoints'])} uncommitted (ignored): "
                     f"{', '.join(map(str, summary['uncommitted_checkpoints']))}")
    lines += [f"            damaged: {d['error']}" for d in summary["damaged_checkpoints"]]
    lines += _spike_lines(summary["spikes"])
    probes = {key for b in summary["bisect"] for key in b["probes"]}
    shown = [r for r in summary["replays"] if r["id"] not in probes and "error" not in r]
    lines.append(f"replays     {len(summary['replays'])}"
                 + (f" ({len(summary['replays']) - len(shown)} of them bisect probes, not listed)" if probes else ""))
    for r in shown:
        v = r["verification"]
        lines.append(f"            {r['id']}: steps {r['window']['from']}..{r['window']['to']} from checkpoint "
                     f"{r['start_checkpoint']}, {r['status']}, {r['outcome']}"
                     + (f", overrides {r['overrides']}" if r["overrides"] else "")
                     + _verdict(v))
        if r.get("reached"):
            reached = Reached.from_dict(r["reached"])
            lines.append(f"              reached: {reached.describe()}")
            if reached.path:
                lines.append("              attention path (rank 0): "
                             + "; ".join(p.describe() for p in reached.path))
    lines += [f"            {r['id']}: cannot be read: {r['error']}" for r in summary["replays"] if "error" in r]
    if summary["numerics"]:
        n = summary["numerics"]

        def per_layer(key: str, fmt: str) -> str:
            return ", ".join(format(v, fmt) for v in n[key])

        lines.append(f"numerics    per layer: tied-maxima rate {per_layer('tied_rate_mean', '.4f')}; sum of delta "
                     f"error {per_layer('delta_err_sum', '+.3e')}; median cosine of successive W_Q gradient errors "
                     f"{per_layer('wq_err_cos_median', '+.3f')} (from tied rows: "
                     f"{per_layer('wq_tied_err_cos_median', '+.3f')})")
    lines.append(f"bisect      {len(summary['bisect'])} session(s)")
    lines += [f"            {b['id']}: {b['status']}, {len(b['probes'])} probes"
              + (f"; {b['answer']}" if b["answer"] else "") for b in summary["bisect"]]
    if summary["resumes"]:
        lines.append(f"resumed     from step {', '.join(str(r['from_step']) for r in summary['resumes'])}")
    analysed = summary["analysis"]["checkpoints"]
    path = summary["path"]
    lines.append(f"analysis    {len(analysed)} checkpoints analysed" + (
        f"; {len(summary['analysis']['distances'])} weight-distance tables (replay report {path})" if analysed
        else f" (replay analyze {path})"))
    return lines


def _spike_lines(spikes: list[dict[str, Any]]) -> list[str]:
    lines = [f"spikes      {len(spikes)}"]
    for e in spikes:
        lines.append(f"            step {e['step']}: given with --spike" if "score" not in e else
                     f"            step {e['step']}: loss {e['loss']:.4f} vs baseline {e['baseline']:.4f} (robust z "
                     f"{e['score']:.1f})" if isinstance(e["score"], (int, float))
                     else f"            step {e['step']}: loss {e['loss']} (non-finite)")
    return lines


def _series_lines(summary: dict[str, Any]) -> list[str]:
    """`replay info` of the analysis of checkpoints replay did not record (analysis/series.py)."""
    s, m = summary["series"], summary["config"]["model"]
    analysed = summary["analysis"]["checkpoints"]
    where = Location.parse(summary["path"]).resolve(s["location"])
    return [f"analysis of {s['format']} checkpoints replay did not record  {summary['path']}",
            f"checkpoints {where}: {m['n_layer']} layers x {m['n_head']} heads x {m['n_embd']}, "
            f"layout {s['layout'].get('name', 'custom')}",
            f"losses      {len(s['losses'])} logged", *_spike_lines(summary["spikes"]),
            f"analysis    {len(analysed)} checkpoints analysed"
            + (f" ({', '.join(map(str, analysed))}); `replay report {summary['path']}` shows them" if analysed
               else "")]


def step_batch(path: Where, step: int, rank: int | None = None) -> list[dict[str, Any]]:
    """The samples of `step` as recorded in `path` (a run, or a replay: its own steps, which start at its
    start checkpoint), with their text where the store can name it."""
    path = Location.parse(path)
    store = RunStore.open(path)
    if not store.first_step <= step < store.end_step:
        held = f"steps {store.first_step}..{store.end_step - 1}" if store.n_steps else "no steps yet"
        raise UsageError(f"step {step} is not recorded in {path}: it holds {held}")
    fields = store.read_steps(["sample_ids", "sample_digest"])
    ids = np.asarray(fields["sample_ids"][step - store.first_step])   # (rank, micro, sample)
    digests = fields["sample_digest"][step - store.first_step] if len(fields["sample_digest"]) else None
    if rank is not None and not 0 <= rank < ids.shape[0]:
        raise UsageError(f"rank {rank} out of range: the run had {ids.shape[0]} ranks")
    m = store.manifest
    run = RunStore.open(path.resolve(m.replay.parent)) if m.replay else store
    data = load_data(m.config, run) if Capabilities.of(m).builtin else None
    rows = []
    for r in range(ids.shape[0]) if rank is None else [rank]:
        trained = micro_batches(ids[r])   # a smaller last batch of an epoch is padded with -1 in the store
        fed = micro_batches(ids[r], digests[r]) if digests is not None else None   # a stream's, by sample
        for micro, batch in enumerate(trained if trained else list(ids[r])):   # none: a step a replay skipped
            for i, sid in enumerate(batch):
                text = ("(skipped: this step was not trained on)" if sid < 0 else
                        f"(a stream's sample: number {sid} of rank {r}'s stream, CRC-32C "
                        f"{int(fed[micro][i]):08x}; the data is the script's, not in the store)"
                        if fed is not None else
                        "(the data of a training loop of your own is not in the store)" if data is None else
                        data.describe(int(sid)))
                rows.append({"step": step, "rank": r, "micro": micro, "sample_id": int(sid), "text": text})
    return rows


def sample_lines(row: dict[str, Any]) -> list[str]:
    """One sample as `replay batch` prints it."""
    return [f"--- step {row['step']}  rank {row['rank']}  micro-batch {row['micro']}  sample {row['sample_id']}",
            row["text"]]


def diff_lines(result: StepDiff, top: int = 8) -> list[str]:
    """What `replay diff` prints: the first difference, the largest ones after it, and the attention heads."""
    changed = f"with {result.overrides}" if result.overrides else "as the store ran it"
    if result.against is not None:
        a = result.against
        sides = (f"A = the trace {a['trace']!r} (taken on {a['machine']}"
                 + (f", with {a['overrides']}" if a["overrides"] else "") + f"), B = this process, {changed}")
    elif result.other is not None:
        changes = "; ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in (result.changes or {}).items())
        sides = (f"A = as it ran, B = {result.other} as it ran, from the state and samples they share ("
                 + (f"B's config differs in {changes})" if changes else "their configs are the same)"))
    else:
        sides = (f"A = as the store ran it, B = {changed}" if result.overrides else
                 "A and B = as the store ran it, twice")
    lines = [f"diff {result.store} step {result.step} ({result.whose}): {sides}",
             *(f"note: {note}" for note in result.notes),
             f"{result.compared} tensors compared in execution order (forward, backward, weight gradients); "
             f"{len(result.differences)} differ"]
    for side, only in (("A", result.only_in_a), ("B", result.only_in_b)):
        if only:
            lines.append(f"{len(only)} tensors only side {side} produced (its attention's weights, or S and P its "
                         f"backend hands out), not compared, e.g. {only[0]}")
    if result.first is None:
        return [*lines, "no difference: every tensor of the step is the same bit for bit"]
    lines.append(f"first difference: {_difference(result.first)}")
    later = sorted((d for d in result.differences if d.order != result.first.order), key=_relative,
                   reverse=True)[:top]
    if later:
        lines.append(f"largest relative differences after it (of {len(result.differences) - 1}):")
        lines += [f"  {_difference(d)}" for d in later]
    grads = [d for d in result.differences if d.phase == "gradient"]
    if grads:
        lines.append(f"weight gradients: {len(grads)} parameters differ"
                     + ("; largest relative: " + ", ".join(f"{d.where} {_relative(d):.2e}" for d in
                                                           sorted(grads, key=_relative, reverse=True)[:3])
                        if result.against is None else ""))
    if result.heads:
        lines.append("attention heads (max abs deviation over the step's calls; S, P: scores and probabilities, '-' "
                     "where a side's backend keeps them to itself; delta = rowsum(dO * O); sign bias of delta's "
                     "error, -1..1; alignment of W_Q's gradient error terms across tokens, 0..1):")
        lines.append(f"  {'head':>6} {'S':>9} {'P':>9} {'O':>9} {'dO':>9} {'dQ':>9} {'dK':>9} {'dV':>9} {'delta':>9} "
                     f"{'bias':>6} {'align':>6}")
        lines += [f"  {h.layer:>4}.{h.head:<1} {_dev(h.s)} {_dev(h.p)} {h.o:9.2e} {h.do:9.2e} {h.dq:9.2e} {h.dk:9.2e} "
                  f"{h.dv:9.2e} {h.delta:9.2e} {h.delta_sign_bias:+6.2f} {h.wq_alignment:6.2f}" for h in result.heads]
    return lines


def _dev(x: float) -> str:
    """A head's deviation in the table; '-' where it was not compared (S, P a side's backend keeps to itself)."""
    return f"{x:9.2e}" if x == x else f"{'-':>9}"


def _relative(d: Difference) -> float:
    if d.deviation is not None:
        return d.deviation.relative
    ours, theirs = (d.stats or {}).get("ours", {}), (d.stats or {}).get("theirs", {})
    a, b = theirs.get("norm"), ours.get("norm")
    return abs(b - a) / a if a and b is not None else 0.0


def _difference(d: Difference) -> str:
    where = f"{d.phase} {d.where} {d.what} {d.shape} {d.dtype}"
    v = d.deviation
    if v is None:   # against a trace: the statistics of each side
        stats = d.stats or {}
        return where + ": " + "; ".join(
            f"{side} " + ", ".join(f"{k} {x:.6e}" if x is not None else f"{k} not finite"
                                   for k, x in stats.get(side, {}).items()) for side in ("theirs", "ours"))
    return (f"{where}: max abs {v.max_abs:.3e}, mean abs {v.mean_abs:.3e}, relative {v.relative:.3e}, "
            f"{v.ulps:.0f} ulps")
