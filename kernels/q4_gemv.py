"""The single-row int4 GEMV on the GPU (Triton): y[1, N] = x[1, K] W^T for 4-bit weights in the canonical layout
of engine/quant/group_quant.py (GGUF-ordered nibbles in 32-element sub-blocks; float16 scale and min, uint8 zero,
or neither, per group). Batch-1 decode is a pure weight stream, so this kernel's only job is to keep the
memory system busy while spending as few instructions per weight as possible.

How it spends them (the general kernel in kernels/quant_gemm.py converted every code with an integer-to-float
conversion, a quarter-rate instruction, and read 4-bit weights at ~1.16 TB/s on an H100):

- Codes load as int32 words (16 bytes, one sub-block, per thread and vector load). Byte t of word i of a
  sub-block holds element 4i + t in its low nibble and element 16 + 4i + t in its high one.
- A nibble becomes a float without a conversion: shifted to bits 19-22 and OR-ed into the bits of 1.0, it reads
  as v = 1 + q / 16, exactly (one shift and one LOP3 per code).
- The per-group affine map is applied per sub-block, not per code: with w = d q + c (c = min, -z d, or 0),
  sum_j w_j x_j = 16 d S_vx + (c - 16 d) S_x, where S_vx = sum_j v_j x_j and S_x = sum_j x_j over the sub-block.
  Each code costs one FMA. Both sums have terms of the same size (v in [1, 2)), so nothing cancels
  catastrophically; the result agrees with the dequantize-then-multiply reference to fp32 rounding.

K may be split across programs (fp32 partials summed afterwards) so that short outputs still fill the GPU.
"""

from __future__ import annotations

import torch

from kernels._triton import HAS_TRITON, require_triton, sm_count, tl, triton

__all__ = ["q4_gemv", "q4_gemv_tiles"]

KIND_MIN, KIND_ZERO, KIND_SYM = 0, 1, 2
# (BLOCK_N rows, NSUB sub-blocks per iteration, programs per SM when K splits, warps); see q4_gemv_tiles.
DEFAULT_TILES = (16, 8, 8, 4)

if HAS_TRITON:

    @triton.jit
    def _unit(word, SHIFT: tl.constexpr, ASM: tl.constexpr):
        """The nibble at bit SHIFT of each int32 word as the float 1 + q / 16 (exact): moved to bits 19-22 (the
        top of float32's mantissa) and OR-ed into 1.0's bits. ASM: the mask and the OR as one LOP3 (ptxas emits
        two, as LOP3 takes one immediate; PTX's lop3 takes both constants and they get hoisted)."""
        if SHIFT <= 19:  # noqa: SIM108  (a constexpr branch: only one side is compiled)
            moved = word << (19 - SHIFT)
        else:
            moved = word >> (SHIFT - 19)
        if ASM:
            bits = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x780000, 0x3f800000, 0xea;", "=r,r", [moved],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:
            bits = (moved & 0x00780000) | 0x3F800000
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _q4_gemv_kernel(
        X, QW, S, Off, Y,
        N, K, K_PER_SPLIT,
        stride_qn, stride_sn, stride_ys,
        GROUP: tl.constexpr,
        KIND: tl.constexpr,
        BLOCK_N: tl.constexpr,
        NSUB: tl.constexpr,
        PREFETCH: tl.constexpr = False,
        XPERM: tl.constexpr = False,
        ASM: tl.constexpr = False,
    ):
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        sub = tl.arange(0, NSUB)
        word = tl.arange(0, 4)
        rows = offs_n.to(tl.int64)
        # [BLOCK_N, NSUB, 4] words: row n, sub-block `sub` of the iteration, word `word` of the sub-block
        q_ptrs = QW + rows[:, None, None] * stride_qn + (4 * sub)[None, :, None] + word[None, None, :]
        if XPERM:  # x as fp32 [sub-block][t][low/high][word]: each (t, half) is 4 contiguous floats
            x_ptrs = X + (32 * sub)[:, None] + word[None, :]
        else:  # element 32 sub + 4 word (+ t for byte t, + 16 for the high nibbles) of the iteration's K range
            x_ptrs = X + (32 * sub)[:, None] + (4 * word)[None, :]
        s_rows = rows[:, None] * stride_sn
        w_mask = n_mask[:, None, None]
        acc = tl.zeros([BLOCK_N, NSUB], dtype=tl.float32)
        k_start = pid_s * K_PER_SPLIT
        k_end = tl.minimum(k_start + K_PER_SPLIT, K)
        # Splits and K are whole iterations, so an iteration is either wholly inside [k_start, k_end) or not at all.
        if PREFETCH:  # the next iteration's words are requested before this one's are used: two loads in flight
            w_next = tl.load(q_ptrs + k_start // 8, mask=w_mask & (k_start + 32 * sub < k_end)[None, :, None],
                             other=0, eviction_policy="evict_first")
        for k0 in range(k_start, k_end, 32 * NSUB):
            if PREFETCH:
                w = w_next
                k_next = k0 + 32 * NSUB
                w_next = tl.load(q_ptrs + tl.multiple_of(k_next // 8, 4),
                                 mask=w_mask & (k_next + 32 * sub < k_end)[None, :, None], other=0,
                                 eviction_policy="evict_first")
            else:
                w = tl.load(q_ptrs + tl.multiple_of(k0 // 8, 4), mask=w_mask, other=0,
                            eviction_policy="evict_first")
            s_vx = tl.zeros([BLOCK_N, NSUB, 4], dtype=tl.float32)
            s_x = tl.zeros([NSUB, 4], dtype=tl.float32)
            for t in tl.static_range(4):
                if XPERM:
                    x_lo = tl.load(x_ptrs + k0 + 8 * t)
                    x_hi = tl.load(x_ptrs + k0 + 8 * t + 4)
                else:
                    x_lo = tl.load(x_ptrs + k0 + t).to(tl.float32)
                    x_hi = tl.load(x_ptrs + k0 + 16 + t).to(tl.float32)
                s_vx += _unit(w, 8 * t, ASM) * x_lo[None, :, :]
                s_vx += _unit(w, 8 * t + 4, ASM) * x_hi[None, :, :]
                s_x += x_lo + x_hi
            grp = (k0 + 32 * sub) // GROUP
            d = tl.load(S + s_rows + grp[None, :], mask=n_mask[:, None], other=0).to(tl.float16, bitcast=True)
            d = d.to(tl.float32)
            if KIND == 0:
                c = tl.load(Off + s_rows + grp[None, :], mask=n_mask[:, None], other=0).to(tl.float16, bitcast=True)
                c = c.to(tl.float32)
            elif KIND == 1:
                c = -tl.load(Off + s_rows + grp[None, :], mask=n_mask[:, None], other=0).to(tl.float32) * d
            else:
                c = tl.zeros([BLOCK_N, NSUB], dtype=tl.float32)
            acc += (16.0 * d) * tl.sum(s_vx, axis=2) + (c - 16.0 * d) * tl.sum(s_x, axis=1)[None, :]
        out = tl.sum(acc, axis=1)
        tl.store(Y + pid_s.to(tl.int64) * stride_ys + offs_n, out.to(Y.dtype.element_ty), mask=n_mask)

    @triton.jit
    def _sum_splits_kernel(P, Y, N, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        """y[n] = sum over splits of the fp32 partials, written in y's dtype (one launch, not a sum and a cast)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            total += tl.load(P + s * N + offs, mask=mask, other=0.0)
        tl.store(Y + offs, total.to(Y.dtype.element_ty), mask=mask)


def q4_gemv_tiles(n: int, k: int, sms: int,
                  tiles: tuple[int, int, int, int] | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_N, NSUB, split, num_warps). K splits (whole iterations per split) until about `programs per SM`
    programs are in flight on every SM; NSUB narrows until it divides K's sub-blocks."""
    block_n, nsub, per_sm, warps = tiles or DEFAULT_TILES
    while (k // 32) % nsub:
        nsub //= 2
    iters = k // (32 * nsub)
    split = max(1, min(iters, (per_sm * sms) // -(-n // block_n)))
    return block_n, nsub, split, warps


def q4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, kind: int,
            group_size: int, out_features: int, y: torch.Tensor | None = None, *,
            tiles: tuple[int, int, int, int] | None = None, prefetch: bool = False, xperm: bool = False,
            asm: bool | None = None) -> torch.Tensor:
    """x [1, K] (fp32 / bf16 / fp16) @ W^T -> y [1, N] in x's dtype. qweight: uint8 [N, K/2], rows contiguous;
    scales (and min offsets) int16 float16-bits [N, K/G]; zero offsets uint8 [N, K/G]; `offsets` is ignored
    (any tensor) for the symmetric kind. `tiles` (BLOCK_N, NSUB, programs per SM, warps) and `prefetch`
    (double-buffered code loads) override the defaults, for sweeps."""
    require_triton("q4_gemv")
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(-1) != 1:
        raise ValueError(f"x must be [1, K] with a contiguous last dim, got {tuple(x.shape)}")
    k = x.shape[1]
    if k % 32 or group_size % 32 or k % group_size:
        raise ValueError(f"K={k} and group_size={group_size} must be multiples of 32 (group_size dividing K)")
    if qweight.dtype != torch.uint8 or qweight.shape != (out_features, k // 2) or qweight.stride(1) != 1:
        raise ValueError(f"qweight must be uint8 [{out_features}, {k // 2}] with contiguous rows, got "
                         f"{qweight.dtype} {tuple(qweight.shape)}")
    if qweight.stride(0) % 4 or qweight.data_ptr() % 4:
        raise ValueError("qweight rows must start on 4-byte boundaries (they are read as int32 words)")
    if y is None:
        y = torch.empty(1, out_features, dtype=x.dtype, device=x.device)
    block_n, nsub, split, warps = q4_gemv_tiles(out_features, k, sm_count(x.device), tiles)
    per_split = -(-(k // (32 * nsub)) // split) * 32 * nsub
    split = -(-k // per_split)
    words = qweight.view(torch.int32)
    if xperm:  # [sub-block][low/high][word][t] -> [sub-block][t][low/high][word], fp32: vector loads, no casts
        x = x.view(k // 32, 2, 4, 4).permute(0, 3, 1, 2).float().contiguous()
    if asm is None:
        asm = x.device.type == "cuda"
    partial = y if split == 1 else torch.empty(split, 1, out_features, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(out_features, block_n), split)
    _q4_gemv_kernel[grid](
        x, words, scales, offsets, partial, out_features, k, per_split,
        words.stride(0), scales.stride(0), out_features,
        GROUP=group_size, KIND=kind, BLOCK_N=block_n, NSUB=nsub, PREFETCH=prefetch, XPERM=xperm, ASM=asm,
        num_warps=warps,
    )
    if split > 1:
        _sum_splits_kernel[(triton.cdiv(out_features, 1024),)](partial, y, out_features, SPLIT=split, BLOCK=1024)
    return y
