"""What attention actually ran: a count, per layer and head, of the calls each backend computed, noted where
the call is made (registry.LayerAttention, a transformers implementation's attention modules, or the SDPA
calls `sdpa_dispatch` routes), and, per attention module, the torch functions it called while it ran.

A replay's overrides read it to prove that an attention override reached its heads (recorder/overrides.py),
and to say which path attention really took; a module that ran without any SDPA call it could route (an
explicit `softmax(q @ k^T) @ v`, as minGPT's) is named with what it called instead, and told of
`kernels.explicit.causal_attention` (or, where it holds torch's flex attention, of `kernels.flex`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# torch functions that compute attention by hand: what a module that never calls SDPA is seen calling
EXPLICIT = ("softmax", "matmul", "bmm", "baddbmm", "einsum", "__matmul__", "masked_fill", "log_softmax")


@dataclass
class ModuleSeen:
    """An attention module as it ran: its name and class, how many times, the explicit attention functions it
    called, and whether it holds torch's flex attention (kernels/flex.py's `holds_flex`), whose calls no mode
    sees."""

    name: str
    kind: str
    runs: int = 0
    called: set[str] = field(default_factory=set)
    flex: bool = False


@dataclass
class AttentionReach:
    calls: Counter[tuple[int, int, str]] = field(default_factory=Counter)   # (layer, head, backend) -> calls
    modules: dict[int, ModuleSeen] = field(default_factory=dict)             # by layer, where they were watched

    def ran(self, layer: int, heads: list[int] | range, backend: str) -> None:
        """One attention call of `layer` computed `heads` on `backend` (its canonical spec)."""
        for head in heads:
            self.calls[(layer, head, backend)] += 1

    def entered(self, layer: int, name: str, kind: str, flex: bool = False) -> None:
        seen = self.modules.setdefault(layer, ModuleSeen(name, kind, flex=flex))
        seen.runs += 1

    def called(self, layer: int, function: str) -> None:
        seen = self.modules.get(layer)
        if seen is not None and function in EXPLICIT:
            seen.called.add(function)

    def take(self) -> Counter[tuple[int, int, str]]:
        """The calls counted since the last take (a step's)."""
        calls, self.calls = self.calls, Counter()
        return calls

    def unreached_hint(self) -> str:
        """Why no call reached the override, from what the attention modules did, in a clause."""
        if not self.modules:
            return ("no attention module of the model ran (name them with Loop(..., attention='PATTERN'), e.g. "
                    "'transformer.h.*.attn')")
        seen = self.modules[min(self.modules)]
        if seen.flex and not seen.called:   # it holds torch's flex attention and computed no attention by hand
            return (f"its attention modules ran ({seen.name}, {seen.kind}: {seen.runs} time(s)) and hold torch's flex "
                    "attention, whose calls replay cannot route; call it through replay instead, which leaves the "
                    "run bit for bit as it was: y = flex_attention(q, k, v, block_mask=..., kernel=<the flex "
                    "attention it calls>) (from replay.kernels.flex import flex_attention), or, for a kernel the "
                    "module holds, replace it once with routable(kernel) (from replay.kernels.flex import routable), "
                    "and record again (docs/your-loop.md)")
        did = f"called {', '.join(sorted(seen.called))}" if seen.called else "called no attention function replay knows"
        return (f"its attention modules ran ({seen.name}, {seen.kind}: {seen.runs} time(s)) but never called "
                f"torch.nn.functional.scaled_dot_product_attention, which is what replay routes to another backend; "
                f"it {did}: it computes attention by hand. The smallest change that makes it reachable, and "
                f"leaves the run bit for bit as it was: in {seen.kind}.forward, replace the explicit attention "
                "(att = softmax(q @ k^T * scale, masked) ... y = att @ v, with its attention dropout) with one "
                "call, y = causal_attention(q, k, v, dropout=<that nn.Dropout>) (from replay.kernels.explicit "
                "import causal_attention), and record again (docs/your-loop.md)")
