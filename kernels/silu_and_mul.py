"""SwiGLU activation: x [T, 2I] -> silu(x[:, :I]) * x[:, I:], fp32 math.

Elementwise and memory bound; 2D grid (row, column block) so wide rows spread over many
programs and loads stay contiguous.
"""

from __future__ import annotations

import torch

from kernels._triton import HAS_TRITON, next_pow2, require_triton, tl, triton

__all__ = ["silu_and_mul", "silu_and_mul_ref"]

if HAS_TRITON:

    @triton.jit
    def _silu_and_mul_kernel(X, Out, stride_x, stride_o, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < inter
        gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(X + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(Out + row * stride_o + offs, y.to(Out.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor) -> int:
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [T, 2*I], got {tuple(x.shape)}")
    return x.shape[1] // 2


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, 2I] -> [T, I] = silu(gate) * up, gate = x[:, :I], up = x[:, I:]."""
    require_triton("silu_and_mul")
    inter = _check(x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty((x.shape[0], inter), dtype=x.dtype, device=x.device)
    elif out.shape != (x.shape[0], inter) or out.stride(-1) != 1:
        raise ValueError(f"out must be [T, {inter}] with a contiguous last dim")
    if x.shape[0] == 0 or inter == 0:
        return out
    block = min(1024, next_pow2(inter))
    _silu_and_mul_kernel[(x.shape[0], triton.cdiv(inter, block))](
        x, out, x.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4 if block >= 512 else 1
    )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain torch reference (float32 math, float64 for float64 inputs)."""
    inter = _check(x)
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(cdt)
    return (torch.nn.functional.silu(xf[:, :inter]) * xf[:, inter:]).to(x.dtype)
