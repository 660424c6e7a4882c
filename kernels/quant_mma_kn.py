"""4-bit weight-only GEMM on tensor cores over the kn layout (engine/quant/kn_layout.py), for bf16 / fp16
activations and groups of a multiple of 128: y[M, N] = x[M, K] W^T. The engine runs it at 2-16 rows where
kernels/quant_mma_regs.py (faster) and kernels/quant_wgmma.py do not apply: a Triton without Gluon.

Why: the CUDA-core kernels (kernels/quant_gemm_kn.py) spend ~7 (GEMV) to ~11 (GEMM) instructions per 4-bit code
(shifts, masks, an int-to-float conversion or x's widening, FMAs) and are bound by instruction issue. Here the
products go to the tensor cores, as Marlin does, and the codes cost 3.4-3.9 loop instructions each (sm_90 SASS,
Triton 3.6). On an H100 that beats the GEMM at 2-16 rows (3.80 vs 4.49 ms for the Llama-8B decode step's weights at
16); at one row the GEMV stays faster (2.43 vs 3.24 at best), since each of the eight MMAs of an iteration waits
for its x tile's shared-memory store and barrier; from 32 rows the two fp32 accumulators spill.

- A code becomes its operand without a conversion: (q | MAGIC) read as bf16 is 128 + q exactly (fp16: 1024 + q),
  since the exponent of 128 (1024) gives the mantissa's last bit the value 1.
- The group's affine map w = d q + c is applied once per group, after the products: with v = q + OFFSET,
  sum_j w_j x_j = d sum_j v_j x_j + (c - OFFSET d) sum_j x_j. The MMA's products of v and x are exact in its fp32
  accumulator (8- or 11-bit mantissas), so the only rounding is the fp32 sum's, far below the bf16 weight a dense
  checkpoint would round to.
- An iteration is one group's 128-element slice of K: a [BLOCK_N, 16] tile of int32 words (16 word rows, 8 codes
  each), read once, and eight MMAs, one per nibble position j, each meeting x's elements 8 r + j (a sum over K in
  any order). The weight tile is the MMA's first operand (the swapped product Y^T = W X^T), so a single row pads
  to the MMA's 16 columns and no weight tile is transposed.
- K splits across programs until about `programs per SM` are in flight. A call with every row in one row tile
  may sum its split in the same launch (the last program of each column tile to arrive adds the fp32 partials in
  split order, with the caller's arrival counters, as the GEMV does); otherwise a second launch sums.

Reference: `engine.quant.group_quant.quant_matmul_ref` of `engine.quant.kn_layout.from_kn(w)`.
"""

from __future__ import annotations

import torch

from kernels._triton import (
    HAS_TRITON,
    dot_needs_upcast,
    pdl_launch,
    pdl_wait,
    require_triton,
    sm_count,
    tl,
    triton,
)
from kernels.split_sum import sum_here, sum_splits

__all__ = ["MMA_GROUP_STEP", "mma_supported", "mma_tiles", "quant_mma_kn"]

MMA_GROUP_STEP = 128  # K elements per iteration: 16 word rows, the MMA's K, and one group's slice
# (BLOCK_M, BLOCK_N, warps, programs per SM) by the largest row count they serve: the H100 sweeps' best over the
# Llama-8B decode step's AWQ-shaped weights among the tiles checked on a GPU (bench/results/quant_mma_h100.json; 16
# rows: 3.80 ms against 4.64 with 8 programs per SM; 32 rows: two 16-row tiles, 5.85 against 6.49 for one of 32).
# Two warps at 16 rows, whose dots compile to Ampere-style mma.sync, ran 3.57 ms in run 2: not the default until its
# output is checked on a GPU (test_mma_compiled_on_a_gpu with the table changed). The engine takes this kernel up to
# 16 rows only (kernels/quant_gemm_kn.py MMA_MAX_M): at one row and from 32 the other kernels are faster.
MMA_TILES: dict[int, tuple[int, int, int, int]] = {16: (16, 128, 4, 4), 32: (16, 128, 4, 4), 64: (64, 128, 4, 4),
                                                   1 << 62: (128, 128, 8, 2)}
# bf16 / fp16 bits of 128 / 1024, whose last mantissa bit counts 1
_MAGIC = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}

if HAS_TRITON:

    @triton.jit
    def _code(w, J: tl.constexpr, MAGIC: tl.constexpr, DTYPE: tl.constexpr):
        """Nibble J of each int32 word as OFFSET + q in DTYPE (bf16 / fp16), exactly: the code OR-ed into the bits
        of the magic number."""
        return (((w >> (4 * J)) & 0xF) | MAGIC).to(tl.int16).to(DTYPE, bitcast=True)

    @triton.jit
    def _code_pair(w, J: tl.constexpr, MAGIC: tl.constexpr, DTYPE: tl.constexpr):
        """_code of two words at once (CUDA only: PTX): one prmt moves byte J // 2 of each into the halves of one
        register and one lop3 makes both codes (plus a shift for odd J), already packed as the MMA's operand
        register holds them, where `_code` costs a shift, a lop3 and half a prmt per code (sm_90 SASS, Triton
        3.6: 3.4-3.9 loop instructions per code against 4.7-5.2)."""
        SEL: tl.constexpr = (J // 2) * 0x11 + (4 + J // 2) * 0x1100  # byte J // 2 of $1 -> byte 0, of $2 -> byte 2
        if J % 2 == 0:
            asm: tl.constexpr = (f"{{ .reg .b32 t; prmt.b32 t, $1, $2, {SEL}; "
                                 f"lop3.b32 $0, t, 0x000F000F, {MAGIC * 0x10001}, 0xea; }}")
        else:  # the high nibble: shifted down first
            asm: tl.constexpr = (f"{{ .reg .b32 t; prmt.b32 t, $1, $2, {SEL}; shr.u32 t, t, 4; "
                                 f"lop3.b32 $0, t, 0x000F000F, {MAGIC * 0x10001}, 0xea; }}")
        codes = tl.inline_asm_elementwise(asm, "=r,r,r", [w], dtype=tl.int16, is_pure=True, pack=2)
        return codes.to(DTYPE, bitcast=True)

    @triton.jit
    def _kn_mma_kernel(X, QW, S, Off, Y, P, Arrivals, M, N, K, K_PER_SPLIT, NUM_SPLITS, stride_xm,
                       GROUP: tl.constexpr, KIND: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUM_HERE: tl.constexpr, UPCAST: tl.constexpr,
                       PAIRED: tl.constexpr,
                       PDL: tl.constexpr):
        """Y [M, N] = X W^T; with K split (program axis 2) each split's fp32 partial goes to P [NUM_SPLITS, M, N],
        and with SUM_HERE (one row tile) the last program of a column tile to arrive writes Y from them."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_s = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        r = tl.arange(0, 16)  # word rows of the iteration: elements 8 r + j
        w_ptrs = QW + r[None, :] * N + offs_n[:, None]  # [BLOCK_N, 16], + (k0 // 8) * N
        x_ptrs = X + offs_m.to(tl.int64)[None, :] * stride_xm + 8 * r[:, None]  # [16, BLOCK_M], + k0 + j
        k_start = pid_s * K_PER_SPLIT
        k_end = tl.minimum(k_start + K_PER_SPLIT, K)  # (splits hold whole groups)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        pdl_wait(PDL)
        for k0 in range(k_start, k_end, 128):
            w = tl.load(w_ptrs + (k0 // 8) * N, mask=n_mask[:, None], other=0, eviction_policy="evict_first")
            part = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            xs = tl.zeros([16, BLOCK_M], dtype=tl.float32)
            for j in tl.static_range(8):
                if PAIRED:
                    v = _code_pair(w, j, MAGIC, X.dtype.element_ty)
                else:
                    v = _code(w, j, MAGIC, X.dtype.element_ty)
                xj = tl.load(x_ptrs + k0 + j, mask=m_mask[None, :], other=0.0)
                if UPCAST:  # (the CPU interpreter, whose bf16 dot multiplies bit patterns)
                    part = tl.dot(v.to(tl.float32), xj.to(tl.float32), part, input_precision="ieee")
                else:
                    part = tl.dot(v, xj, part)
                xs += xj.to(tl.float32)
            sx = tl.sum(xs, axis=0)
            grp = k0 // GROUP
            d = tl.load(S + grp * N + offs_n, mask=n_mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)
            if KIND == 0:
                c = tl.load(Off + grp * N + offs_n, mask=n_mask, other=0).to(tl.float16, bitcast=True)
                c = c.to(tl.float32)
            elif KIND == 1:
                c = -tl.load(Off + grp * N + offs_n, mask=n_mask, other=0).to(tl.float32) * d
            else:
                c = tl.zeros_like(d)
            acc += d[:, None] * part + (c - OFFSET * d)[:, None] * sx[None, :]
        out = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
        mn_mask = m_mask[:, None] & n_mask[None, :]
        rows = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        if NUM_SPLITS == 1:
            tl.store(Y + rows, out.to(Y.dtype.element_ty), mask=mn_mask)
        else:
            tl.store(P + pid_s.to(tl.int64) * M * N + rows, out, mask=mn_mask)
            if SUM_HERE:
                sum_here(P, Y, Arrivals, pid_n, NUM_SPLITS, M * N, rows, mn_mask, out)


def mma_supported(dtype: torch.dtype, group_size: int, k: int) -> bool:
    """Whether `quant_mma_kn` takes these activations and groups: bf16 / fp16, groups (and so K) a multiple of
    MMA_GROUP_STEP."""
    return dtype in _MAGIC and group_size % MMA_GROUP_STEP == 0 and k % group_size == 0


def mma_tiles(m: int, n: int, k: int, sms: int,
              tiles: tuple[int, int, int, int] | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, split): K splits (whole groups' slices per split) until about `programs per SM`
    programs are in flight on every SM. `tiles`: (BLOCK_M, BLOCK_N, warps, programs per SM) from a sweep."""
    block_m, block_n, warps, per_sm = tiles or MMA_TILES[next(t for t in MMA_TILES if m <= t)]
    programs = -(-m // block_m) * -(-n // block_n)
    split = max(1, min(k // MMA_GROUP_STEP, (per_sm * sms) // programs))
    return block_m, block_n, warps, split


def quant_mma_kn(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, kind: int,
                 group_size: int, out_features: int, *, tiles: tuple[int, int, int, int] | None = None,
                 arrivals: torch.Tensor | None = None, paired: bool | None = None) -> torch.Tensor:
    """x [M, K] (bf16 / fp16, contiguous rows) @ W^T -> [M, N] in x's dtype, W in the kn layout (int32 codes
    [K/8, N], scales int16 [K/G, N], offsets: mins int16 / zeros uint8 [K/G, N], any tensor for the symmetric
    kind). `tiles` overrides the table (sweeps); `paired`: codes made two at a time by PTX (default: on CUDA).
    `arrivals`: int32 zeros (`kernels.quant_gemm_kn.new_arrivals`), owned by the caller and used by one call at a
    time: a call whose rows fit one row tile then sums its K split in the same launch; they are zero again when it
    returns."""
    require_triton("quant_mma_kn")
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [M, K] with a contiguous last dim, got {tuple(x.shape)}")
    m, k = x.shape
    if not mma_supported(x.dtype, group_size, k):
        raise ValueError(f"quant_mma_kn takes bf16 / fp16 activations and groups of a multiple of "
                         f"{MMA_GROUP_STEP} dividing K; got {x.dtype}, group_size={group_size}, K={k}")
    if qweight.dtype != torch.int32 or qweight.shape != (k // 8, out_features) or not qweight.is_contiguous():
        raise ValueError(f"qweight must be contiguous int32 [{k // 8}, {out_features}], got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    y = torch.empty(m, out_features, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m, block_n, warps, split = mma_tiles(m, out_features, k, sm_count(x.device), tiles)
    per_split = -(-(k // MMA_GROUP_STEP) // split) * MMA_GROUP_STEP
    split = -(-k // per_split)
    tiles_m, tiles_n = triton.cdiv(m, block_m), triton.cdiv(out_features, block_n)
    fused_sum = split > 1 and arrivals is not None and tiles_m == 1
    if fused_sum and (arrivals.dtype != torch.int32 or arrivals.numel() < tiles_n):
        raise ValueError(f"arrivals must be int32 with at least {tiles_n} entries")
    partial = y if split == 1 else torch.empty(split, m, out_features, dtype=torch.float32, device=x.device)
    magic, offset = _MAGIC[x.dtype]
    _kn_mma_kernel[(tiles_m, tiles_n, split)](
        x, qweight, scales, offsets, y, partial, arrivals if fused_sum else y, m, out_features, k, per_split,
        split, x.stride(0), GROUP=group_size, KIND=kind, MAGIC=magic, OFFSET=offset, BLOCK_M=block_m,
        BLOCK_N=block_n, SUM_HERE=fused_sum, UPCAST=dot_needs_upcast(x.dtype),
        PAIRED=x.is_cuda if paired is None else paired, num_warps=warps, **pdl_launch(x.device))
    if split > 1 and not fused_sum:
        sum_splits(partial, y)
    return y
