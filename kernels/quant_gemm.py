"""Group-quantized weight-only GEMM/GEMV on the GPU (Triton): y[M, N] = x[M, K] W^T with W in the canonical
layout of engine/quant/group_quant.py (4-bit: GGUF-ordered nibbles in 32-element sub-blocks with float16 scales
and a float16 min or uint8 zero per group; 8-bit: int8 with a float16 scale per group), dequantized tile by tile
in registers: the weight is read once, at 4 (or 8) bits per value.

Two kernels. Single rows (and fp32 batches up to GEMV_MAX_M) take a GEMV: no tl.dot (whose M tile would pad to
16), products accumulated elementwise and reduced once at the end, and K split across programs so that even a
4096-row weight keeps every SM streaming (the first version, one program per 32 rows walking all of K, read 4-bit weights at
~110 GB/s on an H100: 0.13x bf16's tok/s). Split partials land in an fp32 buffer summed afterwards. Larger batches
take the GEMM. Reference: `engine.quant.group_quant.quant_matmul_ref`.
"""

from __future__ import annotations

import torch

from kernels._triton import HAS_TRITON, dot_needs_upcast, require_triton, sm_count, tl, triton

__all__ = ["quant_gemm"]

KIND_MIN, KIND_ZERO, KIND_SYM = 0, 1, 2
GEMV_MAX_M = 8
# Split K until about this many programs per SM are in flight (a sweep of tiles x splits on an H100, Llama-8B
# decode shapes: 16-row tiles of 128 elements with 8 programs per SM read 4-bit weights at 765 GB/s at M = 1,
# 32-row tiles with 4 per SM at 470; at M = 8, 4 per SM was best).
GEMV_PROGRAMS_PER_SM = 8
GEMV_PROGRAMS_PER_SM_BATCHED = 4
GEMM_PROGRAMS_PER_SM = 4

if HAS_TRITON:

    @triton.jit
    def _load_codes(q_rows, k0, offs_c, elem_lo, w_mask, BITS: tl.constexpr):
        """The integer codes of one iteration's two half-tiles, as float32: for 4 bits each byte of the packed
        range holds column c's low-half element (low nibble) and its high-half partner (high nibble); 8-bit codes
        are one byte each."""
        if BITS == 4:
            byte = tl.load(q_rows + k0 // 2 + offs_c[None, :], mask=w_mask, other=0)
            lo = (byte & 0x0F).to(tl.float32)
            hi = (byte >> 4).to(tl.float32)
        else:
            lo = tl.load(q_rows + k0 + elem_lo[None, :], mask=w_mask, other=0).to(tl.float32)
            hi = tl.load(q_rows + k0 + 16 + elem_lo[None, :], mask=w_mask, other=0).to(tl.float32)
        return lo, hi


    @triton.jit
    def _quant_gemm_kernel(
        X, Q, S, Off, Y,
        M, N, K, K_PER_SPLIT,
        stride_xm, stride_qn, stride_sn, stride_ym, stride_ys,
        GROUP: tl.constexpr,
        BITS: tl.constexpr,
        KIND: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SUB: tl.constexpr,  # 32-element sub-blocks per iteration
        UPCAST: tl.constexpr,
        META_PER_SUB: tl.constexpr = True,
        SWAP_AB: tl.constexpr = False,
    ):
        """Y [M, N] = X @ W^T, or with K split (program axis 2) each split's fp32 partial at Y + split * stride_ys.

        META_PER_SUB loads each row's scale (and min / zero) once per 32-element sub-block and broadcasts it over
        the sub-block's 16 columns of each half-tile (else: gathered per column, 16x the loads). SWAP_AB computes
        Y^T = W X^T: the dequantized weight tile is the dot's first operand, which Hopper's MMAs may read from
        registers, so it skips the round trip through shared memory that the second operand takes (and the
        tile's rows, few at decode, become the MMA's narrow side)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_s = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        # Column c of a half-tile is element 32 * (c // 16) + c % 16 of the iteration's K range (the "low"
        # half: each sub-block's first 16); the "high" half is the same + 16. For 4 bits, column c's byte holds
        # both (low nibble, high nibble), at byte offset c of the iteration's packed range.
        offs_c = tl.arange(0, 16 * SUB)
        elem_lo = 32 * (offs_c // 16) + offs_c % 16
        sub = tl.arange(0, SUB)
        if SWAP_AB:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm
        q_rows = Q + offs_n.to(tl.int64)[:, None] * stride_qn
        s_rows = offs_n.to(tl.int64)[:, None] * stride_sn
        w_mask = n_mask[:, None]
        k_start = pid_s * K_PER_SPLIT
        for k0 in range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), 32 * SUB):
            # [SUB] per sub-block, or [16 * SUB] per column (both halves of a sub-block share its group)
            grp = (k0 + 32 * sub) // GROUP if META_PER_SUB else (k0 + elem_lo) // GROUP
            d = _meta_cols(tl.load(S + s_rows + grp[None, :], mask=w_mask, other=0).to(tl.float16, bitcast=True),
                           BLOCK_N, SUB, META_PER_SUB)
            x_lo = tl.load(x_rows + k0 + elem_lo[None, :], mask=m_mask[:, None], other=0.0)
            x_hi = tl.load(x_rows + k0 + 16 + elem_lo[None, :], mask=m_mask[:, None], other=0.0)
            lo, hi = _load_codes(q_rows, k0, offs_c, elem_lo, w_mask, BITS)
            if KIND == 0:
                mn = tl.load(Off + s_rows + grp[None, :], mask=w_mask, other=0).to(tl.float16, bitcast=True)
                mn = _meta_cols(mn, BLOCK_N, SUB, META_PER_SUB)
                w_lo = d * lo + mn
                w_hi = d * hi + mn
            elif KIND == 1:
                z = _meta_cols(tl.load(Off + s_rows + grp[None, :], mask=w_mask, other=0), BLOCK_N, SUB,
                               META_PER_SUB)
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
            elif SWAP_AB:
                acc += tl.dot(w_lo.to(x_lo.dtype), tl.trans(x_lo))
                acc += tl.dot(w_hi.to(x_hi.dtype), tl.trans(x_hi))
            else:
                acc += tl.dot(x_lo, tl.trans(w_lo.to(x_lo.dtype)))
                acc += tl.dot(x_hi, tl.trans(w_hi.to(x_hi.dtype)))
        y_ptr = Y + pid_s.to(tl.int64) * stride_ys + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        out = tl.trans(acc) if SWAP_AB else acc
        tl.store(y_ptr, out.to(Y.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

    @triton.jit
    def _meta_cols(v, BLOCK_N: tl.constexpr, SUB: tl.constexpr, PER_SUB: tl.constexpr):
        """A scale / min / zero tile as float32 per half-tile column: [BLOCK_N, SUB] broadcast over each
        sub-block's 16 columns, or already per column."""
        v = v.to(tl.float32)
        if PER_SUB:
            v = tl.reshape(tl.broadcast_to(v[:, :, None], (BLOCK_N, SUB, 16)), (BLOCK_N, 16 * SUB))
        return v

    @triton.jit
    def _quant_gemv_kernel(
        X, Q, S, Off, P,
        M, N, K, K_PER_SPLIT,
        stride_xm, stride_qn, stride_sn, stride_pm, stride_ps,
        GROUP: tl.constexpr,
        BITS: tl.constexpr,
        KIND: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HALF: tl.constexpr,  # columns of each half-tile: an iteration covers 2 * HALF elements of K
    ):
        NSUB: tl.constexpr = HALF // 16  # 32-element sub-blocks per iteration (each inside one group)
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        n_mask = offs_n < N
        m_mask = offs_m < M
        # Same column order as the GEMM: half-tile column c = 16 * sub + j is element 32 * sub + j of the
        # iteration's K range, its partner (the high nibble of the same byte, for 4 bits) that + 16. Scales and x
        # are loaded per sub-block ([.., NSUB, 16], contiguous in j) and broadcast: gathering them per column
        # made the kernel instruction-bound.
        sub = tl.arange(0, NSUB)
        lane = tl.arange(0, 16)
        offs_c = tl.arange(0, HALF)
        elem_lo = 32 * (offs_c // 16) + offs_c % 16
        q_rows = Q + offs_n.to(tl.int64)[:, None] * stride_qn
        s_rows = offs_n.to(tl.int64)[:, None] * stride_sn
        x_rows = X + offs_m.to(tl.int64)[:, None, None] * stride_xm
        x_cols = (32 * sub)[None, :, None] + lane[None, None, :]
        w_mask = n_mask[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N, HALF], dtype=tl.float32)
        k_start = pid_s * K_PER_SPLIT
        k_end = tl.minimum(k_start + K_PER_SPLIT, K)
        for k0 in range(k_start, k_end, 2 * HALF):
            grp = (k0 + 32 * sub) // GROUP  # [NSUB]
            d = tl.load(S + s_rows + grp[None, :], mask=w_mask, other=0).to(tl.float16, bitcast=True)
            d = tl.reshape(tl.broadcast_to(d.to(tl.float32)[:, :, None], (BLOCK_N, NSUB, 16)), (BLOCK_N, HALF))
            lo, hi = _load_codes(q_rows, k0, offs_c, elem_lo, w_mask, BITS)
            if KIND == 0:
                mn = tl.load(Off + s_rows + grp[None, :], mask=w_mask, other=0).to(tl.float16, bitcast=True)
                mn = tl.reshape(tl.broadcast_to(mn.to(tl.float32)[:, :, None], (BLOCK_N, NSUB, 16)),
                                (BLOCK_N, HALF))
                w_lo = d * lo + mn
                w_hi = d * hi + mn
            elif KIND == 1:
                z = tl.load(Off + s_rows + grp[None, :], mask=w_mask, other=0).to(tl.float32)
                z = tl.reshape(tl.broadcast_to(z[:, :, None], (BLOCK_N, NSUB, 16)), (BLOCK_N, HALF))
                w_lo = (lo - z) * d
                w_hi = (hi - z) * d
            else:
                w_lo = lo * d
                w_hi = hi * d
            x_lo = tl.load(x_rows + k0 + x_cols, mask=m_mask[:, None, None], other=0.0).to(tl.float32)
            x_hi = tl.load(x_rows + k0 + 16 + x_cols, mask=m_mask[:, None, None], other=0.0).to(tl.float32)
            x_lo = tl.reshape(x_lo, (BLOCK_M, HALF))
            x_hi = tl.reshape(x_hi, (BLOCK_M, HALF))
            acc += x_lo[:, None, :] * w_lo[None, :, :] + x_hi[:, None, :] * w_hi[None, :, :]
        out = tl.sum(acc, axis=2)
        p_ptr = P + pid_s.to(tl.int64) * stride_ps + offs_m.to(tl.int64)[:, None] * stride_pm + offs_n[None, :]
        tl.store(p_ptr, out.to(P.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


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
    offs = offsets if offsets is not None and offsets.numel() else scales  # unused placeholder for "sym"
    # A 16-bit batch of 2..8 rows pads the GEMM's MMA to 16 rows and still beats the GEMV's elementwise products
    # (H100, Llama-8B step at 8 rows: 5.3 vs 10.0 ms); fp32 products (and the interpreter's bf16) stay there.
    if m == 1 or (m <= GEMV_MAX_M and (x.dtype == torch.float32 or dot_needs_upcast(x.dtype))):
        return _quant_gemv(x, qweight, scales, offs, bits, kind, group_size, out_features, y)
    return _quant_gemm_tiled(x, qweight, scales, offs, bits, kind, group_size, out_features, y)


def gemm_tiles(m: int, n: int, k: int, sms: int, upcast: bool,
               tiles: tuple[int, int, int] | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, SUB, split) of the dequantizing GEMM. K is split until about GEMM_PROGRAMS_PER_SM
    programs per SM are in flight: at 64 rows, Llama-8B's 4096-wide outputs are 64 tiles on 132 SMs, and unsplit
    each walked all of K alone (the int4 step took 67 ms against bf16's 5.4 on an H100)."""
    if tiles is None and upcast:  # fp32 products
        block_m = 16 if m <= 16 else 32
        block_n = 32 if m <= 16 else 64  # decode: more programs over N to keep every SM reading weights
        sub = 4
    elif tiles is None:
        # 16-bit x, the transposed product (SWAP_AB): an H100 sweep over the Llama-8B step (quant_gpu_h100.json,
        # int4.gemm_sweep) at 8 / 16 / 64 / 256 rows: 5.3 / 5.5 / 8.8 / 24.8 ms against bf16's 5.3-6.5.
        block_m, block_n, sub = (16, 64, 4) if m <= 16 else ((32, 128, 4) if m <= 32 else (64, 128, 2))
    else:  # (BLOCK_M, BLOCK_N, SUB) from a sweep
        block_m, block_n, sub = tiles
    while (k // 32) % sub:
        sub //= 2
    iters = k // (32 * sub)
    programs = -(-m // block_m) * -(-n // block_n)
    split = max(1, min(iters, (GEMM_PROGRAMS_PER_SM * sms) // programs))
    return block_m, block_n, sub, split


def _quant_gemm_tiled(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offs: torch.Tensor, bits: int,
                      kind: int, group_size: int, out_features: int, y: torch.Tensor, *,
                      tiles: tuple[int, int, int] | None = None, num_warps: int | None = None,
                      num_stages: int | None = None, meta_per_sub: bool = True,
                      swap_ab: bool | None = None) -> torch.Tensor:
    """The dequantizing GEMM; the keyword arguments override its tiles and variants, for sweeps (defaults: the
    transposed product for 16-bit x, 8 warps for tiles of more than 16 rows)."""
    m, k = x.shape
    upcast = x.dtype == torch.float32 or dot_needs_upcast(x.dtype)
    block_m, block_n, sub, split = gemm_tiles(m, out_features, k, sm_count(x.device), upcast, tiles)
    swap_ab = (not upcast) if swap_ab is None else (swap_ab and not upcast)
    if num_warps is None:
        num_warps = 8 if block_m > 16 and not upcast else 4
    step = 32 * sub
    per_split = -(-(k // step) // split) * step
    split = -(-k // per_split)
    partial = y if split == 1 else torch.empty(split, m, out_features, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(out_features, block_n), split)
    _quant_gemm_kernel[grid](
        x, qweight, scales, offs, partial, m, out_features, k, per_split,
        x.stride(0), qweight.stride(0), scales.stride(0), out_features if split > 1 else y.stride(0),
        m * out_features,
        GROUP=group_size, BITS=bits, KIND=kind, BLOCK_M=block_m, BLOCK_N=block_n, SUB=sub,
        UPCAST=upcast, META_PER_SUB=meta_per_sub, SWAP_AB=swap_ab, num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}),
    )
    if split > 1:
        torch.sum(partial, dim=0, out=y) if y.dtype == torch.float32 else y.copy_(partial.sum(dim=0))
    return y


def gemv_tiles(m: int, n: int, k: int, sms: int,
               tiles: tuple[int, int, int] | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, HALF, split): tiles that keep registers bounded as M grows, and the K split that puts
    about GEMV_PROGRAMS_PER_SM programs on every SM (each split a whole number of iterations). `tiles`:
    (BLOCK_N, HALF, programs per SM) from a sweep."""
    block_m = 1 if m == 1 else (2 if m == 2 else (4 if m <= 4 else 8))
    per_sm = GEMV_PROGRAMS_PER_SM if m == 1 else GEMV_PROGRAMS_PER_SM_BATCHED
    # One row: 8 rows x 256 elements per program and iteration (H100 sweep over the Llama-8B step, quant_gpu_h100.json
    # int4.gemv_sweep: 3.87 ms against 4.26 for 16 x 128 and 4.2-6.1 for tiles of 512-1,024 elements).
    block_n, half = (8, 128) if m == 1 else (16, 64)
    if tiles is not None:
        block_n, half, per_sm = tiles
    half = next(h for h in (half, 256, 128, 64, 32, 16) if h <= half and k % (2 * h) == 0)
    iters = k // (2 * half)
    programs_n = -(-n // block_n)
    split = max(1, min(iters, (per_sm * sms) // programs_n))
    return block_m, block_n, half, split


def _quant_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offs: torch.Tensor, bits: int,
                kind: int, group_size: int, out_features: int, y: torch.Tensor, *,
                tiles: tuple[int, int, int] | None = None, num_warps: int = 4) -> torch.Tensor:
    """The GEMV; `tiles` (BLOCK_N, HALF, programs per SM) and `num_warps` override the defaults, for sweeps."""
    m, k = x.shape
    block_m, block_n, half, split = gemv_tiles(m, out_features, k, sm_count(x.device), tiles)
    per_split = -(-(k // (2 * half)) // split) * 2 * half
    split = -(-k // per_split)
    partial = y if split == 1 else torch.empty(split, m, out_features, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(out_features, block_n), split)
    _quant_gemv_kernel[grid](
        x, qweight, scales, offs, partial, m, out_features, k, per_split,
        x.stride(0), qweight.stride(0), scales.stride(0), out_features, m * out_features,
        GROUP=group_size, BITS=bits, KIND=kind, BLOCK_M=block_m, BLOCK_N=block_n, HALF=half, num_warps=num_warps,
    )
    if split > 1:
        torch.sum(partial, dim=0, out=y) if y.dtype == torch.float32 else y.copy_(partial.sum(dim=0))
    return y
