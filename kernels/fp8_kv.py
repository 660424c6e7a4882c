"""fp8 (e4m3) KV cache values: quantize with a per-tensor scale (x / scale, saturated at +-448, round to nearest
even) and dequantize (q * scale). The torch functions are the reference; `round_to_e4m3` is the Triton side.

The Triton kernels round in fp32 onto the e4m3 grid themselves before the (then exact) `.to(fp8)`: Triton's CPU
interpreter (3.9) mis-rounds fp32 -> fp8 conversions whose rounding carries into the exponent (7.93 -> 4.0), so
an explicit rounding keeps the interpreter and the GPU on the same bits as torch.
"""

from __future__ import annotations

import torch

from kernels._triton import HAS_TRITON, tl, triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(q: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


if HAS_TRITON:

    @triton.jit
    def round_to_e4m3(x):
        """fp32 -> the nearest e4m3 value (ties to even), saturated at +-448, still as fp32."""
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
        bits = x.to(tl.int32, bitcast=True)
        exp = ((bits >> 23) & 0xFF) - 127
        exp = tl.maximum(exp, -6)  # e4m3's subnormals share the ulp of its smallest normal binade
        ulp = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)
        y = tl.abs(x) / ulp  # exact (power of two), < 16
        y = (y + 12582912.0) - 12582912.0  # 1.5 * 2**23: round to the nearest integer, ties to even
        return tl.where(bits < 0, -y, y) * ulp  # the sign bit kept (-1e-4 -> -0, as torch)
