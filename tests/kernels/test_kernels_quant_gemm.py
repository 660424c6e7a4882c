"""The Triton group-quantized GEMM/GEMV (kernels/quant_gemm.py) against the torch reference of the same
quantized weights, at tiny shapes under Triton's interpreter (re-run in a subprocess with TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401  (a test dependency: missing triton must fail, not skip)

from engine.quant.group_quant import KINDS, QuantWeight, fp16_bits, pack_int4, quant_matmul_ref
from kernels.quant_gemm import (
    GEMM_PROGRAMS_PER_SM,
    GEMV_PROGRAMS_PER_SM,
    GEMV_PROGRAMS_PER_SM_BATCHED,
    gemm_tiles,
    gemv_tiles,
    quant_gemm,
)
from tests.helpers.interpreter import interpreter_cases_test

# This module's `triton_interpreter` cases, run in a TRITON_INTERPRET=1 subprocess (tests/helpers/interpreter.py).
test_quant_gemm_under_interpreter = interpreter_cases_test(__file__, at_least=18, at_most=99, timeout=900)


def _weights(n: int, k: int, g: torch.Generator) -> list[QuantWeight]:
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    sc = fp16_bits(torch.rand(n, k // 128, generator=g) * 0.1)
    return [
        QuantWeight(4, "min", 128, n, k, pack_int4(q), sc, mins=fp16_bits(-torch.rand(n, k // 128, generator=g))),
        QuantWeight(4, "zero", 128, n, k, pack_int4(q), sc,
                    zeros=torch.randint(0, 16, (n, k // 128), generator=g, dtype=torch.uint8)),
        QuantWeight(8, "sym", 32, n, k, torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
                    fp16_bits(torch.rand(n, k // 32, generator=g) * 0.01)),
    ]


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("kind", range(3))
@pytest.mark.parametrize("rows", [1, 5, 20])  # GEMV (K split 3 ways), GEMV with a masked M tile, GEMM
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])  # fp16: the 16-bit GEMM path here
def test_quant_gemm_matches_reference(kind: int, rows: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(kind * 10 + rows)
    w = _weights(40, 384, g)[kind]  # 40 rows: a ragged N tile; K = 384: 3 iterations of 4 sub-blocks
    x = torch.randn(rows, 384, generator=g).to(dtype)
    off = w.mins if w.mins is not None else w.zeros
    y = quant_gemm(x, w.qweight, w.scales, off, w.bits, KINDS.index(w.kind), w.group_size, w.out_features)
    ref = quant_matmul_ref(x.float(), w)
    assert y.dtype == dtype
    assert float((y.float() - ref).norm() / ref.norm()) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("rows", [1, 2])
def test_quant_gemv_unsplit_matches_reference(rows: int) -> None:
    """K = 64: one iteration, so no split and the kernel writes the output directly."""
    g = torch.Generator().manual_seed(7 + rows)
    q = torch.randint(0, 16, (24, 64), generator=g, dtype=torch.uint8)
    w = QuantWeight(4, "min", 32, 24, 64, pack_int4(q), fp16_bits(torch.rand(24, 2, generator=g) * 0.1),
                    mins=fp16_bits(-torch.rand(24, 2, generator=g)))
    assert gemv_tiles(rows, 24, 64, 132)[3] == 1
    x = torch.randn(rows, 64, generator=g)
    y = quant_gemm(x, w.qweight, w.scales, w.mins, 4, KINDS.index("min"), 32, 24)
    ref = quant_matmul_ref(x, w)
    assert float((y - ref).norm() / ref.norm()) < 1e-5


def test_gemv_tiles_split_k_to_fill_the_gpu() -> None:
    # Llama-8B decode shapes on 132 SMs: a 4096-row weight splits K; the 28672-row gate/up needs no split.
    block_m, block_n, half, split = gemv_tiles(1, 4096, 4096, 132)
    assert (block_m, block_n, half) == (1, 8, 128)
    assert split == GEMV_PROGRAMS_PER_SM * 132 // (4096 // 8)
    assert gemv_tiles(1, 28672, 4096, 132)[3] == 1
    assert gemv_tiles(8, 4096, 14336, 132) == (8, 16, 64, GEMV_PROGRAMS_PER_SM_BATCHED * 132 // (4096 // 16))
    assert gemv_tiles(1, 40, 96, 132) == (1, 8, 16, 3)  # K = 96: three 32-wide iterations, one per split
    assert gemv_tiles(1, 40, 96, 132, (4, 256, 8))[1:3] == (4, 16)  # a sweep's tile, narrowed to fit K


def test_gemm_tiles_split_k_when_tiles_are_few() -> None:
    # 64 decode rows of Llama-8B on 132 SMs: the 4096-wide outputs are 32 tiles of 128, so K splits (the
    # 4096-row down projection over K = 14336 too); gate/up's 224 tiles split in two; a prefill's rows need none.
    assert gemm_tiles(64, 4096, 4096, 132, False) == (64, 128, 2, GEMM_PROGRAMS_PER_SM * 132 // 32)
    assert gemm_tiles(64, 4096, 14336, 132, False)[3] == GEMM_PROGRAMS_PER_SM * 132 // 32
    assert gemm_tiles(64, 28672, 4096, 132, False)[3] == 2
    assert gemm_tiles(8, 4096, 4096, 132, False)[:3] == (16, 64, 4)
    assert gemm_tiles(4096, 4096, 4096, 132, False)[3] == 1
    assert gemm_tiles(20, 40, 384, 132, True) == (32, 64, 4, 3)  # K = 384: three iterations, one per split
    assert gemm_tiles(20, 40, 384, 132, False, (16, 32, 4)) == (16, 32, 4, 3)
    assert gemm_tiles(20, 40, 96, 132, False)[2] == 1  # K = 96: three sub-blocks, one per iteration


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("meta_per_sub,swap_ab", [(False, False), (True, True), (False, True), (True, False)])
@pytest.mark.parametrize("kind", range(3))
def test_quant_gemm_variants_match_reference(meta_per_sub: bool, swap_ab: bool, kind: int) -> None:
    """The GEMM's sweep variants (scales gathered per column; the transposed product), fp16 rows (the interpreter
    upcasts bf16 dots, which would skip the transposed path), K split 3 ways."""
    from kernels.quant_gemm import _quant_gemm_tiled

    g = torch.Generator().manual_seed(30 + kind)
    w = _weights(40, 384, g)[kind]
    x = torch.randn(20, 384, generator=g).to(torch.float16)
    off = w.mins if w.mins is not None else w.zeros
    y = torch.empty(20, 40, dtype=torch.float16)
    _quant_gemm_tiled(x, w.qweight, w.scales, off if off is not None else w.scales, w.bits, KINDS.index(w.kind),
                      w.group_size, 40, y, tiles=(16, 32, 4), meta_per_sub=meta_per_sub, swap_ab=swap_ab)
    ref = quant_matmul_ref(x.float(), w)
    assert float((y.float() - ref).norm() / ref.norm()) < 1e-2
