"""torchtitan's llama3 debugmodel with its own flex attention (`FlexAttention`, document masks from its
`get_attention_masks`), its kernel made routable with the one line docs/your-loop.md gives: forward on a CPU,
where torch's flex attention has no backward.

Skips unless torchtitan is installed (examples/torchtitan/README.md), as test_torchtitan_integration.py does."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not a test dependency: install it as "
                                         "examples/torchtitan/README.md says to run this")

from torch.nn.attention.flex_attention import flex_attention  # noqa: E402
from torchtitan.models.common.attention import FlexAttention  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402

from replay.kernels.flex import routable  # noqa: E402
from replay.kernels.plan import AttentionPlan  # noqa: E402
from replay.kernels.reach import AttentionReach  # noqa: E402
from replay.kernels.sdpa_dispatch import sdpa_dispatch  # noqa: E402


def test_torchtitans_flex_attention_is_reached_after_one_line_and_keeps_its_bits_without_a_plan():
    compiled = FlexAttention._compiled_flex_attn
    torch.manual_seed(0)
    model = model_registry("debugmodel").model.build()
    model.init_states(buffer_device=torch.device("cpu"))
    tokens = torch.randint(0, 2000, (2, 64))
    positions = torch.cat([torch.arange(20), torch.arange(44)]).expand(2, 64).contiguous()   # two documents a row
    masks = model.get_attention_masks(positions)

    def forward(plan: str | None = None, reach: AttentionReach | None = None) -> torch.Tensor:
        with torch.no_grad():
            if plan is None:
                return model(tokens, positions=positions, attention_masks=masks)
            with sdpa_dispatch(model, AttentionPlan.parse(plan), reach=reach):
                return model(tokens, positions=positions, attention_masks=masks)

    try:
        FlexAttention._compiled_flex_attn = flex_attention   # eager: inductor's CPU kernel is not what is tested
        own, reach = forward(), AttentionReach()
        forward("baseline", reach)   # torch's own call: no plan sees it, and the replay would say how to fix that
        assert reach.take() == {} and "FlexAttention" in reach.unreached_hint()
        FlexAttention._compiled_flex_attn = routable(FlexAttention._compiled_flex_attn)   # the one line
        assert torch.equal(forward(), own) and torch.equal(forward("sdpa"), own)
        exact = forward("baseline:dtype=fp64", reach)
        counted = reach.take()
        assert len(counted) == 6 * 16 and set(counted.values()) == {1}   # every head of the 6 layers, once
        assert torch.allclose(exact, own, atol=1e-4)   # the document mask means what flex computes
        emulated = forward("0=reference-emu:dtype=bf16", reach)
        assert not torch.equal(emulated, own) and reach.take()[(0, 15, "reference-emu:dtype=bf16")] == 1
    finally:
        FlexAttention._compiled_flex_attn = compiled
