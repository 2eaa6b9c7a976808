"""recorder/step_trace.py: a step traced changes none of its bits, and its trace gives back what it saw."""

from __future__ import annotations

import torch

from replay.recorder.step_trace import TraceFile, Tracer, attention_traced, sdpa_traced
from tests.conftest import tensors_equal
from tests.recorder.models import OneBlock


def _llama() -> torch.nn.Module:
    """A 2-layer Llama of separate q, k, v projections with grouped-query attention: the normed hidden state has
    three consumers, whose gradients the backward sums."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def _gradients(model: torch.nn.Module, ids: torch.Tensor, traced: TraceFile | None) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    if traced is None:
        model(input_ids=ids, labels=ids).loss.backward()
    else:
        tracer = Tracer(model, traced.see)
        try:
            with attention_traced(model, traced.see, traced.keep):
                model(input_ids=ids, labels=ids).loss.backward()
        finally:
            tracer.close()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_a_traced_step_has_the_gradients_of_the_untraced_one_bit_for_bit():
    """The hooks add no node to the backward's graph (a module's full backward hook would, and changes the order
    in which the three projections' gradients of the normed hidden state are summed): every gradient is the same
    bits traced or not, and the attention interface's function is its own again afterwards (its name never
    changed: transformers' code reads it)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = _llama()
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(1))
    plain = _gradients(model, ids, None)
    with TraceFile.temporary() as traced:
        seen = _gradients(model, ids, traced)
        keys = list(traced.entries)
    assert tensors_equal(seen, plain)
    assert model.config._attn_implementation == "sdpa" and ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa   # as it was
    assert "backward|model.layers.0.self_attn.q_proj|grad of output" in keys
    assert {"forward|attention 1|O", "backward|attention 1|dK", "input|attention 1|x"} <= set(keys)
    assert keys.index("forward|attention 0|O") < keys.index("forward|attention 1|O") < \
        keys.index("backward|attention 1|dO") < keys.index("backward|attention 0|dO")   # execution order


def test_a_trace_saved_and_opened_plays_its_tensors_in_their_order(tmp_path):
    """SDPA calls of a model's own attention module, traced into a folder, read back: the same keys in the same
    order, the same bits, an attention call's tensors handed to `keep` too."""
    torch.manual_seed(0)
    model = OneBlock(vocab=16)
    x = torch.randint(0, 16, (2, 6))
    traced = TraceFile.create(tmp_path / "trace")
    seen: list[tuple[str, torch.Tensor]] = []

    def see(phase: str, where: str, what: str, t: torch.Tensor) -> None:
        seen.append((f"{phase}|{where}|{what}", t.detach().clone()))
        traced.see(phase, where, what, t)

    tracer = Tracer(model, see)
    with sdpa_traced([model.attn], see, traced.keep):
        model(x).sum().backward()
    tracer.close()
    traced.save()
    traced.close()
    opened = TraceFile.open(tmp_path / "trace", owned=True)
    assert opened is not None
    played: list[tuple[str, torch.Tensor]] = []
    kept: list[str] = []
    opened.play(lambda phase, where, what, t: played.append((f"{phase}|{where}|{what}", t)),
                lambda key, t: kept.append(key))
    opened.close()
    assert [k for k, _ in played] == [k for k, _ in seen]
    assert all(tensors_equal(a, b) for (_, a), (_, b) in zip(played, seen, strict=True))
    assert kept[:2] == ["attention 0|O", "attention 0|x"]   # the forward's, then the backward's gradients
    assert sorted(kept[2:]) == sorted(f"attention 0|{what}" for what in ("dO", "dQ", "dK", "dV"))
    assert not (tmp_path / "trace").exists()   # an owned trace's folder goes with it
