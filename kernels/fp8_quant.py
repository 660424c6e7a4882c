"""Dynamic per-token fp8 (e4m3) quantization of activations, one Triton launch: x [M, K] -> (q [M, K] e4m3,
scale [M, 1] float32) with scale = max(|x_row|) * float32(1 / 448) (at least MIN_SCALE) and q = e4m3(x / scale).

The torch reference (engine/quant/fp8_linear.py `quantize_per_token`) takes six kernels and float32 temporaries of
the whole activation: on a Llama-8B prefill of 8,192 tokens that is ~1.5 ms per linear, as much as the fp8 GEMM
saves; in a decode step six launches per linear. Here each row is read twice (amax, then quantize: the second
read comes from L2) and written once, with the reference's arithmetic: the same fp32 product for the scale, a
correctly rounded fp32 division, and e4m3 rounding to nearest even, saturated. On a GPU the rounding is the
hardware's convert (as torch's own cast); elsewhere (Triton's interpreter) `round_to_e4m3` spells it out, since the
interpreter's cast does not round to nearest. tests/kernels/test_kernels_fp8.py holds the interpreter to the reference bit
for bit; bench/quant_gpu.py (part w8a8_layers) counts differing codes on the GPU.
"""

from __future__ import annotations

import torch

from kernels._triton import HAS_TRITON, next_pow2, require_triton, tl, triton
from kernels.fp8_kv import FP8_DTYPE, FP8_MAX

__all__ = ["per_token_quant_fp8", "MIN_SCALE"]

MIN_SCALE = 1e-12  # an all-zero row still gets a finite scale (the reference's clamp)
INV_FP8_MAX = float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))  # scale = amax * this (float32 product)

if HAS_TRITON:
    from kernels.fp8_kv import round_to_e4m3

    @triton.jit
    def _to_e4m3(x, HW_CAST: tl.constexpr):
        if HW_CAST:  # cvt.rn.satfinite: nearest even, saturated at +-448
            return x.to(tl.float8e4nv)
        return round_to_e4m3(x).to(tl.float8e4nv)

    @triton.jit
    def _per_token_quant_kernel(X, Q, Scale, K, stride_xm, stride_qm, min_scale, inv_max, BLOCK: tl.constexpr,
                                ONE_PASS: tl.constexpr, HW_CAST: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = X + row * stride_xm
        q_row = Q + row * stride_qm
        offs = tl.arange(0, BLOCK)
        if ONE_PASS:  # the whole row fits one tile: read it once
            mask = offs < K
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(x), axis=0) * inv_max, min_scale)
            tl.store(Scale + row, scale)
            tl.store(q_row + offs, _to_e4m3(tl.math.div_rn(x, scale), HW_CAST), mask=mask)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                mask = k0 + offs < K
                amax = tl.maximum(amax, tl.abs(tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)))
            scale = tl.maximum(tl.max(amax, axis=0) * inv_max, min_scale)
            tl.store(Scale + row, scale)
            for k0 in range(0, K, BLOCK):
                mask = k0 + offs < K
                x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
                tl.store(q_row + k0 + offs, _to_e4m3(tl.math.div_rn(x, scale), HW_CAST), mask=mask)


def per_token_quant_fp8(x: torch.Tensor, max_block: int = 4096,
                        hw_cast: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16 / fp16 / fp32, contiguous last dim) -> (e4m3 [M, K], float32 scales [M, 1]).
    `hw_cast` (default: on a GPU) rounds with the hardware convert instead of `round_to_e4m3`."""
    require_triton("fp8_quant")
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [M, K] with a contiguous last dim, got {tuple(x.shape)}")
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    block = min(next_pow2(k), max_block)
    _per_token_quant_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), MIN_SCALE, INV_FP8_MAX, BLOCK=block,
                                  ONE_PASS=block >= k,
                                  HW_CAST=x.is_cuda if hw_cast is None else hw_cast, num_warps=8 if block >= 2048 else 4)
    return q, scale
