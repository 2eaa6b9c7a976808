"""kernels/word_sums.py on the CPU: interpreted (TRITON_INTERPRET=1, in a subprocess) against torch's reductions
tensor by tensor, and compiled for the GPU without one. The GPU's own run: test_word_sums.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import triton

from replay.kernels import triton_fa2, word_sums
from tests.conftest import REPO


def _tensors() -> list[torch.Tensor]:
    """Every word width, signed and unsigned words, empty tensors, and tensors of several blocks with a part."""
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(3 * word_sums.BLOCK + 17, generator=generator),
            torch.zeros(0),
            torch.randn(5, 2 * word_sums.BLOCK + 1, generator=generator).to(torch.bfloat16),
            torch.randint(-2**62, 2**62, (70,), dtype=torch.int64, generator=generator),
            torch.rand(301, generator=generator) > 0.5,
            torch.randint(0, 256, (word_sums.BLOCK + 1,), dtype=torch.uint8, generator=generator),
            torch.full((9,), -1, dtype=torch.int16),
            torch.randn(11, generator=generator).double(),
            torch.zeros(0, dtype=torch.int64)]


def _interpreter_main() -> None:
    from replay.recorder.digest import _device_sums

    tensors = _tensors()
    fused = word_sums.WordSums(tensors)
    before = fused().tolist()
    tensors[2].view(torch.int16)[3, 7] ^= 1   # one bit of one word of one tensor, in place
    print(json.dumps({"fused": before, "torch": _device_sums(_tensors()).tolist(), "after": fused().tolist()}))


@pytest.fixture(scope="module")
def interpreted() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", "from tests.kernels.test_word_sums_integration import "
                             "_interpreter_main; _interpreter_main()"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_the_fused_sums_are_torchs_tensor_by_tensor(interpreted):
    assert interpreted["fused"] == interpreted["torch"]
    assert any(a != 0 for row in interpreted["fused"] for a in row)


def test_a_flipped_bit_changes_its_tensors_sums_alone(interpreted):
    """The tables hold the tensors' addresses: a call reads the memory as it is now."""
    changed = [k for k, (a, b) in enumerate(zip(interpreted["fused"], interpreted["after"], strict=True)) if a != b]
    assert changed == [2]


@pytest.mark.skipif(triton_fa2.INTERPRETED, reason="TRITON_INTERPRET=1: kernels are interpreted, not compiled")
@pytest.mark.parametrize("capability", [80, 90])
def test_the_kernel_compiles_for_the_gpu_for_every_word_width(capability):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for width, word in word_sums._WORD_TYPES.items():
        source = ASTSource(word_sums._block_sums, {"table_ptr": "*i64", "partial_ptr": "*i64", "stride": "i64",
                                                   "WORD": "constexpr",
                                                   "BLOCK": "constexpr"},
                           constexprs={"WORD": word, "BLOCK": word_sums.BLOCK})
        kernel = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                                options={"num_warps": 4, "enable_fp_fusion": False})
        ptx = kernel.asm["ptx"]
        assert "ld.global" in ptx and "st.global" in ptx, f"width {width}: no global load or store"
