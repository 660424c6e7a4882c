"""kernels/quant_wgmma_smem.py: Hopper's int4 GEMM with x by TMA as the MMA's A operand and the weights dequantized
into shared memory as its B. Gluon has no CPU interpreter, so the kernel itself runs only on an sm_90 GPU; here on
any machine: its tile choice and what it refuses."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401  (a test dependency: missing triton must fail, not skip)

import kernels.quant_wgmma_smem as sm
from engine.quant.group_quant import KINDS, dequantize, quant_matmul_ref
from engine.quant.kn_layout import to_kn
from kernels.quant_gemm_kn import quant_gemm_kn
from tests.helpers.quant import assert_hopper_kn_refusals, on_cuda, random_int4_weight, rel_error, run_kn

BOUND = {torch.bfloat16: 4e-3, torch.float16: 5e-4}
_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def test_smem_tiles_split_whole_iterations() -> None:
    # 2 row tiles x 16 column tiles = 32 programs; 132 SMs at one a SM: 4 splits of 16 iterations (64 k each)
    assert sm.smem_tiles(256, 4096, 4096, 132, (256, 8, 4, 1, 128)) == (128, 256, 8, 4, 4, 16)
    assert sm.smem_tiles(256, 28672, 4096, 132, (256, 8, 4, 1, 128))[4] == 1  # 224 programs fill the GPU
    assert sm.smem_tiles(300, 128, 128, 132, (128, 4, 3, 2, 64))[4:] == (2, 1)  # no more splits than iterations
    # two 64-row MMA blocks a warpgroup: half the row tiles, so twice the splits
    assert sm.smem_tiles(256, 4096, 4096, 132, (128, 8, 3, 2, 256)) == (256, 128, 8, 3, 8, 8)


def test_smem_refuses_what_it_does_not_take() -> None:
    assert_hopper_kn_refusals(sm.quant_wgmma_smem, [(64, 8, 4, 1, 128), (256, 2, 4, 1, 32), (256, 8, 6, 1, 128),
                                                    (256, 8, 4, 1), (128, 8, 3, 2, 64), (128, 4, 3, 2, 256)])


def test_quant_gemm_kn_routes_to_it_when_asked_and_refuses_clearly_off_hopper() -> None:
    kn = to_kn(random_int4_weight("zero", 32, 256, 128, torch.Generator().manual_seed(2)))
    x = torch.randn(300, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="capability 9"):
        quant_gemm_kn(x, kn.qweight, kn.scales, kn.offsets, 1, 128, 32, smem=True)


@pytest.mark.skipif(not _HOPPER, reason="needs an sm_90 GPU (wgmma, TMA)")
def test_smem_compiled_on_a_hopper_gpu() -> None:
    """On an H100 / H200: every kind and dtype, ragged row counts (TMA's zero rows past M, several row tiles), a
    ragged column tile, K split (a second launch sums) or not, 128 / 256 columns, one or two warpgroups, 3-5 x
    stages, one or two 64-row MMA blocks a warpgroup, Llama-8B widths; equal to the reference, and for zero-point
    weights equal to x @ the dense 16-bit weight (the operand is that weight bit for bit)."""
    g = torch.Generator().manual_seed(0)
    for kind in KINDS:
        w = random_int4_weight(kind, 200, 1024, 256, g, min_scale=0.01)
        w = on_cuda(w)
        for rows in (1, 40, 128, 300):
            for dtype in (torch.bfloat16, torch.float16):
                x = torch.randn(rows, 1024, generator=g).to(dtype).cuda()
                ref = quant_matmul_ref(x.float(), w)
                for tiles in ((256, 8, 4, 1, 128), (128, 8, 3, 2, 128), (128, 4, 4, 16, 64), (256, 4, 5, 1, 64),
                              (128, 8, 4, 64, 128), (128, 8, 3, 1, 256), (128, 4, 3, 2, 128)):
                    y = run_kn(sm.quant_wgmma_smem, w, x, tiles=tiles)
                    assert rel_error(y, ref) < BOUND[dtype], (kind, rows, dtype, tiles)
                if kind == "zero":
                    dense = dequantize(w).to(dtype).float()
                    y = run_kn(sm.quant_wgmma_smem, w, x)
                    assert rel_error(y, x.float() @ dense.t()) < 2e-3, (rows, dtype)
    for n, k in [(6144, 4096), (4096, 14336)]:
        w = random_int4_weight("zero", n, k, 128, g, min_scale=0.01)
        w = on_cuda(w)
        for rows in (128, 256, 1000):
            x = torch.randn(rows, k, generator=g).to(torch.bfloat16).cuda()
            y = run_kn(sm.quant_wgmma_smem, w, x)
            assert rel_error(y, quant_matmul_ref(x.float(), w)) < BOUND[torch.bfloat16], (n, k, rows)
