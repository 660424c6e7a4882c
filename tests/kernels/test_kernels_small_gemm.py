"""CPU checks of the small-batch fused GEMM (kernels/small_gemm.py) through Triton's interpreter, against its torch
reference: each prologue (none, residual-add + RMSNorm, SwiGLU), bias, float32 logits output and the fused argmax.

As in test_kernels.py: TRITON_INTERPRET=1 must be set before ``import triton``, so the kernel cases run in a
subprocess that re-runs this file with it set (tests/helpers/interpreter.py). Outputs are NaN-poisoned first; shapes
are odd so every mask is hit.
"""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401  (a test dependency: missing triton must fail, not skip)

from kernels.small_gemm import MAX_ROWS, GemvConfig, small_gemm, small_gemm_ref
from tests.helpers.interpreter import interpreter_cases_test

interp = pytest.mark.triton_interpreter  # collected only under TRITON_INTERPRET=1 (tests/conftest.py)
NUM_INTERPRETER_CASES = 24
# This module's `interp` cases, run in a TRITON_INTERPRET=1 subprocess (tests/helpers/interpreter.py).
test_small_gemm_under_interpreter = interpreter_cases_test(__file__, at_least=NUM_INTERPRETER_CASES,
                                                           at_most=NUM_INTERPRETER_CASES, timeout=600)


@pytest.mark.outside_interpreter
def test_small_gemm_rejects_bad_input() -> None:
    w = torch.zeros(8, 32)
    with pytest.raises(ValueError, match="at most"):
        small_gemm(torch.zeros(MAX_ROWS + 1, 32), w)
    with pytest.raises(ValueError, match="does not fit"):
        small_gemm(torch.zeros(2, 32), w, prologue="silu")
    with pytest.raises(ValueError, match="norm_weight"):
        small_gemm(torch.zeros(2, 32), w, prologue="norm")
    with pytest.raises(ValueError, match="only added by the norm"):
        small_gemm(torch.zeros(2, 32), w, residual=torch.zeros(2, 32))
    with pytest.raises(ValueError, match="prologue must be"):
        small_gemm(torch.zeros(2, 32), w, prologue="gelu")
    with pytest.raises(ValueError, match="impl must be"):
        small_gemm(torch.zeros(1, 32), w, impl="cublas")
    with pytest.raises(ValueError, match="unknown GEMV streaming flags"):
        GemvConfig.parse("pipelined,turbo")
    assert GemvConfig.parse("none") == GemvConfig(prefetch=False)
    assert GemvConfig.parse("prefetch, pipelined") == GemvConfig(pipelined=True, prefetch=True)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "output has unwritten (NaN-poisoned) or NaN elements"
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300))


def _inputs(rows: int, n: int, k: int, dtype: torch.dtype, seed: int, x_cols: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, x_cols or k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    residual = torch.randn(rows, k, generator=g).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    return x, w, residual, norm_w, bias


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_plain_and_bias(dtype: torch.dtype, rows: int) -> None:
    x, w, _, _, bias = _inputs(rows, 40, 300, dtype, seed=rows)
    out = torch.full((rows, 40), float("nan"), dtype=dtype)
    y, residual_sum, tokens = small_gemm(x, w, bias=bias, out=out)
    ref, _ = small_gemm_ref(x, w, bias=bias)
    assert y is out and residual_sum is None and tokens is None
    assert _rel_err(y, ref) < TOL[dtype]


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_prologue_with_and_without_residual(dtype: torch.dtype, with_residual: bool) -> None:
    x, w, residual, norm_w, _ = _inputs(5, 24, 300, dtype, seed=7)
    res_before = residual.clone()
    y, residual_sum, _ = small_gemm(x, w, prologue="norm", residual=residual if with_residual else None,
                                    norm_weight=norm_w, eps=1e-5)
    ref, ref_sum = small_gemm_ref(x, w, prologue="norm", residual=residual if with_residual else None,
                                  norm_weight=norm_w, eps=1e-5)
    assert _rel_err(y, ref) < TOL[dtype]
    assert torch.equal(residual, res_before)  # the input residual is left alone; the sum is a new tensor
    if with_residual:
        assert residual_sum is not None and ref_sum is not None
        if dtype == torch.float32:
            assert torch.equal(residual_sum, ref_sum)
        else:  # the interpreter rounds bf16 its own way (truncation); on a GPU the sum is bit-equal
            assert _rel_err(residual_sum, ref_sum) < 1e-2
    else:
        assert residual_sum is None


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_prologue(dtype: torch.dtype) -> None:
    x, w, _, _, _ = _inputs(2, 33, 200, dtype, seed=11, x_cols=400)
    y, _, _ = small_gemm(x, w, prologue="silu")
    ref, _ = small_gemm_ref(x, w, prologue="silu")
    assert _rel_err(y, ref) < TOL[dtype]


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
def test_float32_logits_and_fused_argmax(dtype: torch.dtype, rows: int) -> None:
    """A vocabulary-like output (several programs), float32 logits from bf16 weights: the fused argmax is the
    argmax of the stored logits."""
    x, w, _, norm_w, _ = _inputs(rows, 100, 64, dtype, seed=5)
    out = torch.full((rows, 100), float("nan"), dtype=torch.float32)
    logits, _, tokens = small_gemm(x, w, prologue="norm", norm_weight=norm_w, out=out, argmax=True)
    ref, _ = small_gemm_ref(x.float(), w.float(), prologue="norm", norm_weight=norm_w.float())
    assert _rel_err(logits, ref) < TOL[dtype]
    assert tokens is not None and torch.equal(tokens, logits.argmax(dim=-1))


@interp
def test_fused_argmax_breaks_ties_to_the_first_index() -> None:
    """Small integers make every sum exact: columns 20 and 70 (in different programs) tie for the max, and the
    first one wins, as torch.argmax."""
    g = torch.Generator().manual_seed(2)
    w = torch.randint(-3, 4, (100, 64), generator=g).to(torch.bfloat16)
    w[70] = w[20]
    x = w[20:21].clone()
    x[0, :8] = 0  # a row that is not exactly any column's own direction
    logits, _, tokens = small_gemm(x, w, out=torch.empty(1, 100), argmax=True)
    assert logits[0, 20] == logits[0, 70] == logits.max()
    assert tokens is not None and int(tokens[0]) == 20


GEMV_CONFIGS = [GemvConfig(), GemvConfig(block_n=4, block_k=64, num_warps=4, pipelined=True),
                GemvConfig(block_n=16, block_k=32, num_warps=2, pipelined=True, prefetch=True, evict_first=True)]


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemv", GEMV_CONFIGS, ids=["default", "pipelined", "all_flags_small_tiles"])
def test_one_row_cuda_core_kernel(dtype: torch.dtype, gemv: GemvConfig) -> None:
    """impl="gemv" (one row, no tl.dot): every prologue, bias, residual sum, float32 output and fused argmax,
    with the default tiles (one K tile here) and with small tiles (several K tiles, the masked tail, the
    pipelined loads)."""
    x, w, residual, norm_w, bias = _inputs(1, 40, 300, dtype, seed=9)
    gu, w_down, _, _, _ = _inputs(1, 24, 200, dtype, seed=10, x_cols=400)
    cases = [(x, w, dict(bias=bias)), (x, w, dict(prologue="norm", residual=residual, norm_weight=norm_w)),
             (x, w, dict(prologue="norm", norm_weight=norm_w)), (gu, w_down, dict(prologue="silu"))]
    for xin, weight, kw in cases:
        y, residual_sum, _ = small_gemm(xin, weight, impl="gemv", gemv=gemv, **kw)
        ref, ref_sum = small_gemm_ref(xin, weight, **kw)
        assert _rel_err(y, ref) < TOL[dtype], kw
        assert (residual_sum is None) == (ref_sum is None)
        if residual_sum is not None and ref_sum is not None:
            assert _rel_err(residual_sum, ref_sum) < TOL[dtype]
    logits, _, tokens = small_gemm(x, w, impl="gemv", gemv=gemv, out=torch.empty(1, 40), argmax=True)
    assert tokens is not None and torch.equal(tokens, logits.argmax(dim=-1))


@interp
def test_zero_rows() -> None:
    x, w, _, _, _ = _inputs(1, 16, 32, torch.float32, seed=1)
    y, _, _ = small_gemm(x[:0], w)
    assert y.shape == (0, 16)
