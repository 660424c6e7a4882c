"""kernels/quant_wgmma.py: Hopper's wgmma int4 kernel (A dequantized in registers, x through shared memory). Gluon
has no CPU interpreter, so the kernel itself runs only on an sm_90 GPU; here on any machine: its tile choice and
what it refuses."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401  (a test dependency: missing triton must fail, not skip)

import kernels.quant_wgmma as wg
from engine.quant.group_quant import KINDS, dequantize, quant_matmul_ref
from tests.helpers.quant import assert_hopper_kn_refusals, on_cuda, random_int4_weight, rel_error, run_kn

BOUND = {torch.bfloat16: 4e-3, torch.float16: 5e-4}
_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def test_wgmma_tiles_pad_rows_and_split_whole_groups() -> None:
    assert wg.wgmma_tiles(64, 4096, 4096, 132, (1, 1, 64, 4)) == (1, 1, 64, 8, 512)  # 64 tiles x 8 splits
    assert wg.wgmma_tiles(13, 4096, 512, 132, (2, 1, 64, 4))[2:4] == (16, 4)  # 16 rows; no more splits than groups
    assert wg.wgmma_tiles(256, 28672, 4096, 132, (2, 1, 128, 1))[2:] == (128, 1, 4096)  # 448 programs fill the GPU
    assert wg.wgmma_block_m(200) == wg.wgmma_entry(200)[2]  # past a program's rows: several row tiles


def test_wgmma_refuses_what_it_does_not_take() -> None:
    assert not wg.wgmma_supported(torch.float32, 128, 256) and not wg.wgmma_supported(torch.bfloat16, 64, 256)
    assert not wg.wgmma_supported(torch.bfloat16, 128, 256, torch.device("cpu"))
    assert_hopper_kn_refusals(wg.quant_wgmma, [(3, 1, 64, 4), (1, 1, 48, 4), (1, 64, 4)])


@pytest.mark.skipif(not _HOPPER, reason="needs an sm_90 GPU (wgmma)")
def test_wgmma_compiled_on_a_hopper_gpu() -> None:
    """On an H100 / H200: every kind and dtype, ragged row counts (masked token rows, several row tiles), a ragged
    column tile, K split (a second launch sums) or not, one to four warpgroups a program, x loaded an iteration
    ahead or not, the MMA synchronous or overlapped (A through shared memory), codes placed by shifts or by three
    operations a word (the same output but for min-kind rounding), Llama-8B widths; equal to the
    reference, and for zero-point weights the operand is the dense 16-bit weight itself (equal to x @
    dequantized-and-rounded W^T in fp32)."""
    g = torch.Generator().manual_seed(0)
    for kind in KINDS:
        w = random_int4_weight(kind, 200, 1024, 256, g, min_scale=0.01)
        w = on_cuda(w)
        for rows in (1, 40, 64, 300):
            for dtype in (torch.bfloat16, torch.float16):
                x = torch.randn(rows, 1024, generator=g).to(dtype).cuda()
                ref = quant_matmul_ref(x.float(), w)
                for tiles, x_ahead, overlap in (((1, 1, 64, 4), False, False), ((1, 2, 64, 2), False, False),
                                                ((2, 1, 128, 1), False, False), ((4, 1, 32, 16), False, False),
                                                ((2, 1, 64, 2), True, False), ((2, 1, 64, 2), False, True),
                                                ((1, 1, 64, 1), True, True)):
                    y = run_kn(wg.quant_wgmma, w, x, tiles=tiles, x_ahead=x_ahead, overlap=overlap)
                    assert rel_error(y, ref) < BOUND[dtype], (kind, rows, dtype, tiles, x_ahead, overlap)
                for tiles in ((2, 1, 64, 2), (1, 2, 32, 4)):  # codes placed by three operations a word
                    y = run_kn(wg.quant_wgmma, w, x, tiles=tiles, codes3=True)
                    if kind == "min":  # (c - 2048 d may round where c - 128 d did not)
                        assert rel_error(y, ref) < BOUND[dtype], (kind, rows, dtype, tiles)
                    else:  # the same operand, bit for bit
                        assert torch.equal(y, run_kn(wg.quant_wgmma, w, x, tiles=tiles, codes3=False)), (kind, rows)
                if kind == "zero":
                    dense = dequantize(w).to(dtype).float()
                    assert rel_error(run_kn(wg.quant_wgmma, w, x), x.float() @ dense.t()) < 2e-3, (rows, dtype)
    for n, k in [(6144, 4096), (4096, 14336)]:
        w = random_int4_weight("zero", n, k, 128, g, min_scale=0.01)
        w = on_cuda(w)
        for rows in (64, 256):
            x = torch.randn(rows, k, generator=g).to(torch.bfloat16).cuda()
            assert rel_error(run_kn(wg.quant_wgmma, w, x), quant_matmul_ref(x.float(), w)) < BOUND[torch.bfloat16]
