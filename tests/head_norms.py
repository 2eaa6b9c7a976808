"""The analysis's per-head spectral norms checked against an SVD the test does itself."""

from __future__ import annotations

import numpy as np
import pytest

from replay.analysis.names import HEAD_MATRICES


def assert_fused_head_norms(values: dict[str, np.ndarray], layer: int, c_attn, c_proj, n_head: int) -> None:
    """`values["spectral_head"][layer]` (compute_metrics) against each head's largest singular value, from a
    fused Q, K, V projection stored (out, in) as nn.Linear (nanoGPT's c_attn) and the output projection: head
    h is rows h*hd:(h+1)*hd of each third, and columns h*hd:(h+1)*hd of c_proj."""
    w, o = c_attn.double().numpy(), c_proj.double().numpy()
    width = o.shape[0]
    hd = width // n_head
    for head in range(n_head):
        rows = slice(head * hd, (head + 1) * hd)
        expected = {"q": w[:width][rows], "k": w[width:2 * width][rows], "v": w[2 * width:][rows], "o": o[:, rows]}
        for i, name in enumerate(HEAD_MATRICES):
            sigma = np.linalg.svd(expected[name], compute_uv=False)[0]
            assert values["spectral_head"][layer, i, head] == pytest.approx(sigma, rel=1e-5), (layer, name, head)
