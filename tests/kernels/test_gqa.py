"""Llama-family models (grouped-query attention, RoPE) on attention plans, through transformers'
AttentionInterface: a head is a query head, reading the key/value head of its group."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from replay.kernels import plan
from replay.kernels.plan import AttentionPlan
from replay.kernels.registry import apply_plan

N_HEAD, N_KV, HD = 4, 2, 8   # query heads 0, 1 read key/value head 0; heads 2, 3 read head 1
FAMILIES = ("llama", "qwen2", "mistral")


def _model(family: str, attn: str = "sdpa", attention_dropout: float = 0.0):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(family, vocab_size=64, hidden_size=N_HEAD * HD, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=N_HEAD, num_key_value_heads=N_KV,
                               max_position_embeddings=32, attention_dropout=attention_dropout)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()


def _attention_outputs(model, x: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the layer's attention output per query head [B, N, H, hd], before o_proj; the layer's values
    [B, N, H_kv, hd]): read at o_proj's input and v_proj's output."""
    seen = {}
    attn = model.model.layers[layer].self_attn
    hooks = [attn.o_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("out", a[0])),
             attn.v_proj.register_forward_hook(lambda m, a, out: seen.__setitem__("v", out))]
    with torch.no_grad():
        model(input_ids=x)
    for h in hooks:
        h.remove()
    b, n = x.shape
    return seen["out"].view(b, n, N_HEAD, HD), seen["v"].view(b, n, N_KV, HD)


@pytest.fixture(scope="module", autouse=True)
def probes():
    """Two test backends (plugins, as a user would add one): zeros, and the values the head was given."""
    for name, fn in (("zeros-test", lambda q, k, v, scaling: torch.zeros_like(q)),
                     ("values-test", lambda q, k, v, scaling: v.clone())):
        if name not in plan.PLUGINS:
            plan.register_backend(name, fn)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_head_override_changes_that_query_head_only(family):
    x = torch.randint(0, 64, (2, 16))
    model = _model(family)
    plain, _ = _attention_outputs(model, x, 1)
    apply_plan(model, AttentionPlan.parse("sdpa;1.3=zeros-test"))
    assert model.config._attn_implementation == "replay"
    out, _ = _attention_outputs(model, x, 1)
    assert torch.equal(out[:, :, :3], plain[:, :, :3])     # heads 0-2: the recorded sdpa, bit for bit
    assert not plain[:, :, 3].eq(0).all() and out[:, :, 3].eq(0).all()


@pytest.mark.parametrize("head", range(N_HEAD))
def test_a_query_head_reads_the_key_value_head_of_its_group(head):
    x = torch.randint(0, 64, (1, 12))
    model = _model("llama")
    apply_plan(model, AttentionPlan.parse(f"sdpa;0.{head}=values-test"))
    out, v = _attention_outputs(model, x, 0)
    group = head // (N_HEAD // N_KV)
    assert torch.equal(out[:, :, head], v[:, :, group])
    assert not torch.equal(out[:, :, head], v[:, :, 1 - group])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_the_models_own_implementation_through_the_interface_is_bitwise_itself(family, attn):
    x = torch.randint(0, 64, (2, 16))
    model = _model(family, attn)
    with torch.no_grad():
        own = model(input_ids=x).logits
    apply_plan(model, AttentionPlan.parse(f"{attn};0.0={attn}"))   # a head named: the interface runs it
    assert model.config._attn_implementation == "replay"
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, own)


@pytest.mark.parametrize("family", FAMILIES)
def test_heads_split_between_eager_and_sdpa_are_each_implementations_own(family):
    """Heads 1 and 2 (one of each key/value group) on eager, the rest on sdpa: each head bit for bit what
    its implementation gives the whole layer."""
    x = torch.randint(0, 64, (2, 16))
    eager, _ = _attention_outputs(_model(family, "eager"), x, 0)
    sdpa, _ = _attention_outputs(_model(family, "sdpa"), x, 0)
    model = _model(family, "sdpa")
    apply_plan(model, AttentionPlan.parse("sdpa;0.1-2=eager"))
    out, _ = _attention_outputs(model, x, 0)
    assert torch.equal(out[:, :, 1:3], eager[:, :, 1:3]) and torch.equal(out[:, :, [0, 3]], sdpa[:, :, [0, 3]])
    assert not torch.equal(eager, sdpa)   # the two differ in their last bits, so the check above can fail


def test_emulated_fa2_on_one_llama_head_is_close_to_exact_attention():
    x = torch.randint(0, 64, (2, 16))
    model = _model("llama", "eager")
    exact, _ = _attention_outputs(model, x, 1)
    apply_plan(model, AttentionPlan.parse("eager;1.2=fa2-emu:dtype=fp32,br=4,bc=4"))
    out, _ = _attention_outputs(model, x, 1)
    assert torch.equal(out[:, :, [0, 1, 3]], exact[:, :, [0, 1, 3]])
    assert 0 < (out[:, :, 2] - exact[:, :, 2]).abs().max() < 1e-5   # tiled online softmax: not bitwise


def _logits_and_grads(model, x, seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=x).logits
    logits.square().mean().backward()
    return [logits.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_llama_with_attention_dropout_runs_deterministically_through_the_interface():
    """A Llama with attention dropout 0.2 in training, heads on eager, the emulation and baseline (through
    `_replay_attention`): the same RNG state gives the same logits and gradients, another state others, and
    the dropout is really applied (without it, other logits)."""
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    model = _model("llama", attention_dropout=0.2).train()
    apply_plan(model, AttentionPlan.parse("eager;0.1-2=fa2-emu:br=8,bc=8;1=baseline;1.0=reference-emu:br=4,bc=8"))
    assert model.config._attn_implementation == "replay"
    first, again, other = (_logits_and_grads(model, x, seed) for seed in (3, 3, 4))
    assert _equal(first, again) and not _equal(first, other)
    model.config.attention_dropout = 0.0
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.0
    assert not torch.equal(_logits_and_grads(model, x, 3)[0], first[0])


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_under_dropout_the_models_own_implementation_through_the_interface_is_bitwise_itself(attn):
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    model = _model("llama", attn, attention_dropout=0.2).train()
    own = _logits_and_grads(model, x, 3)
    assert not _equal(own, _logits_and_grads(model, x, 4))
    apply_plan(model, AttentionPlan.parse(f"{attn};0.0={attn}"))   # a head named: the interface runs it
    assert model.config._attn_implementation == "replay"
    assert _equal(_logits_and_grads(model, x, 3), own)
