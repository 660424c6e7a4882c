"""The tensor-core int4 kernel (kernels/quant_mma_kn.py) against the torch reference of the same quantized weights:
tiny shapes under Triton's interpreter (re-run in a subprocess with TRITON_INTERPRET=1), and on a GPU machine the
compiled kernel with its PTX-paired codes. bf16 outputs are compared at twice bf16's rounding, which is what the
interpreter's truncating cast to bf16 gives the existing kn kernels too."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401  (a test dependency: missing triton must fail, not skip)

import kernels.quant_mma_kn as mma
from engine.quant.group_quant import KINDS, QuantWeight, fp16_bits, pack_int4, quant_matmul_ref
from engine.quant.kn_layout import to_kn
from kernels.quant_gemm_kn import new_arrivals
from tests.helpers.interpreter import interpreter_cases_test
from tests.helpers.quant import random_int4_weight, rel_error, run_kn

test_quant_mma_kn_under_interpreter = interpreter_cases_test(__file__, at_least=20, at_most=40, timeout=900)

BOUND = {torch.bfloat16: 8e-3, torch.float16: 1e-3}


def _weight(kind: str, n: int, k: int, group: int, g: torch.Generator) -> QuantWeight:
    return random_int4_weight(kind, n, k, group, g, min_scale=0.01)


def _run(w: QuantWeight, x: torch.Tensor, **kw: object) -> torch.Tensor:
    return run_kn(mma.quant_mma_kn, w, x, **kw)


_rel = rel_error


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 20])
def test_mma_matches_reference(kind: str, dtype: torch.dtype, rows: int) -> None:
    """40 columns (a ragged 32-column tile), K = 512 in groups of 128 (four iterations, one group each), split
    in 2 (two groups per program); 20 rows are two row tiles of 16."""
    g = torch.Generator().manual_seed(KINDS.index(kind) * 7 + rows)
    w = _weight(kind, 40, 512, 128, g)
    x = torch.randn(rows, 512, generator=g).to(dtype)
    y = _run(w, x, tiles=(16, 32, 4, 2))
    assert y.dtype == dtype and y.shape == (rows, 40)
    assert _rel(y, quant_matmul_ref(x.float(), w)) < BOUND[dtype]


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("group", [256, 512])
def test_mma_groups_wider_than_an_iteration(group: int) -> None:
    """A group spans several 128-element iterations: each uses its group's scale and zero."""
    g = torch.Generator().manual_seed(group)
    w = _weight("zero", 24, 512, group, g)
    x = torch.randn(3, 512, generator=g).to(torch.bfloat16)
    assert _rel(_run(w, x, tiles=(16, 16, 4, 1)), quant_matmul_ref(x.float(), w)) < BOUND[torch.bfloat16]


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("rows", [1, 16])
def test_mma_sums_its_splits_in_the_same_launch(rows: int) -> None:
    """With `arrivals` and one row tile, the last program of each column tile sums the split's partials: equal
    to the separate sum (same order), counters back to zero for the next call (a CUDA graph replay)."""
    g = torch.Generator().manual_seed(50 + rows)
    w = _weight("zero", 40, 768, 128, g)
    arrivals = new_arrivals(40, "cpu")
    for _ in range(2):
        x = torch.randn(rows, 768, generator=g).to(torch.bfloat16)
        fused = _run(w, x, tiles=(16, 32, 4, 3), arrivals=arrivals)
        assert torch.equal(fused, _run(w, x, tiles=(16, 32, 4, 3)))
        assert _rel(fused, quant_matmul_ref(x.float(), w)) < BOUND[torch.bfloat16]
        assert not arrivals.any()
    with pytest.raises(ValueError, match="arrivals"):
        _run(w, x, tiles=(16, 32, 4, 3), arrivals=torch.zeros(1, dtype=torch.int32))


@pytest.mark.triton_interpreter
def test_mma_keeps_precision_under_outlier_activations() -> None:
    """The offset (128 + q) is taken away per group in fp32, after the products: a few activations 1000x the
    others (LLMs' outlier channels) do not swamp the small ones' share."""
    g = torch.Generator().manual_seed(9)
    w = _weight("zero", 32, 256, 128, g)
    x = torch.randn(2, 256, generator=g)
    x[:, ::37] *= 1000
    x = x.to(torch.bfloat16)
    assert _rel(_run(w, x, tiles=(16, 32, 4, 1)), quant_matmul_ref(x.float(), w)) < BOUND[torch.bfloat16]


def test_mma_tiles_split_whole_groups() -> None:
    assert mma.mma_tiles(1, 4096, 4096, 132) == (16, 128, 4, 16)  # 32 column tiles x 16 splits = 4 per SM
    assert mma.mma_tiles(1, 4096, 512, 132)[3] == 4  # never more splits than iterations
    assert mma.mma_tiles(300, 4096, 4096, 132, (128, 128, 8, 2))[3] == 2


def test_mma_refuses_what_it_does_not_take() -> None:
    kn = to_kn(_weight("zero", 24, 256, 128, torch.Generator().manual_seed(1)))
    args = (kn.qweight, kn.scales, kn.offsets, 1, 128, 24)
    assert not mma.mma_supported(torch.float32, 128, 256) and not mma.mma_supported(torch.bfloat16, 32, 256)
    with pytest.raises(ValueError, match="bf16 / fp16"):
        mma.quant_mma_kn(torch.randn(1, 256), *args)
    with pytest.raises(ValueError, match="x must be"):
        mma.quant_mma_kn(torch.randn(256, dtype=torch.bfloat16), *args)
    with pytest.raises(ValueError, match="qweight must be"):
        mma.quant_mma_kn(torch.randn(1, 256, dtype=torch.bfloat16), kn.qweight.t(), *args[1:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mma_compiled_on_a_gpu() -> None:
    """On a GPU machine: the compiled kernel (wgmma, codes paired by PTX, and the compiler's own codes) equals
    the reference at 1 / 16 / 64 / 200 rows and at Llama-8B widths."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, k in [(6144, 4096), (4096, 14336), (200, 384)]:
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8, device="cuda")
        w = QuantWeight(4, "zero", 128, n, k, pack_int4(q),
                        fp16_bits(torch.rand(n, k // 128, generator=g, device="cuda") * 0.01 + 0.001),
                        zeros=torch.randint(0, 16, (n, k // 128), generator=g, dtype=torch.uint8, device="cuda"))
        arrivals = new_arrivals(n, "cuda")
        for rows in (1, 16, 64, 200):
            for dtype in (torch.bfloat16, torch.float16):
                x = torch.randn(rows, k, generator=g, device="cuda").to(dtype)
                ref = quant_matmul_ref(x.float(), w)
                for paired in (True, False):
                    y = _run(w, x, paired=paired, arrivals=arrivals)
                    assert _rel(y, ref) < BOUND[dtype] / 2, (n, k, rows, dtype, paired)
                    assert not arrivals.any()
