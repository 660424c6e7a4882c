"""kernels/quant_mma_regs.py: the Gluon int4 kernel with its MMA operands built in registers. Gluon has no CPU
interpreter, so the kernel itself runs only on a GPU machine; here on any machine: its tile choice and what it
refuses."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401  (a test dependency: missing triton must fail, not skip)

import kernels.quant_mma_regs as regs
from engine.quant.group_quant import KINDS, QuantWeight, quant_matmul_ref
from engine.quant.kn_layout import to_kn
from kernels.quant_gemm_kn import new_arrivals
from tests.helpers.quant import on_cuda, random_int4_weight, rel_error, run_kn

BOUND = {torch.bfloat16: 4e-3, torch.float16: 5e-4}


def _run(w: QuantWeight, x: torch.Tensor, **kw: object) -> torch.Tensor:
    return run_kn(regs.quant_mma_regs, w, x, **kw)


_rel = rel_error


def test_regs_tiles_pad_rows_and_split_whole_groups() -> None:
    assert regs.regs_tiles(1, 4096, 4096, 132, (1, 4, 8)) == (1, 4, 8, 16, 256)  # 64 tiles x 16 splits
    assert regs.regs_tiles(13, 4096, 512, 132, (1, 4, 8))[2:4] == (16, 4)  # 16 rows; never more splits than groups
    assert regs.regs_tiles(33, 28672, 4096, 132, (1, 2, 4))[2:] == (64, 1, 4096)  # 896 tiles fill the GPU


def test_regs_refuses_what_it_does_not_take() -> None:
    kn = to_kn(random_int4_weight("zero", 32, 256, 128, torch.Generator().manual_seed(1)))
    args = (kn.qweight, kn.scales, kn.offsets, 1, 128, 32)
    assert not regs.regs_supported(torch.float32, 128, 256) and not regs.regs_supported(torch.bfloat16, 32, 256)
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        regs.quant_mma_regs(x, *args)
    for bad, match in [({"x": torch.randn(1, 256)}, "bf16 / fp16"), ({"x": torch.randn(65, 256).bfloat16()}, "rows"),
                       ({"stages": 1}, "stages"), ({"ahead": 3}, "ahead"), ({"group_size": 64}, "group_size"),
                       ({"kind": 5}, "kind")]:
        kw = {"x": x, "qweight": kn.qweight, "scales": kn.scales, "offsets": kn.offsets, "kind": 1,
              "group_size": 128, "out_features": 32} | bad
        with pytest.raises(ValueError, match=match):
            regs.quant_mma_regs(**kw)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_regs_compiled_on_a_gpu() -> None:
    """On a GPU machine: every kind and dtype, ragged row counts (masked token rows), a ragged column tile, K
    split with the sum in the same launch and in a second one, words prefetched into registers (1 or 2
    iterations ahead) or through a cp.async ring, q - z as the operand or the sum of x, Llama-8B widths (the
    engine's defaults); equal to the reference."""
    g = torch.Generator().manual_seed(0)
    for kind in KINDS:
        w = random_int4_weight(kind, 200, 1024, 256, g, min_scale=0.01)
        w = on_cuda(w)
        arrivals = new_arrivals(200, "cuda")
        for rows in (1, 13, 64):
            for dtype in (torch.bfloat16, torch.float16):
                x = torch.randn(rows, 1024, generator=g).to(dtype).cuda()
                ref = quant_matmul_ref(x.float(), w)
                for kw in ({"tiles": (1, 4, 8)}, {"tiles": (2, 2, 16), "ahead": 2}, {"tiles": (1, 1, 2), "stages": 3},
                           {"tiles": (4, 2, 8), "stages": 4, "subz": True}, {"tiles": (2, 1, 4), "subz": True}):
                    fused = _run(w, x, arrivals=arrivals, **kw)
                    assert not arrivals.any()
                    assert _rel(fused, ref) < BOUND[dtype], (kind, rows, dtype, kw)
                    assert torch.equal(fused, _run(w, x, **kw)), (kind, rows, dtype, kw)
    for n, k in [(6144, 4096), (4096, 14336)]:
        w = random_int4_weight("zero", n, k, 128, g, min_scale=0.01)
        w = on_cuda(w)
        for rows in (1, 16, 64):
            x = torch.randn(rows, k, generator=g).to(torch.bfloat16).cuda()
            y = _run(w, x, arrivals=new_arrivals(n, "cuda"))
            assert _rel(y, quant_matmul_ref(x.float(), w)) < BOUND[torch.bfloat16], (n, k, rows)
