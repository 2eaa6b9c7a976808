"""The Triton FlashAttention-2 kernels interpreted on the CPU (TRITON_INTERPRET=1, in subprocesses) against
the emulation and FP64, and compiled for the GPU without one; the cases and the criteria: test_triton_fa2.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
import torch
import triton

from replay.kernels import triton_fa2
from replay.kernels.baseline import causal_mask
from replay.kernels.flash_emu import _FlashEmulation, flash_attention
from replay.kernels.options import AttentionOptions, SafeSoftmaxFix
from replay.kernels.triton_fa2 import triton_flash_attention
from tests.conftest import REPO
from tests.kernels import test_attention_dropout as dropout_checks
from tests.kernels.test_triton_fa2 import (
    CASES,
    OUTPUTS,
    UNIT,
    _bounds,
    _check_against_emulation,
    _fp64_golden,
    _inputs,
    _round_in_kernel,
    _rounding_probes,
    _run,
)


def _interpreter_main(path: str) -> None:
    """Entry point of the subprocess (TRITON_INTERPRET=1): run every case and the rounding probes."""
    assert triton_fa2.INTERPRETED, "run with TRITON_INTERPRET=1 set before import"
    results, seconds = {}, {}
    for name in CASES:
        start = time.perf_counter()
        results[name] = _run(triton_flash_attention, name)
        seconds[name] = time.perf_counter() - start
    probes = _rounding_probes()
    results["round"] = {dtype: _round_in_kernel(probes, dtype, emulate=True) for dtype in UNIT}
    results["seconds"] = seconds
    torch.save(results, path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    """Every case's kernel outputs, computed once in a TRITON_INTERPRET=1 subprocess."""
    path = tmp_path_factory.mktemp("triton_fa2") / "results.pt"
    code = ("import sys; from tests.kernels.test_triton_fa2_integration import _interpreter_main; "
            "_interpreter_main(sys.argv[1])")
    result = subprocess.run([sys.executable, "-c", code, str(path)], cwd=REPO, capture_output=True, text=True,
                            env=os.environ | {"TRITON_INTERPRET": "1"}, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(path, weights_only=False)


# -- interpreter tests ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", list(UNIT), ids=["bf16", "fp16"])
def test_rounding_helper_matches_torch_bitwise(interpreted, dtype):
    probes = _rounding_probes()
    got, want = interpreted["round"][dtype], probes.to(dtype).float()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))
    finite = probes.isfinite()
    assert (((probes.view(torch.int32) & 0xFFFF) == 0x8000) & finite).sum() > 10_000, "exact BF16 ties"
    assert (probes.to(dtype).isinf() & finite).sum() > 100, "finite values that round to infinity"


@pytest.mark.parametrize("name", list(CASES))
def test_interpreter_matches_the_emulation(interpreted, name):
    got = interpreted[name]
    want = _run(flash_attention, name)
    bounds = _bounds(name, *_inputs(name))
    for key in OUTPUTS:
        _check_against_emulation(got[key], want[key], bounds[key] / 3, f"{name} {key}")


def test_integer_scores_give_the_emulations_output_bit_for_bit(interpreted):
    got, want = interpreted["integer"]["o"], _run(flash_attention, "integer")["o"]
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    q, k, _, _ = _inputs("integer")
    s = (q.float() @ k.float().transpose(1, 2)).masked_fill(~causal_mask(q.shape[1], k.shape[1]), float("-inf"))
    tied_rows = ((s == s.amax(-1, keepdim=True)).sum(-1) > 1).double().mean()
    assert tied_rows > 0.25, "many rows have a tied maximum, so the safe-softmax offset is taken"


@pytest.mark.parametrize("name", list(CASES))
def test_interpreter_is_within_the_fp64_error_bound(interpreted, name):
    got, gold = interpreted[name], _fp64_golden(name)
    bounds = _bounds(name, *_inputs(name))
    for key in OUTPUTS:
        excess = (got[key].double() - gold[key]).abs() - bounds[key]
        assert (excess <= 0).all(), f"{name} {key}: error exceeds its bound by up to {excess.max().item():.3g}"


def test_interpreter_runs_fast(interpreted):
    assert sum(interpreted["seconds"].values()) < 40, interpreted["seconds"]


TARGETS = {"sm_90": (90, 232_448), "sm_80": (80, 166_912)}   # compute capability, shared memory per block


@pytest.mark.skipif(triton_fa2.INTERPRETED, reason="TRITON_INTERPRET=1: kernels are interpreted, not compiled")
@pytest.mark.parametrize("target, dtype, opts", [
    ("sm_90", torch.bfloat16, AttentionOptions()),
    ("sm_80", torch.float16, AttentionOptions(block_r=64, block_c=64, fix=SafeSoftmaxFix(2.0, 1e-3),
                                              hp_pv=True, hp_delta=True)),
], ids=["sm90-bf16-128x128", "sm80-fp16-64x64-all-options-padding-mask-dropout"])
def test_real_low_precision_path_compiles_for_the_gpu(monkeypatch, target, dtype, opts):
    """The GPU code path (EMULATE_LP off, BF16/FP16 tensors) through ptxas, without a GPU: every kernel
    the forward and backward launch, with their real arguments, fits in shared memory, uses tensor-core
    matmuls, rounds to nearest even and divides by l with IEEE division."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    capability, shared_limit = TARGETS[target]
    pointer = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.uint8: "*u8",
               torch.int64: "*i64"}
    compiled = {}

    def compile_instead(kernel, grid, args, constexprs, num_warps, num_stages):
        signature = {name: pointer[a.dtype] if isinstance(a, torch.Tensor) else "i32" if isinstance(a, int) else "fp32"
                     for name, a in zip(kernel.arg_names, args, strict=False)}
        signature |= {name: "constexpr" for name in constexprs}
        source = ASTSource(kernel, signature, constexprs=constexprs)
        compiled[kernel.__name__] = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=dict(
            num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=True))

    monkeypatch.setattr(triton_fa2, "_launch", compile_instead)
    q = torch.empty(2, 256, 64, dtype=dtype, device="meta")
    mask4 = None if dtype == torch.bfloat16 else torch.ones(1, 2, 256, 256, dtype=torch.uint8, device="meta")
    seed = torch.empty(1, dtype=torch.int64, device="meta")
    drop = None if dtype == torch.bfloat16 else triton_fa2._Dropout(0.1, seed)
    out, lse2, o_hp = triton_fa2._forward(q, q, q, mask4, opts, True, 0.125, dtype == torch.bfloat16, drop)
    triton_fa2._backward(q, q, q, out, lse2, o_hp, q, mask4, opts, True, 0.125, dtype == torch.bfloat16, drop)
    assert set(compiled) == {"_fwd_kernel", "_delta_kernel", "_dkdv_kernel", "_dq_kernel"}
    lp = "bf16" if dtype == torch.bfloat16 else "f16"
    for name, kernel in compiled.items():
        assert kernel.metadata.shared <= shared_limit, f"{name}: {kernel.metadata.shared} bytes of shared memory"
        ptx = kernel.asm["ptx"]
        if name != "_delta_kernel":
            assert f"cvt.rn.{lp}" in ptx, f"{name}: no round-to-nearest-even conversion to {lp}"
            assert re.search(rf"mma\S*\.{lp}", ptx), f"{name}: no tensor-core matmul"
    assert "div.rn.f32" in compiled["_fwd_kernel"].asm["ptx"]


def test_interpreter_refuses_a_beta_whose_probabilities_underflow():
    """As the emulation: subnormal or zero row sums are an error, not NaN or silent zeros."""
    script = (
        "import torch\n"
        "from replay.errors import UsageError\n"
        "from replay.kernels.options import AttentionOptions, SafeSoftmaxFix\n"
        "from replay.kernels.triton_fa2 import triton_flash_attention\n"
        "q = torch.zeros(1, 1, 16, 16); q[..., 0] = 1.0\n"
        "k = torch.zeros(1, 1, 16, 16); k[..., 0] = 80.0\n"   # 16 keys tie at score 20
        "v = torch.randn(1, 1, 16, 16)\n"
        "for beta, refused in ((2.0, False), (6.0, True), (1e6, True)):\n"
        "    opts = AttentionOptions(block_r=16, block_c=16, fix=SafeSoftmaxFix(beta=beta))\n"
        "    try:\n"
        "        out = triton_flash_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), opts, causal=False)\n"
        "        assert not refused and torch.isfinite(out).all(), beta\n"
        "    except UsageError as e:\n"
        "        assert refused and 'underflows' in str(e), beta\n"
        "print('ok')\n")
    _run_interpreted(script)


def test_interpreter_takes_a_padding_mask_shared_by_the_heads():
    """The mask as the model glue passes it, [batch, 1, N, M] read in place for every head (stride 0), with
    the fix and decreasing key order: the emulation's outputs (97% bitwise, the rest within 1e-3), rows that
    see only padding 0, and no underflow reported for them."""
    script = (
        "import torch\n"
        "from replay.kernels.flash_emu import flash_attention\n"
        "from replay.kernels.options import AttentionOptions, SafeSoftmaxFix\n"
        "from replay.kernels.triton_fa2 import triton_flash_attention\n"
        "g = torch.Generator().manual_seed(0)\n"
        "q, k, v, do = (torch.randn(3, 3, 32, 16, generator=g).bfloat16() for _ in range(4))\n"
        "keep = torch.ones(3, 1, 32, 32, dtype=torch.bool); keep[0, :, :, :5] = False; keep[2, :, :, :20] = False\n"
        "opts = AttentionOptions(block_r=16, block_c=16, fix=SafeSoftmaxFix(7.0), key_order='decreasing')\n"
        "outs = []\n"
        "for fn in (triton_flash_attention, flash_attention):\n"
        "    leaves = [t.clone().requires_grad_() for t in (q, k, v)]\n"
        "    o = fn(*leaves, opts, causal=True, mask=keep)\n"
        "    o.backward(do)\n"
        "    outs.append([o.detach()] + [t.grad for t in leaves])\n"
        "for a, b in zip(*outs):\n"
        "    equal = (a.view(torch.int16) == b.view(torch.int16)).double().mean().item()\n"
        "    assert equal >= 0.97 and (a.float() - b.float()).abs().max() < 1e-3, equal\n"
        "assert outs[0][0][0, :, :5].abs().max() == 0 and outs[0][0][2, :, :20].abs().max() == 0\n"
        "assert outs[0][0][0, :, 5:].abs().amax(-1).min() > 0\n"
        "print('ok')\n")
    _run_interpreted(script)


def _run_interpreted(script: str) -> None:
    """Run `script` in a TRITON_INTERPRET=1 subprocess; it prints "ok" last when its own asserts hold."""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=REPO)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]


def _triton(block_r: int, block_c: int) -> dropout_checks.Backend:
    opts = AttentionOptions(block_r=block_r, block_c=block_c)
    return lambda q, k, v, **kw: triton_flash_attention(q, k, v, opts, causal=True, **kw)


def _dropout_main() -> None:
    """Entry point of the subprocess (TRITON_INTERPRET=1): test_attention_dropout.py's checks on
    triton-fa2, then the kernels against the fa2 emulation given the kernels' own mask."""
    assert triton_fa2.INTERPRETED, "run with TRITON_INTERPRET=1 set before import"
    a, b = _triton(16, 16), _triton(32, 16)
    dropout_checks.check_same_rng_state_same_result(a)
    dropout_checks.check_zero_dropout_is_the_undropped_path(a)
    dropout_checks.check_expectation_and_drop_rate(a, draws=12)
    dropout_checks.check_tiles_drop_the_same_entries(a, b)
    q, k, v, do = dropout_checks.inputs(d=32)
    torch.manual_seed(9)
    kept = a(q, k, dropout_checks.identity_values(q), dropout=dropout_checks.P) != 0   # the mask seed 9 draws
    got = dropout_checks.run(a, q, k, v, do, 9, dropout=dropout_checks.P)
    opts = AttentionOptions(block_r=16, block_c=16)
    want = dropout_checks.run(lambda *t: _FlashEmulation.apply(*t, opts, True, 32 ** -0.5, None, None,
                                                               dropout_checks.P, kept, None), q, k, v, do, None)
    for what, x, y in zip(OUTPUTS, got, want, strict=True):
        _check_against_emulation(x, y, torch.zeros(()), f"dropout {what}")
    print("ok")


def test_interpreter_applies_attention_dropout():
    """Under the interpreter, triton-fa2 with dropout: the same RNG state gives the same outputs and
    gradients, another one others; p = 0 is the path without dropout; the mean over draws is the undropped
    output and p of the probabilities drop; two tilings drop the same entries; and given the mask the kernels
    drew (read off a V = I call), forward and backward are the fa2 emulation's with that mask (so the
    backward regenerates the forward's mask)."""
    _run_interpreted("from tests.kernels.test_triton_fa2_integration import _dropout_main; _dropout_main()")
