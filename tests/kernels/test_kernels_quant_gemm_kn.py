"""The kn layout (engine/quant/kn_layout.py) and its Triton GEMV/GEMM (kernels/quant_gemm_kn.py) against the torch
reference of the same quantized weights, at tiny shapes under Triton's interpreter (re-run in a subprocess with
TRITON_INTERPRET=1); the layout's conversions run on plain CPU torch."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401  (a test dependency: missing triton must fail, not skip)

import kernels.quant_gemm_kn as kn_kernels
from engine.quant.group_quant import KINDS, QuantWeight, dequantize, quant_matmul_ref
from engine.quant.kn_layout import KNWeight, from_kn, kn_codes, pack_kn, to_kn
from engine.quant.quant_layers import QuantEmbedding, QuantLinear
from tests.helpers.interpreter import interpreter_cases_test
from tests.helpers.quant import random_int4_weight

# This module's `triton_interpreter` cases, run in a TRITON_INTERPRET=1 subprocess (tests/helpers/interpreter.py).
test_quant_gemm_kn_under_interpreter = interpreter_cases_test(__file__, at_least=40, at_most=99, timeout=900)


def _weight(kind: str, n: int, k: int, group: int, g: torch.Generator) -> QuantWeight:
    return random_int4_weight(kind, n, k, group, g)


def _gemm(w: QuantWeight, x: torch.Tensor) -> torch.Tensor:
    kn = to_kn(w)
    return kn_kernels.quant_gemm_kn(x, kn.qweight, kn.scales, kn.offsets, KINDS.index(w.kind), w.group_size,
                                    w.out_features)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("group", [32, 64, 128])
def test_kn_layout_round_trips_exactly(kind: str, group: int) -> None:
    w = _weight(kind, 24, 256, group, torch.Generator().manual_seed(group))
    kn = to_kn(w)
    assert kn.qweight.dtype == torch.int32 and kn.qweight.shape == (32, 24) and kn.scales.shape == (256 // group, 24)
    back = from_kn(kn)
    for name in ("qweight", "scales", "mins", "zeros"):
        a, b = getattr(w, name), getattr(back, name)
        assert (a is None and b is None) or torch.equal(a, b), name


def test_kn_word_holds_eight_consecutive_codes() -> None:
    codes = torch.randint(0, 16, (3, 16), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    words = pack_kn(codes)
    assert words.shape == (2, 3)
    assert int((words[1, 2] >> 12) & 0xF) == int(codes[2, 8 + 3])
    assert torch.equal(kn_codes(words), codes)


def test_kn_weight_checks_its_shapes() -> None:
    w = to_kn(_weight("min", 24, 64, 32, torch.Generator().manual_seed(2)))
    with pytest.raises(ValueError, match="kn qweight"):
        KNWeight("min", 32, 24, 64, w.qweight.t().contiguous(), w.scales, w.mins)
    with pytest.raises(ValueError, match="needs mins"):
        KNWeight("min", 32, 24, 64, w.qweight, w.scales)
    with pytest.raises(ValueError, match="4-bit"):
        to_kn(QuantWeight(8, "sym", 32, 2, 32, torch.zeros(2, 32, dtype=torch.int8),
                          torch.zeros(2, 1, dtype=torch.int16)))


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("pairs", [False, True])
def test_kn_gemv_matches_reference(kind: str, group: int, pairs: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """40 columns (a ragged 32-column tile), K = 768: 24 sub-blocks, 6 iterations of 4. On one "SM", 6 programs
    per SM over the 2 column tiles split K in 3, so each split walks 2 iterations. Both GEMV forms: one code per
    shift (1 + q / 16) and two (offsets 256 and 16 taken away per sub-block)."""
    monkeypatch.setattr(kn_kernels, "sm_count", lambda device: 1)
    tiles = (32, 4, 6, 1)
    assert kn_kernels.kn_gemv_tiles(40, 768, 1, tiles)[:3] == (32, 4, 3)
    g = torch.Generator().manual_seed(KINDS.index(kind) * 10 + group)
    w = _weight(kind, 40, 768, group, g)
    x = torch.randn(1, 768, generator=g)
    kn = to_kn(w)
    y = kn_kernels.quant_gemm_kn(x, kn.qweight, kn.scales, kn.offsets, KINDS.index(kind), group, 40,
                                 gemv_tiles=tiles, pairs=pairs)
    assert y.dtype == torch.float32 and y.shape == (1, 40)
    assert _rel(y, quant_matmul_ref(x, w)) < 1e-5


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tiles", [(32, 4, 6, 1), (32, 1, 24, 1)])
def test_kn_gemv_sums_its_splits_in_the_same_launch(kind: str, tiles: tuple[int, int, int, int],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """With `arrivals`, the last program of each column tile sums the K split's partials: same result as the
    separate sum (same order), counters back to zero, so the next call (a CUDA graph replay) starts clean. 2 column
    tiles; K split 3 ways, or 12 (more than SUM_BATCH: two batches of loads, the second masked past the last)."""
    monkeypatch.setattr(kn_kernels, "sm_count", lambda device: 1)
    assert kn_kernels.kn_gemv_tiles(40, 768, 1, tiles)[2] in (3, 12)
    g = torch.Generator().manual_seed(40 + KINDS.index(kind))
    w = _weight(kind, 40, 768, 32, g)
    kn = to_kn(w)
    arrivals = kn_kernels.new_arrivals(40, "cpu")
    assert arrivals.shape == (3,) and not arrivals.any()
    for _ in range(2):
        x = torch.randn(1, 768, generator=g)
        args = (x, kn.qweight, kn.scales, kn.offsets, KINDS.index(kind), 32, 40)
        fused = kn_kernels.quant_gemm_kn(*args, gemv_tiles=tiles, arrivals=arrivals)
        assert torch.equal(fused, kn_kernels.quant_gemm_kn(*args, gemv_tiles=tiles))
        assert _rel(fused, quant_matmul_ref(x, w)) < 1e-5
        assert not arrivals.any()
    with pytest.raises(ValueError, match="arrivals"):
        kn_kernels.quant_gemm_kn(*args, gemv_tiles=tiles, arrivals=torch.zeros(1, dtype=torch.int32))


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("tiles", [(16, 1, 8, 1), (64, 8, 1, 2), (32, 2, 4, 1), None])
@pytest.mark.parametrize("pipeline", [False, True])
def test_kn_gemv_sweep_tiles(tiles: tuple[int, int, int, int] | None, pipeline: bool) -> None:
    """Other tiles (NSUB narrows to divide K's 12 sub-blocks: 8 -> 4), the default tiles on 132 SMs, and loads
    one iteration ahead (the last one masked off)."""
    g = torch.Generator().manual_seed(sum(tiles or ()))
    w = _weight("zero", 40, 384, 128, g)
    x = torch.randn(1, 384, generator=g)
    kn = to_kn(w)
    y = kn_kernels.quant_gemm_kn(x, kn.qweight, kn.scales, kn.offsets, 1, 128, 40, gemv_tiles=tiles,
                                 pipeline=pipeline)
    assert _rel(y, quant_matmul_ref(x, w)) < 1e-5


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 6])
def test_kn_16bit_rows(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(3 + rows)
    w = _weight("min", 40, 384, 32, g)
    x = torch.randn(rows, 384, generator=g).to(dtype)
    y = _gemm(w, x)
    assert y.dtype == dtype
    assert _rel(y, quant_matmul_ref(x.float(), w)) < 1e-2


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("tiles,dtype", [((16, 1, 8, 1), torch.float32), ((64, 8, 1, 2), torch.bfloat16),
                                         ((64, 2, 16, 1), torch.float16)])
def test_kn_gemv_pairs_over_tiles_and_dtypes(tiles: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    """The pair form at one sub-block per iteration, at NSUB narrowed to divide K (8 -> 4) on two warps, and at
    the 64 x 2 tile, from 16-bit x: equal to the one-code form up to fp32 rounding, so within 16-bit output
    rounding of the reference."""
    g = torch.Generator().manual_seed(tiles[0] + tiles[1])
    w = _weight("zero", 72, 384, 128, g)
    x = torch.randn(1, 384, generator=g).to(dtype)
    kn = to_kn(w)
    args = (x, kn.qweight, kn.scales, kn.offsets, 1, 128, 72)
    single = kn_kernels.quant_gemm_kn(*args, gemv_tiles=tiles, pairs=False)
    paired = kn_kernels.quant_gemm_kn(*args, gemv_tiles=tiles, pairs=True)
    assert paired.dtype == dtype
    assert _rel(paired, single.float()) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert _rel(paired, quant_matmul_ref(x.float(), w)) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("kind", KINDS)
def test_kn_gemv_pairs_keep_precision_under_outlier_activations(kind: str) -> None:
    """The pair form's offsets (256 and 16 per code) are taken away after the sums: with a few activations 1000x
    the rest (LLM outlier channels), the fp32 result still matches the reference to 1e-5."""
    g = torch.Generator().manual_seed(7 + KINDS.index(kind))
    w = _weight(kind, 64, 1024, 32, g)
    x = torch.randn(1, 1024, generator=g)
    x[0, torch.randint(0, 1024, (8,), generator=g)] *= 1000
    kn = to_kn(w)
    y = kn_kernels.quant_gemm_kn(x, kn.qweight, kn.scales, kn.offsets, KINDS.index(kind), 32, 64, pairs=True)
    assert _rel(y, quant_matmul_ref(x, w)) < 1e-5


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [2, 20, 40])
def test_kn_gemm_matches_reference(kind: str, rows: int) -> None:
    """K = 384: three 128-element iterations, split 3 ways (132 SMs, few tiles); 40 rows: two M tiles of 32."""
    g = torch.Generator().manual_seed(KINDS.index(kind) + rows)
    w = _weight(kind, 72, 384, 64, g)  # 72 columns: a ragged 64-column tile
    x = torch.randn(rows, 384, generator=g)
    assert kn_kernels.kn_gemm_tiles(rows, 72, 384, 132)[5] == 3
    assert _rel(_gemm(w, x), quant_matmul_ref(x, w)) < 1e-5


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("tiles", [(16, 32, 16, 4, True), (32, 64, 32, 4, True), (16, 64, 16, 2, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kn_gemm_sweep_tiles(tiles: tuple[int, int, int, int, bool], dtype: torch.dtype) -> None:
    """A sweep's tiles; SWAP_AB (the transposed product) runs for 16-bit rows (fp32 rows upcast, unswapped).
    K = 384: three iterations of 128 (16 word rows) or two of 256, the last half masked."""
    g = torch.Generator().manual_seed(20 + tiles[2])
    w = _weight("min", 72, 384, 32, g)
    x = torch.randn(5, 384, generator=g).to(dtype)
    kn = to_kn(w)
    y = kn_kernels.quant_gemm_kn(x, kn.qweight, kn.scales, kn.offsets, 0, 32, 72, gemm_tiles=tiles)
    assert _rel(y, quant_matmul_ref(x.float(), w)) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("kind", KINDS)
def test_kn_dense_path_dequantizes_exactly(kind: str) -> None:
    g = torch.Generator().manual_seed(30 + KINDS.index(kind))
    w = _weight(kind, 40, 256, 64, g)
    kn = to_kn(w)
    for tiles in (None, (8, 32, 1), (32, 64, 2)):  # ragged row and column tiles
        wt = kn_kernels.dequantize_kn(kn.qweight, kn.scales, kn.offsets, KINDS.index(kind), 64, 40, torch.float32,
                                      tiles)
        assert torch.equal(wt, dequantize(w).t())
    x = torch.randn(7, 256, generator=g)
    y = kn_kernels.quant_gemm_kn(x, kn.qweight, kn.scales, kn.offsets, KINDS.index(kind), 64, 40, dense=True)
    assert _rel(y, quant_matmul_ref(x, w)) < 1e-5


@pytest.mark.triton_interpreter
def test_kn_many_rows_take_the_dense_path(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = kn_kernels.dequantize_kn
    monkeypatch.setattr(kn_kernels, "dequantize_kn", lambda *a: calls.append(a) or real(*a))
    g = torch.Generator().manual_seed(31)
    w = _weight("zero", 24, 64, 32, g)
    for rows in (kn_kernels.DEQUANT_MIN_M - 1, kn_kernels.DEQUANT_MIN_M):
        x = torch.randn(rows, 64, generator=g)
        assert _rel(_gemm(w, x), quant_matmul_ref(x, w)) < 1e-5
    assert len(calls) == 1


@pytest.mark.triton_interpreter
def test_kn_gemm_masks_a_partial_iteration(monkeypatch: pytest.MonkeyPatch) -> None:
    """K = 160 is not a multiple of the 128-element iteration: the second iteration is a 32-element remainder."""
    monkeypatch.setattr(kn_kernels, "sm_count", lambda device: 1)
    g = torch.Generator().manual_seed(9)
    w = _weight("min", 24, 160, 32, g)
    x = torch.randn(3, 160, generator=g)
    assert kn_kernels.kn_gemm_tiles(3, 24, 160, 1)[5] == 2
    assert _rel(_gemm(w, x), quant_matmul_ref(x, w)) < 1e-5


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("rows", [1, 4])
def test_quant_linear_in_kn_layout(rows: int) -> None:
    g = torch.Generator().manual_seed(11)
    w = _weight("zero", 40, 256, 128, g)
    bias = torch.randn(40, generator=g)
    layer = QuantLinear(w, bias, layout="kn")
    assert layer.layout == "kn" and layer.qweight.shape == (32, 40)
    assert torch.equal(layer.quant_weight().qweight, w.qweight)
    x = torch.randn(2, rows, 256, generator=g)
    want = quant_matmul_ref(x.reshape(-1, 256), w).view(2, rows, 40) + bias
    assert _rel(layer(x), want) < 1e-5
    layer.use_kernel = False  # the torch reference of the rebuilt canonical weight
    assert _rel(layer(x), want) < 1e-5


def test_quant_linear_layout_choice() -> None:
    w = _weight("min", 8, 64, 32, torch.Generator().manual_seed(12))
    assert QuantLinear(w).layout == "canonical"  # CPU: the compiled CPU kernel reads the canonical layout
    assert QuantLinear(w).arrivals is None
    assert QuantEmbedding(w).linear.layout == "canonical"
    with pytest.raises(ValueError, match="layout"):
        QuantLinear(w, layout="nk")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least 16 columns"):
        kn_kernels.kn_gemv_tiles(64, 64, 132, (8, 2, 8, 1))


def test_quant_gemm_kn_refuses_bad_inputs() -> None:
    kn = to_kn(_weight("min", 24, 64, 32, torch.Generator().manual_seed(13)))
    with pytest.raises(ValueError, match="x must be"):
        kn_kernels.quant_gemm_kn(torch.randn(64), kn.qweight, kn.scales, kn.offsets, 0, 32, 24)
    with pytest.raises(ValueError, match="multiples of 32"):
        kn_kernels.quant_gemm_kn(torch.randn(1, 48), kn.qweight, kn.scales, kn.offsets, 0, 32, 24)
    with pytest.raises(ValueError, match="qweight must be"):
        kn_kernels.quant_gemm_kn(torch.randn(1, 64), kn.qweight.t(), kn.scales, kn.offsets, 0, 32, 24)
    with pytest.raises(ValueError, match="kind"):
        kn_kernels.quant_gemm_kn(torch.randn(1, 64), kn.qweight, kn.scales, kn.offsets, 5, 32, 24)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kn_gemv_compiled_on_a_gpu() -> None:
    """On a GPU machine: the compiled one-row GEMV at its default tiles, its K split summed in the launch, equals
    the reference at Llama-8B widths over groups of 128 and 32."""
    g = torch.Generator().manual_seed(5)
    for group, kind in [(128, "zero"), (32, "min")]:
        for n, k in [(6144, 4096), (4096, 14336)]:
            w = _weight(kind, n, k, group, g)
            kn = to_kn(w)
            args = [t.cuda() for t in (kn.qweight, kn.scales, kn.offsets)]
            arrivals = kn_kernels.new_arrivals(n, "cuda")
            x = torch.randn(1, k, generator=g).to(torch.bfloat16)
            y = kn_kernels.quant_gemm_kn(x.cuda(), *args, KINDS.index(kind), group, n, arrivals=arrivals,
                                         regs=False)  # (bf16 over groups of 128 would take quant_mma_regs)
            assert _rel(y.cpu(), quant_matmul_ref(x.float(), w)) < 4e-3, (group, n, k)
            assert not arrivals.any()
