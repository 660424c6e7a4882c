"""RMSNorm and the fused residual-add + RMSNorm (vLLM semantics), fp32 internally.

One program per row; the whole row sits in registers (hidden sizes up to 64K), so each
element is read once and written once: the fused variant moves 2 reads + 2 writes per
element instead of the 3 + 2 of an add followed by a norm.
"""

from __future__ import annotations

import torch

from kernels._triton import (
    HAS_TRITON,
    next_pow2,
    pdl_launch,
    pdl_wait,
    require_triton,
    tl,
    triton,
)

__all__ = ["rms_norm", "fused_add_rms_norm", "rms_norm_ref", "fused_add_rms_norm_ref"]

_MAX_N = 65536

if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(
        X,
        Res,
        W,
        Out,
        stride_x,
        stride_r,
        stride_o,
        N,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x += tl.load(Res + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
            # The stored residual is rounded to its dtype; the norm uses the fp32 sum (as vLLM).
            tl.store(Res + row * stride_r + offs, x.to(Res.dtype.element_ty), mask=mask)
        var = tl.sum(x * x, axis=0) / N
        rstd = 1.0 / tl.sqrt(var + eps)
        w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(Out + row * stride_o + offs, (x * rstd * w).to(Out.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, N], got {tuple(x.shape)}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"weight must be [N={x.shape[1]}], got {tuple(weight.shape)}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x "
                             f"{tuple(x.shape)} {x.dtype}")
        if residual.device != x.device:
            raise ValueError("residual and x are on different devices")
    if weight.device != x.device:
        raise ValueError("weight and x are on different devices")


def _launch(x: torch.Tensor, res: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor,
            eps: float) -> None:
    num_rows, n = x.shape
    if num_rows == 0:
        return
    if n > _MAX_N:
        raise ValueError(f"hidden size {n} > {_MAX_N} is not supported")
    block = next_pow2(n)
    _rms_norm_kernel[(num_rows,)](
        x,
        res if res is not None else x,
        weight,
        out,
        x.stride(0),
        res.stride(0) if res is not None else 0,
        out.stride(0),
        n,
        float(eps),
        HAS_RESIDUAL=res is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
        **pdl_launch(x.device),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """out = x / sqrt(mean(x^2) + eps) * weight, row-wise over x [T, N]."""
    require_triton("rms_norm")
    _check(x, weight)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.stride(-1) != 1:
        raise ValueError("out must match x's shape, with a contiguous last dim")
    _launch(x, None, weight.contiguous(), out, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual += x; x = rms_norm(residual) * weight. Returns (x, residual)."""
    require_triton("fused_add_rms_norm")
    _check(x, weight, residual)
    if x.stride(-1) != 1 or residual.stride(-1) != 1:
        raise ValueError("fused_add_rms_norm works in place: x and residual need a contiguous last dim")
    _launch(x, residual, weight.contiguous(), x, eps)
    return x, residual


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain torch reference (float32 math, float64 for float64 inputs)."""
    _check(x, weight)
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(cdt)
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * rstd * weight.to(cdt)).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch reference with the same in-place contract as ``fused_add_rms_norm``."""
    _check(x, weight, residual)
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    s = x.to(cdt) + residual.to(cdt)
    residual.copy_(s)
    rstd = torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps)
    x.copy_(s * rstd * weight.to(cdt))
    return x, residual
