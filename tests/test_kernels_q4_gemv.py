"""The 4-bit single-row GEMV (kernels/q4_gemv.py) against the torch reference of the same quantized weights, at
tiny shapes under Triton's interpreter (re-run in a subprocess with TRITON_INTERPRET=1)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton  # noqa: F401  (a test dependency: missing triton must fail, not skip)

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import kernels.q4_gemv as q4  # noqa: E402
from engine.quant.group_quant import KINDS, QuantWeight, fp16_bits, pack_int4, quant_matmul_ref  # noqa: E402


@pytest.mark.outside_interpreter
def test_q4_gemv_under_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).resolve())]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    assert re.search(r"\b(1[6-9]|[2-9]\d) passed", proc.stdout), proc.stdout[-2000:]


def _weight(kind: str, n: int, k: int, group: int, g: torch.Generator) -> QuantWeight:
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = fp16_bits(torch.rand(n, k // group, generator=g) * 0.1)
    if kind == "min":
        return QuantWeight(4, kind, group, n, k, pack_int4(q), scales,
                           mins=fp16_bits(-torch.rand(n, k // group, generator=g)))
    if kind == "zero":
        return QuantWeight(4, kind, group, n, k, pack_int4(q), scales,
                           zeros=torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.uint8))
    return QuantWeight(4, kind, group, n, k, pack_int4(q), scales)


def _run(w: QuantWeight, x: torch.Tensor, **kw: object) -> torch.Tensor:
    off = w.mins if w.mins is not None else (w.zeros if w.zeros is not None else w.scales)
    return q4.q4_gemv(x, w.qweight, w.scales, off, KINDS.index(w.kind), w.group_size, w.out_features, **kw)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("kind", KINDS)
def test_q4_gemv_matches_reference(kind: str, group: int, prefetch: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """40 rows (a ragged 16-row tile), K = 768: 24 sub-blocks, 3 iterations of 8. One "SM" makes the default 8
    programs per SM split K in two, so a split walks several iterations (and prefetches past its end)."""
    monkeypatch.setattr(q4, "sm_count", lambda device: 1)
    assert q4.q4_gemv_tiles(40, 768, 1) == (16, 8, 2, 4)
    g = torch.Generator().manual_seed(KINDS.index(kind) * 10 + group)
    w = _weight(kind, 40, 768, group, g)
    x = torch.randn(1, 768, generator=g)
    y = _run(w, x, prefetch=prefetch)
    assert y.dtype == torch.float32 and y.shape == (1, 40)
    assert _rel(y, quant_matmul_ref(x, w)) < 1e-5


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_q4_gemv_16bit_rows(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    w = _weight("min", 40, 384, 32, g)
    x = torch.randn(1, 384, generator=g).to(dtype)
    y = _run(w, x)
    assert y.dtype == dtype
    assert _rel(y, quant_matmul_ref(x.float(), w)) < 1e-2


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("tiles", [(8, 2, 8, 2), (32, 4, 1, 4), (16, 16, 8, 4)])
def test_q4_gemv_sweep_tiles(tiles: tuple[int, int, int, int]) -> None:
    """A sweep's tiles: NSUB narrows to divide K's 12 sub-blocks (16 -> 4); one program per SM leaves K whole."""
    g = torch.Generator().manual_seed(sum(tiles))
    w = _weight("zero", 40, 384, 128, g)
    x = torch.randn(1, 384, generator=g)
    assert _rel(_run(w, x, tiles=tiles, prefetch=True), quant_matmul_ref(x, w)) < 1e-5


@pytest.mark.triton_interpreter
def test_q4_gemv_writes_into_y() -> None:
    g = torch.Generator().manual_seed(5)
    w = _weight("sym", 24, 64, 32, g)
    x = torch.randn(1, 64, generator=g)
    y = torch.full((1, 24), float("nan"))
    assert _run(w, x, y=y) is y
    assert _rel(y, quant_matmul_ref(x, w)) < 1e-5


def test_q4_gemv_tiles_fill_the_gpu() -> None:
    # Llama-8B decode shapes on 132 SMs: 4096 outputs are 256 16-row tiles, so K splits to ~8 programs per SM;
    # gate/up's 1,792 tiles need no split; NSUB narrows to divide K's sub-blocks.
    assert q4.q4_gemv_tiles(4096, 4096, 132) == (16, 8, 8 * 132 // 256, 4)
    assert q4.q4_gemv_tiles(28672, 4096, 132)[2] == 1
    assert q4.q4_gemv_tiles(40, 96, 132)[1:3] == (1, 3)
    assert q4.q4_gemv_tiles(40, 384, 132, (32, 16, 1, 8)) == (32, 4, 3, 8)


def test_q4_gemv_refuses_bad_shapes() -> None:
    g = torch.Generator().manual_seed(6)
    w = _weight("min", 24, 64, 32, g)
    with pytest.raises(ValueError, match="x must be"):
        _run(w, torch.randn(2, 64))
    with pytest.raises(ValueError, match="multiples of 32"):
        q4.q4_gemv(torch.randn(1, 48), w.qweight, w.scales, w.mins, 0, 32, 24)
    with pytest.raises(ValueError, match="qweight must be"):
        q4.q4_gemv(torch.randn(1, 64), w.qweight[:, :16], w.scales, w.mins, 0, 32, 24)
