"""Checkpoint series replay did not record (store/foreign/), each written by the real code of its format:
transformers' Trainer and save_pretrained, torch.distributed.checkpoint.save, torch.save in nanoGPT's dict;
read back equal to what was saved, and the refusals in one line."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn

from replay.errors import ReplayError, StoreError, UsageError
from replay.store.dcp import quiet_single_process
from replay.store.foreign import open_series
from replay.store.location import Location
from tests.conftest import tensors_equal


def refused(exc: type[ReplayError], where: Path | Location, **kw: object) -> str:
    with pytest.raises(exc) as e:
        open_series(Location.parse(where), **kw)  # type: ignore[arg-type]
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


# -- transformers -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    """A real Trainer run of a tiny GPT-2: 4 steps, a checkpoint every 2, safetensors."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    out = tmp_path_factory.mktemp("hf") / "out"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=3, n_head=4,
                                       bos_token_id=0, eos_token_id=0))
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 40, (16, 16))]
    args = TrainingArguments(str(out), max_steps=4, save_steps=2, logging_steps=1, per_device_train_batch_size=4,
                             report_to=[], use_cpu=True, learning_rate=1e-2,
                             disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return out, trainer


def test_a_trainer_runs_checkpoints_are_a_series_read_back_as_saved(trainer_run):
    out, trainer = trainer_run
    series = open_series(Location.parse(out))
    assert series.format == "hf-trainer" and [c.step for c in series.checkpoints] == [2, 4]
    cfg = trainer.model.config
    assert (series.n_layer, series.n_head, series.n_kv_head, series.n_embd) == (cfg.n_layer, cfg.n_head,
                                                                              cfg.n_head, cfg.n_embd)
    assert series.layout["name"] == "hf-gpt2" and series.transformers_config["model_type"] == "gpt2"
    logged = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    assert logged and series.losses == {step - 1: loss for step, loss in logged.items()}
    names = ["transformer.h.1.attn.c_attn.weight", "transformer.h.2.mlp.c_proj.weight", "transformer.wte.weight"]
    final = trainer.model.state_dict()
    assert tensors_equal(series.read_model(4, names), {n: final[n] for n in names})
    saved = load_file(out / "checkpoint-2" / "model.safetensors")
    assert tensors_equal(series.read_model(2, names), {n: saved[n] for n in names})
    assert not tensors_equal(saved[names[0]], final[names[0]])   # it trained between them
    assert series.model_shapes(2) == {n: list(t.shape) for n, t in saved.items()}


def test_one_trainer_checkpoint_is_a_series_of_one_and_its_identity_follows_its_bytes(trainer_run, tmp_path):
    out, _ = trainer_run
    one = tmp_path / "checkpoint-4"
    shutil.copytree(out / "checkpoint-4", one)
    assert (one / "optimizer.pt").exists()   # the Trainer's own .pt files are not nanoGPT checkpoints
    series = open_series(Location.parse(one))
    assert [c.step for c in series.checkpoints] == [4]
    before = series.checkpoints[0].identity
    assert open_series(Location.parse(one)).checkpoints[0].identity == before
    shutil.copy(out / "checkpoint-2" / "model.safetensors", one / "model.safetensors")
    assert open_series(Location.parse(one)).checkpoints[0].identity != before


def test_a_trainer_state_disagreeing_with_the_folder_name_is_refused(trainer_run, tmp_path):
    out, _ = trainer_run
    shutil.copytree(out / "checkpoint-2", tmp_path / "run" / "checkpoint-3")
    assert "global_step 2" in refused(StoreError, tmp_path / "run")


def test_a_truncated_safetensors_file_is_refused_in_one_line(trainer_run, tmp_path):
    out, _ = trainer_run
    shutil.copytree(out / "checkpoint-2", tmp_path / "run" / "checkpoint-2")
    f = tmp_path / "run" / "checkpoint-2" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    assert "truncated" in refused(StoreError, tmp_path / "run")


def _llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))


@pytest.mark.parametrize("shard", [None, "16KB"])
def test_a_grouped_query_llama_saved_by_save_pretrained_reads_back_as_saved(tmp_path, shard):
    models = {7: _llama(1), 9: _llama(2)}
    for step, model in models.items():
        kw = {"max_shard_size": shard} if shard else {}
        model.save_pretrained(tmp_path / f"checkpoint-{step}", **kw)
    if shard:
        assert (tmp_path / "checkpoint-7" / "model.safetensors.index.json").exists()
    series = open_series(Location.parse(tmp_path))
    cfg = models[7].config
    assert [c.step for c in series.checkpoints] == [7, 9] and series.layout["name"] == "hf-llama"
    assert (series.n_head, series.n_kv_head, series.n_layer, series.n_embd) == (
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers, cfg.hidden_size)
    for step, model in models.items():
        state = model.state_dict()
        names = [n for n in state if ".layers." in n]
        assert tensors_equal(series.read_model(step, names), {n: state[n] for n in names})
    assert "not the 8 given" in refused(UsageError, tmp_path, heads=8)


def test_a_pickled_pytorch_model_bin_is_refused(tmp_path):
    model = _llama(0)   # transformers before 4.35 saved this way by default (5 no longer writes it)
    model.config.save_pretrained(tmp_path / "checkpoint-1")
    torch.save(model.state_dict(), tmp_path / "checkpoint-1" / "pytorch_model.bin")
    assert "safetensors" in refused(UsageError, tmp_path)


# -- torch.distributed.checkpoint -------------------------------------------------------------------------

class Titan(nn.Module):
    """torchtitan's Llama names: layers.N.attention.wq/wk/wv/wo, layers.N.feed_forward.w1/w2/w3."""

    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 2, layers: int = 3):
        super().__init__()
        self.tok_embeddings = nn.Embedding(50, dim)
        kv = dim // heads * kv_heads
        self.layers = nn.ModuleDict({str(i): nn.Module() for i in range(layers)})
        for block in self.layers.values():
            block.attention = nn.Module()
            for name, out in (("wq", dim), ("wk", kv), ("wv", kv)):
                setattr(block.attention, name, nn.Linear(dim, out, bias=False))
            block.attention.wo = nn.Linear(dim, dim, bias=False)
            block.feed_forward = nn.Module()
            block.feed_forward.w1 = nn.Linear(dim, 3 * dim, bias=False)
            block.feed_forward.w3 = nn.Linear(dim, 3 * dim, bias=False)
            block.feed_forward.w2 = nn.Linear(3 * dim, dim, bias=False)


def _dcp_save(state: dict, where: Path) -> None:
    with quiet_single_process():
        dcp.save(state, checkpoint_id=where, no_dist=True)


def test_torchtitan_style_dcp_folders_read_back_as_saved_given_the_head_count(tmp_path):
    models = {}
    for step in (10, 20):
        torch.manual_seed(step)
        model = models[step] = Titan()
        opt = torch.optim.AdamW(model.parameters())
        _dcp_save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ckpt" / f"step-{step}")
    assert "--heads" in refused(UsageError, tmp_path / "ckpt")
    series = open_series(Location.parse(tmp_path / "ckpt"), heads=4)
    assert series.format == "dcp" and [c.step for c in series.checkpoints] == [10, 20]
    assert (series.n_layer, series.n_head, series.n_kv_head, series.n_embd) == (3, 4, 2, 32)
    assert series.layout["q"] == "layers.{layer}.attention.wq.weight" and series.prefix == "model."
    for step, model in models.items():
        state = model.state_dict()
        assert tensors_equal(series.read_model(step, list(state)), state)
        assert series.model_shapes(step) == {n: list(t.shape) for n, t in state.items()}


def test_a_dcp_folder_of_a_bare_state_dict_gets_the_layout_its_names_and_shapes_say(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2)).state_dict()
    _dcp_save(gpt2, tmp_path / "hf" / "3")
    nano = {k: t.T.contiguous() if t.dim() == 2 and ".h." in k else t for k, t in gpt2.items()}   # nn.Linear's
    _dcp_save(nano, tmp_path / "nano" / "3")
    for folder, name, state in (("hf", "hf-gpt2", gpt2), ("nano", "nanogpt", nano)):
        series = open_series(Location.parse(tmp_path / folder / "3"), heads=2)
        assert series.layout["name"] == name and series.prefix == "" and series.n_embd == 16
        names = ["transformer.h.1.attn.c_attn.weight", "transformer.h.0.mlp.c_fc.weight"]
        assert tensors_equal(series.read_model(3, names), {n: state[n] for n in names})


class Evil:
    """Unpickled by plain pickle, it creates `marker` (no process: the unit tier forbids starting one)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def test_the_evil_pickle_runs_under_plain_pickle(tmp_path):
    pickle.loads(pickle.dumps(Evil(tmp_path / "ran")))   # what the refusals below keep from happening
    assert (tmp_path / "ran").exists()


def test_a_dcp_metadata_pickle_that_would_run_code_is_refused_without_running_it(tmp_path):
    _dcp_save({"model": Titan().state_dict()}, tmp_path / "step-5")
    marker = tmp_path / "ran"
    (tmp_path / "step-5" / ".metadata").write_bytes(pickle.dumps(Evil(marker)))
    assert "not DCP metadata" in refused(StoreError, tmp_path, heads=4)
    assert not marker.exists()


# -- nanoGPT ----------------------------------------------------------------------------------------------

class Nano(nn.Module):
    """nanoGPT's GPT's parameter names, its lm_head tied to wte."""

    def __init__(self, n_layer: int = 2, n_embd: int = 24, vocab: int = 50):
        super().__init__()
        blocks = nn.ModuleList()
        for _ in range(n_layer):
            b = nn.Module()
            b.ln_1, b.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
            b.attn, b.mlp = nn.Module(), nn.Module()
            b.attn.c_attn, b.attn.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
            b.mlp.c_fc, b.mlp.c_proj = nn.Linear(n_embd, 4 * n_embd), nn.Linear(4 * n_embd, n_embd)
            blocks.append(b)
        wte = nn.Embedding(vocab, n_embd)
        self.transformer = nn.ModuleDict(dict(wte=wte, wpe=nn.Embedding(16, n_embd), h=blocks,
                                              ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        wte.weight = self.lm_head.weight


def _nano_ckpt(model: nn.Module, iter_num: int, path: Path, compiled: bool = False) -> None:
    state = model.state_dict()
    if compiled:
        state = {"_orig_mod." + k: v for k, v in state.items()}
    args = dict(n_layer=2, n_head=3, n_embd=24, block_size=16, bias=True, vocab_size=50)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": state, "optimizer": torch.optim.AdamW(model.parameters()).state_dict(), "model_args": args,
                "iter_num": iter_num, "best_val_loss": torch.tensor(2.5), "config": {"batch_size": 4}}, path)


@pytest.mark.parametrize("nested", [False, True])
def test_nanogpt_checkpoints_read_back_as_saved_at_their_iter_num(tmp_path, nested):
    models = {}
    for i, (name, iter_num) in enumerate((("late", 500), ("early", 250))):
        torch.manual_seed(i)
        models[iter_num] = Nano()
        path = tmp_path / name / "ckpt.pt" if nested else tmp_path / f"{name}.pt"
        _nano_ckpt(models[iter_num], iter_num, path, compiled=iter_num == 500)
    series = open_series(Location.parse(tmp_path))
    assert series.format == "nanogpt" and [c.step for c in series.checkpoints] == [250, 500]
    assert (series.n_layer, series.n_head, series.n_kv_head, series.n_embd) == (2, 3, 3, 24)
    assert series.layout["name"] == "nanogpt" and series.losses == {}
    for step, model in models.items():
        state = model.state_dict()
        assert "lm_head.weight" in state and "transformer.wte.weight" in state
        assert tensors_equal(series.read_model(step, list(state)), state)


def test_a_nanogpt_file_that_would_run_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"model": Nano().state_dict(), "model_args": {}, "iter_num": 1, "x": Evil(marker)},
               tmp_path / "ckpt.pt")
    assert "needs more than tensors" in refused(StoreError, tmp_path)
    assert not marker.exists()
    (tmp_path / "ckpt.pt").write_bytes(pickle.dumps({"iter_num": Evil(marker)}, protocol=2))   # the pre-zip format
    assert "needs more than tensors" in refused(StoreError, tmp_path)
    assert not marker.exists()


# -- what is not a series ---------------------------------------------------------------------------------

def test_folders_without_one_formats_checkpoints_are_refused_in_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    assert "empty or does not exist" in refused(UsageError, tmp_path / "empty")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("hello")
    (tmp_path / "other" / "data").mkdir()
    assert "notes.txt" in refused(UsageError, tmp_path / "other")
    _llama(0).save_pretrained(tmp_path / "mixed" / "checkpoint-3")
    _nano_ckpt(Nano(), 3, tmp_path / "mixed" / "nano.pt")
    assert "mixes checkpoint formats" in refused(UsageError, tmp_path / "mixed")


def test_a_large_files_sampled_digest_follows_a_rewrite_of_its_weights(tmp_path):
    from replay.store.foreign.base import sampled_digest

    a, b = tmp_path / "a", tmp_path / "b"
    torch.manual_seed(0)
    weights = torch.randn(1 << 20)   # 4 MiB: sampled, not read whole
    a.write_bytes(b"header" + weights.numpy().tobytes())
    b.write_bytes(b"header" + (weights + 1e-3).numpy().tobytes())
    assert sampled_digest(a, 6) != sampled_digest(b, 6)
    shutil.copy(a, b)
    assert sampled_digest(a, 6) == sampled_digest(b, 6)
