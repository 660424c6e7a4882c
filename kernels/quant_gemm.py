"""Group-quantized weight-only GEMM/GEMV on the GPU (Triton): y[M, N] = x[M, K] W^T with W in the canonical
layout of engine/quant/group_quant.py (4-bit: GGUF-ordered nibbles in 32-element sub-blocks with float16 scales
and a float16 min or uint8 zero per group; 8-bit: int8 with a float16 scale per group), dequantized tile by tile
in registers: the weight is read once, at 4 (or 8) bits per value.

One kernel serves decode (M = 1: a GEMV whose M tile is padded to tl.dot's minimum of 16, still bound by the
weight read) and larger batches (a GEMM). Reference: `engine.quant.group_quant.quant_matmul_ref`.
"""

from __future__ import annotations

import torch

from kernels._triton import HAS_TRITON, dot_needs_upcast, require_triton, tl, triton

__all__ = ["quant_gemm"]

KIND_MIN, KIND_ZERO, KIND_SYM = 0, 1, 2

if HAS_TRITON:

    @triton.jit
    def _quant_gemm_kernel(
        X, Q, S, Off, Y,
        M, N, K,
        stride_xm, stride_qn, stride_sn, stride_ym,
        GROUP: tl.constexpr,
        BITS: tl.constexpr,
        KIND: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SUB: tl.constexpr,  # 32-element sub-blocks per iteration
        UPCAST: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        # Column c of a half-tile is element 32 * (c // 16) + c % 16 of the iteration's K range (the "low"
        # half: each sub-block's first 16); the "high" half is the same + 16. For 4 bits, column c's byte holds
        # both (low nibble, high nibble), at byte offset c of the iteration's packed range.
        offs_c = tl.arange(0, 16 * SUB)
        elem_lo = 32 * (offs_c // 16) + offs_c % 16
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm
        q_rows = Q + offs_n.to(tl.int64)[:, None] * stride_qn
        s_rows = offs_n.to(tl.int64)[:, None] * stride_sn
        w_mask = n_mask[:, None]
        for k0 in range(0, K, 32 * SUB):
            grp = (k0 + elem_lo) // GROUP  # [16 * SUB]: both halves of a sub-block share its group
            d = tl.load(S + s_rows + grp[None, :], mask=w_mask, other=0).to(tl.float16, bitcast=True)
            d = d.to(tl.float32)
            x_lo = tl.load(x_rows + k0 + elem_lo[None, :], mask=m_mask[:, None], other=0.0)
            x_hi = tl.load(x_rows + k0 + 16 + elem_lo[None, :], mask=m_mask[:, None], other=0.0)
            if BITS == 4:
                byte = tl.load(q_rows + k0 // 2 + offs_c[None, :], mask=w_mask, other=0)
                lo = (byte & 0x0F).to(tl.float32)
                hi = (byte >> 4).to(tl.float32)
            else:
                lo = tl.load(q_rows + k0 + elem_lo[None, :], mask=w_mask, other=0).to(tl.float32)
                hi = tl.load(q_rows + k0 + 16 + elem_lo[None, :], mask=w_mask, other=0).to(tl.float32)
            if KIND == 0:
                mn = tl.load(Off + s_rows + grp[None, :], mask=w_mask, other=0).to(tl.float16, bitcast=True)
                mn = mn.to(tl.float32)
                w_lo = d * lo + mn
                w_hi = d * hi + mn
            elif KIND == 1:
                z = tl.load(Off + s_rows + grp[None, :], mask=w_mask, other=0).to(tl.float32)
                w_lo = (lo - z) * d
                w_hi = (hi - z) * d
            else:
                w_lo = lo * d
                w_hi = hi * d
            if UPCAST:
                x_lo = x_lo.to(tl.float32)
                x_hi = x_hi.to(tl.float32)
                acc += tl.dot(x_lo, tl.trans(w_lo), input_precision="ieee")
                acc += tl.dot(x_hi, tl.trans(w_hi), input_precision="ieee")
            else:
                acc += tl.dot(x_lo, tl.trans(w_lo.to(x_lo.dtype)))
                acc += tl.dot(x_hi, tl.trans(w_hi.to(x_hi.dtype)))
        y_ptr = Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def quant_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
               bits: int, kind: int, group_size: int, out_features: int) -> torch.Tensor:
    """x [M, K] (fp32 / bf16 / fp16, contiguous last dim) @ W^T -> [M, N] in x's dtype."""
    require_triton("quant_gemm")
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [M, K] with a contiguous last dim, got {tuple(x.shape)}")
    m, k = x.shape
    if k % 32 or group_size % 32 or k % group_size:
        raise ValueError(f"K={k} and group_size={group_size} must be multiples of 32 (group_size dividing K)")
    if bits not in (4, 8) or kind not in (KIND_MIN, KIND_ZERO, KIND_SYM):
        raise ValueError(f"unsupported bits={bits} / kind={kind}")
    y = torch.empty(m, out_features, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    fp32 = x.dtype == torch.float32
    block_m = 16 if m <= 16 else (32 if fp32 else 64)
    block_n = 32 if m <= 16 else 64  # decode: more programs over N to keep every SM reading weights
    sub = next(s for s in (4, 2, 1) if (k // 32) % s == 0)
    offs = offsets if offsets is not None and offsets.numel() else scales  # unused placeholder for "sym"
    grid = (triton.cdiv(m, block_m), triton.cdiv(out_features, block_n))
    _quant_gemm_kernel[grid](
        x, qweight, scales, offs, y, m, out_features, k,
        x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
        GROUP=group_size, BITS=bits, KIND=kind, BLOCK_M=block_m, BLOCK_N=block_n, SUB=sub,
        UPCAST=fp32 or dot_needs_upcast(x.dtype), num_warps=4,
    )
    return y
