"""Localisation: which layers and heads moved before a spike, ranked.

The rule. For a spike at step s, take the analysed checkpoints at or before s (each holds the state
*before* its step). The last of them is the state the spike grew from; the earlier ones are each
unit's own history. For every signal of a unit (a head, or a layer's whole matrices) the anomaly is
the robust z-score of its last value against that history, the detector's MAD rule:

    z = (x_last - median(history)) / max(1.4826 * MAD(history), 0.01 * |median(history)|)

(the floor keeps a flat history from turning a 1% wobble into a large score; for the tied-maxima rate
the floor is also one probe row, its resolution). A unit's score is its largest |z|; a layer's is the
largest over its own signals and its heads'. At least two earlier checkpoints with a value are needed.

Early warnings. For every signal of every unit, its lead time before a spike: the longest run of
checkpoints that ends at the last one before the spike in which every value is at least WARN_Z robust
z-scores (of one sign) away from the signal's history before the run; the lead is the spike's step
minus the run's first checkpoint. A signal with a lead left its own history that many steps before
the spike and did not come back.

The trajectory: the run's own checkpoints, or, when a plain replay (no overrides) that verified bit
for bit against the record covers the spike with more checkpoints before it, that replay's: the same
trajectory, sampled more densely (`replay run STORE --from A --to B --checkpoint-every 1`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from replay.analysis.names import HEAD_MATRICES, MATRICES
from replay.analysis.results import read_metrics
from replay.recorder import spikes
from replay.replayer.listing import list_replays
from replay.store import RunStore
from replay.store.location import Location, Where

# (metric, matrix or None): the signals of a head [checkpoint, layer, (matrix,) head] ...
HEAD_SIGNALS = [("spectral_qk", None), *[("spectral_head", m) for m in HEAD_MATRICES],
                *[("update_rel_head", m) for m in HEAD_MATRICES], *[("update_cos_head", m) for m in ("q", "k")],
                ("max_logit", None), ("tie_rate", None), ("attn_entropy", None)]
# ... and of a layer as a whole [checkpoint, layer(, matrix)]
LAYER_SIGNALS = [*[("spectral", m) for m in MATRICES], *[("update_rel", m) for m in MATRICES], ("log_z", None)]
MIN_HISTORY = 2
WARN_Z = 6.0   # the recorder's own spike threshold (spike.threshold)


def unit_name(layer: int, head: int | None) -> str:
    return f"layer {layer}" + ("" if head is None else f" head {head}")


@dataclass
class Anomaly:
    layer: int
    head: int | None                    # None: the layer as a whole
    score: float                        # largest |z| of the unit's signals
    signal: str                         # the signal that gave it, e.g. "spectral_head[q]"
    value: float                        # its value at the last checkpoint before the spike
    baseline: float                     # its median over the history

    @property
    def unit(self) -> str:
        return unit_name(self.layer, self.head)

    def to_dict(self) -> dict[str, Any]:
        return {"unit": self.unit, "layer": self.layer, "head": self.head, "score": self.score,
                "signal": self.signal, "value": self.value, "baseline": self.baseline}


@dataclass
class Lead:
    layer: int
    head: int | None                    # None: a signal of the layer as a whole
    signal: str
    since: int                          # the first checkpoint of the run of departed values
    lead: int                           # spike step - since
    z: float                            # the last value's robust z against the history before `since`

    @property
    def unit(self) -> str:
        return unit_name(self.layer, self.head)

    def to_dict(self) -> dict[str, Any]:
        return {"unit": self.unit, "layer": self.layer, "head": self.head, "signal": self.signal,
                "since": self.since, "lead": self.lead, "z": self.z}


@dataclass
class Localisation:
    spike: int
    trajectory: str = "run"             # "run", or the id of the bitwise plain replay it was read from
    checkpoint: int | None = None       # the last analysed checkpoint at or before the spike; None: too few
    history: list[int] = field(default_factory=list)      # the checkpoints it is compared with
    heads: list[Anomaly] = field(default_factory=list)    # ranked, most anomalous first
    layers: list[Anomaly] = field(default_factory=list)
    leads: list[Lead] = field(default_factory=list)       # early warnings, longest lead first

    @property
    def found(self) -> bool:
        return self.checkpoint is not None

    def to_dict(self) -> dict[str, Any]:
        return {"spike": self.spike, "trajectory": self.trajectory, "checkpoint": self.checkpoint,
                "history": self.history,
                "heads": [a.to_dict() for a in self.heads], "layers": [a.to_dict() for a in self.layers],
                "leads": [w.to_dict() for w in self.leads]}

    def lines(self, top: int) -> list[str]:
        """The ranking in words, its `top` first units of each kind."""
        if not self.found:
            return [f"spike at step {self.spike}: too few analysed checkpoints before it to localise"]
        where = "" if self.trajectory == "run" else f" of replay {self.trajectory} (bit for bit the record)"
        out = [f"spike at step {self.spike}: checkpoint {self.checkpoint} against {len(self.history)} earlier ones "
               f"({self.history[0]}..{self.history[-1]}){where}; robust z of each metric, largest first"]
        for title, ranking in (("heads", self.heads), ("layers", self.layers)):
            out.append(f"  {title}:")
            out += [f"    {a.unit:<16} z={a.score:8.1f}  {a.signal}: {a.value:.4g} (median {a.baseline:.4g})"
                    for a in ranking[:top]]
        out.append(f"  early warnings (|z| >= {WARN_Z:g} from a checkpoint on, until the spike): "
                   + ("none" if not self.leads else f"{len(self.leads)} signal(s), longest lead first"))
        out += [f"    {w.unit:<16} {w.lead:5d} steps  {w.signal} (since checkpoint {w.since}, z={w.z:.1f})"
                for w in self.leads[:top]]
        return out


def robust_z(history: np.ndarray, x: float, floor: float = 0.0) -> tuple[float, float]:
    """(z, median) of x against a history, by the rule above."""
    z, median, _ = spikes.robust_z(history, x, relative_floor=0.01, floor=floor)
    return z, median


def _signal(table: dict[str, Any], metric: str, matrix: str | None) -> np.ndarray:
    """[checkpoint, layer, (head)] values of one signal."""
    values = table[metric]
    if matrix is None:
        return values
    names = HEAD_MATRICES if metric.endswith("_head") else MATRICES
    return values[:, :, names.index(matrix)]


def _best(series: list[tuple[str, np.ndarray]], last: int, floors: dict[str, float]) -> tuple | None:
    best = None
    for name, s in series:
        history = s[:last]
        history = history[np.isfinite(history)]
        if len(history) < MIN_HISTORY or not np.isfinite(s[last]):
            continue
        z, med = robust_z(history, float(s[last]), floors.get(name, 0.0))
        if best is None or abs(z) > abs(best[0]):
            best = (z, name, float(s[last]), med)
    return best


def localise(table: dict[str, Any], spike: int, trajectory: str = "run") -> Localisation:
    """Rank heads and layers for one spike (not `found` when too few checkpoints precede it)."""
    rows = np.flatnonzero(table["step"] <= spike)
    if len(rows) < MIN_HISTORY + 1:
        return Localisation(spike, trajectory)
    last = len(rows) - 1
    sub = {k: (v[rows] if isinstance(v, np.ndarray) and v.ndim >= 1 and k != "attrs" else v) for k, v in table.items()}
    n_layer, n_head = table["spectral_qk"].shape[1:]
    probe = table["attrs"].get("probe", {})
    floors = {"tie_rate": 1.0 / max(1, probe.get("rows", 1))}
    heads, layers = [], []
    for layer in range(n_layer):
        layer_best = _best([(f"{m}[{x}]" if x else m, _signal(sub, m, x)[:, layer]) for m, x in LAYER_SIGNALS],
                           last, floors)
        candidates = [layer_best] if layer_best else []
        for head in range(n_head):
            best = _best([(f"{m}[{x}]" if x else m, _signal(sub, m, x)[:, layer, head]) for m, x in HEAD_SIGNALS],
                         last, floors)
            if best:
                heads.append(Anomaly(layer, head, abs(best[0]), best[1], best[2], best[3]))
                candidates.append((best[0], f"head {head} {best[1]}", best[2], best[3]))
        if candidates:
            z, name, value, med = max(candidates, key=lambda c: abs(c[0]))
            layers.append(Anomaly(layer, None, abs(z), name, value, med))
    if not heads and not layers:
        return Localisation(spike, trajectory)
    steps = sub["step"].tolist()
    return Localisation(spike, trajectory, int(steps[-1]), [int(s) for s in steps[:-1]],
                        sorted(heads, key=lambda a: -a.score), sorted(layers, key=lambda a: -a.score),
                        lead_times(sub, spike, floors))


def lead_times(table: dict[str, Any], spike: int, floors: dict[str, float] | None = None) -> list[Lead]:
    """The early warnings of every unit's signals (see the module's rule), over the table's checkpoints
    at or before the spike; longest lead first."""
    steps = table["step"]
    n_layer, n_head = table["spectral_qk"].shape[1:]
    out = []
    for layer in range(n_layer):
        # (head or None for the layer's own signals, its signals, where a signal's series of the unit is)
        units: list[tuple[int | None, list[tuple[str, str | None]], tuple[slice | int, ...]]] = \
            [(None, LAYER_SIGNALS, (slice(None), layer))]
        units += [(head, HEAD_SIGNALS, (slice(None), layer, head)) for head in range(n_head)]
        for head, signals, at in units:
            for metric, matrix in signals:
                name = f"{metric}[{matrix}]" if matrix else metric
                since, z = departure(_signal(table, metric, matrix)[at], (floors or {}).get(name, 0.0))
                if since is not None:
                    out.append(Lead(layer, head, name, int(steps[since]), spike - int(steps[since]), z))
    return sorted(out, key=lambda w: (-w.lead, -abs(w.z)))


def departure(series: np.ndarray, floor: float = 0.0) -> tuple[int | None, float]:
    """(index where the run of departed values that ends at the series' last value begins, the last
    value's z against the history before it), or (None, nan) when the last value has not departed."""
    last = len(series) - 1
    since, z_last = None, float("nan")
    for start in range(last, 0, -1):
        history = series[:start][np.isfinite(series[:start])]
        run = series[start:]
        if len(history) < MIN_HISTORY or not np.all(np.isfinite(run)):
            break
        zs = [robust_z(history, float(x), floor)[0] for x in run]
        if not (all(z >= WARN_Z for z in zs) or all(z <= -WARN_Z for z in zs)):
            break
        since, z_last = start, zs[-1]
    return since, z_last


def localise_store(store_path: Where) -> list[Localisation]:
    """A Localisation for every recorded spike of a run, each read from the densest trajectory that
    covers it (not `found` where too few checkpoints precede it)."""
    store_path = Location.parse(store_path)
    trajectories = [("run", read_metrics(store_path))]
    for r in list_replays(store_path):
        bitwise = (r.get("verification") or {}).get("bitwise")
        if "error" not in r and not r["overrides"] and r["status"] == "complete" and bitwise:
            trajectories.append((r["id"], read_metrics(store_path / "replays" / r["id"])))
    out: list[Localisation] = []
    for event in RunStore.open(store_path).spikes:
        spike = int(event["step"])
        usable = [(name, t) for name, t in trajectories if t is not None and np.any(t["step"] <= spike)
                  and (name == "run" or t["step"].max() >= spike)]
        usable.sort(key=lambda nt: -int(np.sum(nt[1]["step"] <= spike)))
        out.append(next((f for name, t in usable if (f := localise(t, spike, name)).found), Localisation(spike)))
    return out
