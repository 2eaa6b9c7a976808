"""What one analysis work item computes, on a Ray worker (analysis/jobs.py plans the items and runs them):
a checkpoint's per-head metrics for a block of layers, with the probe batch through the model, or the
weight distances between two runs at one checkpoint; each writes its own results."""

from __future__ import annotations

import functools

import numpy as np
import torch

from replay import faults
from replay.analysis import metrics as M
from replay.analysis import results as R
from replay.analysis.items import DistanceItem, MetricItem, Source
from replay.analysis.names import DISTANCES
from replay.errors import StoreError, disk_errors
from replay.kernels.registry import hf_attention_modules, per_query_head, register
from replay.store import RunStore
from replay.store.layout import MODEL_KEYS, model_key
from replay.store.lease import require


def run(item: MetricItem | DistanceItem) -> None:
    """One work item, start to finish."""
    torch.set_num_threads(1)
    step = item.ckpt.step if isinstance(item, MetricItem) else item.other.step
    faults.hit("analysis-io", step)
    faults.hit("analysis-kill", step)
    result = compute_metrics(item) if isinstance(item, MetricItem) else compute_distances(item)
    require(item.lease)   # a task of a driver that lost the store (it died, another took over) writes nothing
    # a full or read-only disk is no transient error to retry (OSErrors are): the driver says it in one line
    with disk_errors(f"the analysis of {item.store}", item.store):
        if isinstance(item, MetricItem):
            R.write_metrics(item.store, item.row, item.block, item.block_index, result)
        else:
            R.write_distances(item.store, item.table, item.row, result)


def read_layers(src: Source, layers: range) -> list[dict[str, np.ndarray]]:
    """Each layer's weight matrices at a checkpoint, as (in, out), by analysis name (store/layout.py)."""
    reader, layout = src.open()
    keys = {layer: layout.keys(layer) for layer in layers}
    tensors = reader.read_model(src.step, [k for layer in keys.values() for k in layer.values()])
    return [layout.matrices({role: tensors[key].float().numpy() for role, key in keys[layer].items()})
            for layer in layers]


def compute_metrics(item: MetricItem) -> dict[str, np.ndarray]:
    layers = range(*item.block)
    cur = read_layers(item.ckpt, layers)
    prev = read_layers(item.prev, layers) if item.prev else [None] * len(layers)
    before = read_layers(item.before, layers) if item.before else [None] * len(layers)
    per_layer = []
    for i in range(len(layers)):
        values = M.weight_metrics(cur[i], item.n_head)
        values.update(M.update_metrics(cur[i], prev[i], before[i], item.n_head))
        if item.prev:   # per step, so checkpoints at uneven spacing (snapshots, dense replays) compare
            values["update_rel"] /= item.ckpt.step - item.prev.step
            values["update_rel_head"] /= item.ckpt.step - item.prev.step
        per_layer.append(values)
    out = {name: np.stack([v[name] for v in per_layer]) for name in per_layer[0]}
    if item.probe and item.transformers_config:
        out.update(hf_probe_metrics(item))
    else:
        out.update(probe_metrics(item) if item.probe else _no_probe(len(layers), item.n_head))
    return out


def _no_probe(n_layers: int, n_head: int) -> dict[str, np.ndarray]:
    """A model of the user's own has no probe (it needs the model's code and data): NaN."""
    return {**{name: np.full((n_layers, n_head), np.nan) for name in ("max_logit", "tie_rate", "attn_entropy")},
            "log_z": np.full(n_layers, np.nan)}


def probe_metrics(item: MetricItem) -> dict[str, np.ndarray]:
    """Run the model's first blocks (FP32, eager attention) on the probe batch and measure each layer
    of the item's block: per head the max attention logit, the BF16 tied-maxima rate and the attention
    entropy; per layer log Z (metrics.py says what each is)."""
    # lazy, as in hf_probe_metrics: transformers (3 s of CPU) only where a model is built, not for distances
    from transformers import GPT2Model

    from replay.train.model import BODY, gpt2_config

    lo, hi = item.block
    store = RunStore.open(item.ckpt.location)
    index = store.shard_index(item.ckpt.step, 0)
    body = model_key(BODY)
    wanted = [k for k in index if k.startswith(body) and (".h." not in k or int(k.split(".h.")[1].split(".")[0]) < hi)]
    tensors = store.read_shard(item.ckpt.step, 0, keys=wanted)
    state = {k[len(body):]: t.float() for k, t in tensors.items()}
    wte = state["wte.weight"]
    cfg = store.manifest.config.model
    model = GPT2Model(gpt2_config(cfg, vocab_size=wte.shape[0], n_layer=hi)).eval()
    model.set_attn_implementation("eager")
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    x = torch.tensor(item.probe, dtype=torch.long)[:, :-1]
    with torch.no_grad():
        # hidden[l] is block l's input; the last entry is the last block's output after ln_f
        hidden = model(input_ids=x, output_hidden_states=True).hidden_states
        per_head: dict[str, list[np.ndarray]] = {}
        z = []
        for layer in range(lo, hi):
            block = model.h[layer]
            qkv = block.attn.c_attn(block.ln_1(hidden[layer]))
            b, t, _ = qkv.shape
            q, k, _v = (y.view(b, t, item.n_head, -1).transpose(1, 2) for y in qkv.split(item.n_embd, dim=2))
            for name, values in M.attention_probe(q, k).items():
                per_head.setdefault(name, []).append(values)
            norm = model.ln_f if layer + 1 < hi else torch.nn.Identity()   # the last entry has had ln_f
            z.append(M.log_z(hidden[layer + 1], norm, wte))
    return {**{name: np.stack(v) for name, v in per_head.items()}, "log_z": np.array(z)}


def hf_probe_metrics(item: MetricItem) -> dict[str, np.ndarray]:
    """The probe of a transformers model of the user's own, rebuilt from its recorded config (FP32, eager
    attention) on its recorded probe rows: per query head the max attention logit, the BF16 tied-maxima
    rate and the entropy, of q and k as the model's attention function receives them (after RoPE, each
    query head with its group's key head); per layer log Z through the decoder's final norm and the output
    embedding (NaN for a model whose decoder has no `norm` and `layers`)."""
    # lazy (see probe_metrics)
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    lo, hi = item.block
    store = RunStore.open(item.ckpt.location)
    recorded = item.transformers_config
    assert recorded is not None, "compute_metrics runs this probe for a transformers model only"
    config = CONFIG_MAPPING[recorded["model_type"]].from_dict(recorded)
    config.get_text_config().num_hidden_layers = hi   # the layers below the block's end are all it needs
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    names = set(model.state_dict())
    held = [n for n in store.model_shapes(item.ckpt.step) if n in names]
    state = {n: t.float() for n, t in store.read_model(item.ckpt.step, held).items()}
    missing = names - set(state) - {"lm_head.weight"}   # a tied output embedding may be stored once
    if missing:
        raise StoreError(f"checkpoint {item.ckpt.step} of {store.location} lacks {sorted(missing)[:3]} of the model "
                         "its config builds: the probe cannot run it")
    model.load_state_dict(state, strict=False)
    register()
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for module in hf_attention_modules(model):
        module.replay_probe = seen
    model.set_attn_implementation("replay-probe")
    decoder = model.get_decoder()
    outputs: dict[int, torch.Tensor] = {}
    hooks = [layer.register_forward_hook(functools.partial(_keep_output, outputs, i))
             for i, layer in enumerate(getattr(decoder, "layers", []))]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor(item.probe, dtype=torch.long))
    finally:
        for hook in hooks:
            hook.remove()
    norm, unembed = getattr(decoder, "norm", None), model.get_output_embeddings().weight
    per_head: dict[str, list[np.ndarray]] = {}
    z = []
    with torch.no_grad():
        for layer in range(lo, hi):
            q, k = seen[layer]
            for name, values in M.attention_probe(q, per_query_head(k, q.shape[1])).items():
                per_head.setdefault(name, []).append(values)
            z.append(M.log_z(outputs[layer], norm, unembed) if norm is not None and layer in outputs else np.nan)
    return {**{name: np.stack(v) for name, v in per_head.items()}, "log_z": np.array(z)}


def _keep_output(outputs: dict, layer: int, module, args, output) -> None:
    outputs[layer] = output[0] if isinstance(output, tuple) else output


def compute_distances(item: DistanceItem) -> dict[str, np.ndarray]:
    names = [key.removeprefix(MODEL_KEYS) for key in item.tensors]
    a = item.reference.open()[0].read_model(item.reference.step, names)
    b = item.other.open()[0].read_model(item.other.step, names)
    rows = [M.tensor_distances(a[n].float().numpy(), b[n].float().numpy()) for n in names]
    return {metric: np.array([r[metric] for r in rows]) for metric in DISTANCES}
