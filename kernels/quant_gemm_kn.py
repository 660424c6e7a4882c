"""4-bit weight-only GEMV/GEMM on the GPU (Triton) over the kn layout of engine/quant/kn_layout.py: y[M, N] =
x[M, K] W^T with W's codes packed [K/8, N] (N contiguous), float16 scales and mins / uint8 zeros [K/G, N].

One row (decode at batch 1) takes a GEMV: as compiled with N divisible by 16 (Triton's specialization), a lane
holds 4 adjacent columns of one 32-element sub-block (16-byte word loads), x is a broadcast within each sub-block's
lanes, and the sub-blocks are summed across lanes once per iteration (4.8 sm_90 loop instructions per code,
bench/results/int4_regs_sass_offline.json). A code becomes a float without a conversion: shifted
to bits 19-22 and OR-ed into the bits of 1.0 it reads as v = 1 + q / 16 exactly (one shift and, on CUDA, one
PTX lop3 that takes both constants; ptxas alone emits two LOP3s, 25 % slower). The group's affine map is
applied once per 32-element sub-block: with w = d q + c (c = min, -z d, or 0),
sum_j w_j x_j = 16 d S_vx + (c - 16 d) S_x, S_vx = sum_j v_j x_j and S_x = sum_j x_j (terms of one size, v in
[1, 2): nothing cancels). K splits across programs until every SM has about 16; the last program of each column
tile to finish sums the fp32 partials (with the caller's arrival counters; else one more launch does). H100 sweeps
over the Llama-8B decode step (bench/results/int4_gemv_layout_h100.json, quant_gpu_h100.json int4.kn_gemv_sweep):
32 columns x 4 sub-blocks on one warp, 16 programs per SM, the next iteration's codes loaded before this one's are
used, the split summed in the same launch: 2.19-2.21 ms against 3.87 for the canonical-layout GEMV and 5.19 for
bf16 (cuBLAS). A second form (`pairs`, see `_pair`) reads two codes per shift with a float offset per nibble
slot: fewer instructions per code when compiled offline, not yet timed.

Up to DEQUANT_MIN_M rows take a GEMM: per iteration a [BLOCK_R words, BLOCK_N] tile of codes, dequantized one
nibble position j at a time into an operand that meets x's columns 8 r + j (a sum over K in any order), so
eight MMAs per tile and no register shuffles. More rows (prefill) dequantize W once into a dense temporary and
run cuBLAS. Reference: `engine.quant.group_quant.quant_matmul_ref` of `engine.quant.kn_layout.from_kn(w)`.
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
from kernels.quant_gemm import KIND_MIN, KIND_SYM, KIND_ZERO  # one numbering for both layouts' kernels
from kernels.quant_mma_kn import mma_supported, quant_mma_kn
from kernels.quant_mma_regs import quant_mma_regs, regs_supported
from kernels.quant_wgmma import quant_wgmma, wgmma_supported
from kernels.quant_wgmma_smem import quant_wgmma_smem, smem_applies
from kernels.split_sum import sum_here, sum_splits

__all__ = ["quant_gemm_kn", "kn_gemv_tiles", "kn_gemm_tiles", "dequantize_kn", "new_arrivals"]
# GEMV: (BLOCK_N columns, NSUB sub-blocks per iteration, programs per SM when K splits, warps), the H100 sweep's best
GEMV_TILES = (32, 4, 16, 1)
# Over groups of 128 (AWQ-shaped weights) (64, 4, 16, 2), two warps per program, ran the decode step in 2.27 ms
# against 2.43 (bench/results/quant_mma_h100.json, run 2); not the default until its output is checked on a GPU
# (tests/kernels/test_kernels_quant_gemm_kn.py::test_kn_gemv_compiled_on_a_gpu, with the default changed).
MIN_GEMV_BLOCK_N = 16
GEMV_PIPELINE = True
# The nibble-pair GEMV (`_pair`), compiled offline for sm_90 (bench/sass_mix.py, retired: it runs at git checkout 889a256 -> int4_gemv_sass_offline.json):
# at the default tiles 6.5 loop instructions per code against 7.6 with the device image's Triton 3.6 (128
# registers against 96), 4.8 against 7.2 with Triton 3.9 (168 against 96). Not timed on a GPU yet, so not the
# default: `quant_gemm_kn(pairs=True)`; `bench/quant_gpu.py --parts int4 --int4-sweeps pairs` times both forms.
GEMV_PAIRS = False
GEMM_PROGRAMS_PER_SM = 4
# GEMM tiles by the largest row count they serve: (BLOCK_M, BLOCK_N, BLOCK_R, warps, SWAP_AB). H100 sweep over the
# Llama-8B decode step (quant_gpu_h100.json int4.kn_gemm_sweep, 16 tiles): the transposed product wins everywhere
# (7.4 vs 26.1 ms at 64 rows); 4.3 / 4.4 / 4.9 / 7.4 ms at 8 / 16 / 32 / 64 rows against bf16's 5.2-5.4.
GEMM_TILES: dict[int, tuple[int, int, int, int, bool]] = {16: (16, 128, 16, 4, True), 32: (32, 128, 16, 4, True),
                                                         1 << 62: (64, 128, 16, 4, True)}
# From this many rows on, W is dequantized once (one launch) and multiplied densely by cuBLAS: a flat ~11.8 ms
# per Llama-8B step for the dequantization, against the GEMM's 7.4 ms at 64 rows and 22.5 at 256. (On sm_90 the
# shared-memory wgmma kernel below takes up to SMEM_ENGINE_MAX_M rows first.)
DEQUANT_MIN_M = 128
# 2 to this many rows of bf16 / fp16 activations over groups of a multiple of 128 (AWQ / GPTQ) take the tensor-core
# kernel (kernels/quant_mma_kn.py): H100, the decode step's AWQ-shaped weights at 16 rows, 3.81 ms against this
# GEMM's 4.50 and bf16's 5.17; at 32 rows the GEMM wins (5.13 against 5.85), and at one row the GEMV (2.47 against
# 3.66) (bench/results/quant_mma_h100.json). Where Gluon is present the kernel below takes these rows instead.
MMA_MAX_M = 16
# 1 to this many rows of bf16 / fp16 activations over groups of a multiple of 128 take the Gluon kernel whose MMA
# operands are built in registers (kernels/quant_mma_regs.py), ahead of the GEMV, the tensor-core kernel and the
# GEMM above: H100, the decode step's AWQ-shaped weights, 2.15 / 2.70 ms at 1 / 4 rows against 2.48 / 3.49
# (bench/results/quant_regs_h100.json run 2), 2.73 at 8 rows against the wgmma kernel's 2.95; from 9 rows the wgmma
# kernel below is faster where it applies (H100: 2.97 / 3.07 ms at 12 / 16 rows against 3.40 / 3.60,
# bench/results/quant_smem_h100.json run 2)
REGS_ENGINE_MAX_M = 8
# Above that, up to this many rows of bf16 / fp16 activations over groups of a multiple of 128 take Hopper's wgmma
# kernel (kernels/quant_wgmma.py) on sm_90 GPUs, ahead of the GEMM and the dense dequantization: H200, the decode
# step's AWQ-shaped weights, 3.22 / 4.19 ms at 32 / 64 rows against 4.34 (quant_mma_regs) / 7.90 (GEMM)
# (bench/results/quant_wgmma_h200.json); at 96 rows the kernel below wins (H100: 5.49 against 6.84)
WGMMA_ENGINE_MAX_M = 64
# Past that, up to SMEM_ENGINE_MAX_M rows on the same terms, Hopper's kernel with both MMA operands in shared memory
# (kernels/quant_wgmma_smem.py: x by TMA, the weights dequantized once per 128 token rows and columns) instead of
# the dense dequantization + cuBLAS: H100, 5.49 / 5.80 / 9.44 / 9.74 / 15.19 ms at 96 / 128 / 192 / 256 / 384 rows
# against the wgmma kernel's 6.84 / 7.03 / 11.09 / 12.05 and the dense path's - / 11.98 / 13.23 / 12.77 / 15.41; at
# 512 rows the dense path wins (16.72 against 17.78), and by 1024 clearly (25.8 against 33.5)
# (bench/results/quant_smem_h100.json). SMEM_ENGINE_MAX_M = WGMMA_ENGINE_MAX_M sends those rows back to the dense
# path
SMEM_ENGINE_MAX_M = 384
# Where the wgmma kernel does not apply (not sm_90), quant_mma_regs takes up to this many rows (its H100 sweep's
# 4.43 ms at 32 rows against the GEMM's 5.07; at 64 the GEMM is faster)
REGS_FALLBACK_MAX_M = 32
DEQUANT_TILES = (16, 128, 4)  # (BLOCK_R, BLOCK_N, warps): 7 tiles within 4 % of each other on the H100

if HAS_TRITON:

    @triton.jit
    def _unit(word, SHIFT: tl.constexpr, ASM: tl.constexpr):
        """The nibble at bit SHIFT of each int32 word as the float 1 + q / 16 (exact)."""
        if SHIFT <= 19:  # noqa: SIM108  (a constexpr branch: only one side is compiled)
            moved = word << (19 - SHIFT)
        else:
            moved = word >> (SHIFT - 19)
        if ASM:  # (moved & 0x780000) | 0x3f800000 as one instruction
            bits = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x780000, 0x3f800000, 0xea;", "=r,r", [moved],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:
            bits = (moved & 0x00780000) | 0x3F800000
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _magic(moved, MASK: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
        """(moved & MASK) | BITS read as a float (one PTX lop3 on CUDA)."""
        if ASM:
            bits = tl.inline_asm_elementwise(f"lop3.b32 $0, $1, {MASK}, {BITS}, 0xea;", "=r,r", [moved],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:
            bits = (moved & MASK) | BITS
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _pair(acc, w, P: tl.constexpr, xe, xo, ASM: tl.constexpr):
        """acc + (256 + q_2p) x_2p + (16 + q_2p+1) x_2p+1 for each word, two FMAs: nibbles 2p and 2p + 1 (bits
        8p..8p+7) move together to bits 15-22, one shift for both, and each is OR-ed into its own float's bits
        (256.0's make 256 + q of a nibble at bit 15, 16.0's make 16 + q at bit 19). Per code one lop3, one FMA
        and half a shift, where the 1 + q / 16 form (`_unit`) shifts every code. The caller takes away
        sum_j o_j x_j once per sub-block for all columns; the codes still count 15 bits below the largest partial
        sum (2^24 / 2^9)."""
        if P < 2:  # noqa: SIM108  (a constexpr branch: only one side is compiled)
            moved = w << (15 - 8 * P)
        else:
            moved = w >> (8 * P - 15)
        low = _magic(moved, 0x78000, 0x43800000, ASM)  # bits 15-18 under 256.0's bits: 256 + q (q counts 2^-8)
        high = _magic(moved, 0x780000, 0x41800000, ASM)  # bits 19-22 under 16.0's bits: 16 + q
        return acc + low * xe[:, :, None] + high * xo[:, :, None]

    @triton.jit
    def _group_affine(S, Off, m_ptrs, mask, KIND: tl.constexpr):
        """(d, c) of w = d q + c for a tile of group entries, as float32."""
        d = tl.load(S + m_ptrs, mask=mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        if KIND == 0:
            c = tl.load(Off + m_ptrs, mask=mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        elif KIND == 1:
            c = -tl.load(Off + m_ptrs, mask=mask, other=0).to(tl.float32) * d
        else:
            c = tl.zeros_like(d)
        return d, c

    @triton.jit
    def _kn_gemv_kernel(X, QW, S, Off, Y, P, Arrivals, N, K, K_PER_SPLIT, NUM_SPLITS, GROUP: tl.constexpr,
                        KIND: tl.constexpr, BLOCK_N: tl.constexpr, NSUB: tl.constexpr, ASM: tl.constexpr,
                        PDL: tl.constexpr, PIPELINE: tl.constexpr, SUM_HERE: tl.constexpr, PAIRS: tl.constexpr):
        """The first iteration's codes load before `pdl_wait`: weights are never written during a step, and under
        PDL they stream while the previous kernel drains. Each next iteration's codes load at the end of this one,
        or with PIPELINE at its start (two iterations of loads in flight per program).

        With K split, each program writes its fp32 partial to P [NUM_SPLITS, N]. SUM_HERE: the last program of a
        column tile to arrive (an acq_rel counter per tile in Arrivals, zero between calls) sums the partials in
        split order, writes Y and resets its counter, so no second launch is needed (kernels/split_sum.py); else
        Y is written by `sum_splits`.

        PAIRS: the codes are read a nibble pair per shift (`_pair`), x a pair of elements per load, and the
        column-independent sums of x come from one [NSUB, 4, 8] block load spread over the warp."""
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        sub = tl.arange(0, NSUB)
        word = tl.arange(0, 4)
        # [NSUB, 4, BLOCK_N] words: word row 4 sub + word of the iteration (elements 32 sub + 8 word + j), column n
        q_ptrs = QW + ((4 * sub)[:, None] + word[None, :])[:, :, None] * N + offs_n[None, None, :]
        x_ptrs = X + (32 * sub)[:, None] + (8 * word)[None, :]
        jj = tl.arange(0, 8)
        x_block = X + (32 * sub)[:, None, None] + (8 * word)[None, :, None] + jj[None, None, :]
        pair_offsets = tl.where(jj % 2 == 0, 256.0, 16.0)
        x_pair = X + (32 * sub)[:, None, None] + (8 * word)[None, :, None] + tl.arange(0, 2)[None, None, :]
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        k_start = pid_s * K_PER_SPLIT
        k_end = tl.minimum(k_start + K_PER_SPLIT, K)
        # (splits and K hold whole iterations: an iteration is inside [k_start, k_end) or wholly past it)
        w = tl.load(q_ptrs + (k_start // 8) * N,
                    mask=n_mask[None, None, :] & (k_start + 32 * sub < k_end)[:, None, None], other=0,
                    eviction_policy="evict_first")
        pdl_wait(PDL)
        for k0 in range(k_start, k_end, 32 * NSUB):
            k_next = k0 + 32 * NSUB
            if PIPELINE:
                w_next = tl.load(q_ptrs + (k_next // 8) * N,
                                 mask=n_mask[None, None, :] & (k_next + 32 * sub < k_end)[:, None, None], other=0,
                                 eviction_policy="evict_first")
            if PAIRS:
                xs = tl.load(x_block + k0).to(tl.float32)
                s_x = tl.sum(tl.sum(xs, axis=2), axis=1)
                s_o = tl.sum(tl.sum(xs * pair_offsets[None, None, :], axis=2), axis=1)
                s_vx = tl.zeros([NSUB, 4, BLOCK_N], dtype=tl.float32)
                for pair in tl.static_range(4):  # x per pair: loading all eight at once held 168 registers, not 72
                    x_even, x_odd = tl.split(tl.load(x_pair + k0 + 2 * pair).to(tl.float32))
                    s_vx = _pair(s_vx, w, pair, x_even, x_odd, ASM)
                s_q = tl.sum(s_vx, axis=1) - s_o[:, None]
                grp = (k0 + 32 * sub) // GROUP
                d, c = _group_affine(S, Off, grp[:, None] * N + offs_n[None, :], n_mask[None, :], KIND)
                acc += tl.sum(d * s_q + c * s_x[:, None], axis=0)
            else:
                s_vx = tl.zeros([NSUB, 4, BLOCK_N], dtype=tl.float32)
                s_x = tl.zeros([NSUB, 4], dtype=tl.float32)
                for j in tl.static_range(8):
                    xj = tl.load(x_ptrs + k0 + j).to(tl.float32)
                    s_vx += _unit(w, 4 * j, ASM) * xj[:, :, None]
                    s_x += xj
                grp = (k0 + 32 * sub) // GROUP
                d, c = _group_affine(S, Off, grp[:, None] * N + offs_n[None, :], n_mask[None, :], KIND)
                acc += tl.sum((16.0 * d) * tl.sum(s_vx, axis=1) + (c - 16.0 * d) * tl.sum(s_x, axis=1)[:, None],
                              axis=0)
            if PIPELINE:
                w = w_next
            else:
                w = tl.load(q_ptrs + (k_next // 8) * N,
                            mask=n_mask[None, None, :] & (k_next + 32 * sub < k_end)[:, None, None], other=0,
                            eviction_policy="evict_first")
        if NUM_SPLITS == 1:
            tl.store(Y + offs_n, acc.to(Y.dtype.element_ty), mask=n_mask)
        else:
            tl.store(P + pid_s.to(tl.int64) * N + offs_n, acc, mask=n_mask)
            if SUM_HERE:
                sum_here(P, Y, Arrivals, pid_n, NUM_SPLITS, N, offs_n, n_mask, acc)

    @triton.jit
    def _kn_gemm_kernel(X, QW, S, Off, Y, M, N, K, K_PER_SPLIT, stride_xm, stride_ym, stride_ys,
                        GROUP: tl.constexpr, KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_R: tl.constexpr, UPCAST: tl.constexpr, SWAP_AB: tl.constexpr):
        """Y = X W^T, or each K split's fp32 partial at Y + split * stride_ys. SWAP_AB computes Y^T = W X^T with
        the dequantized tile as the dot's first operand (Hopper's MMA may read it from registers; the second
        operand goes through shared memory). Loading the next iteration's codes ahead, as the GEMV does, was
        slower at every tile and batch (H100 sweep, kn_gemm_sweep.round_2)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_s = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        r = tl.arange(0, BLOCK_R)  # word rows of the iteration: elements 8 r + j
        x_base = X + offs_m.to(tl.int64) * stride_xm
        k_start = pid_s * K_PER_SPLIT
        k_end = tl.minimum(k_start + K_PER_SPLIT, K)
        if SWAP_AB:  # tiles [BLOCK_N, BLOCK_R] of the weight, [BLOCK_R, BLOCK_M] of x
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            w_rows = QW + r[None, :] * N + offs_n[:, None]  # + (k0 // 8) * N: the iteration's word rows
            for k0 in range(k_start, k_end, 8 * BLOCK_R):
                r_mask = k0 + 8 * r < k_end
                wmask = n_mask[:, None] & r_mask[None, :]
                w = tl.load(w_rows + (k0 // 8) * N, mask=wmask, other=0)
                grp = (k0 + 8 * r) // GROUP
                d, c = _group_affine(S, Off, grp[None, :] * N + offs_n[:, None], wmask, KIND)
                for j in tl.static_range(8):
                    b = ((w >> (4 * j)) & 0xF).to(tl.float32) * d + c
                    xj = tl.load(x_base[None, :] + k0 + 8 * r[:, None] + j, mask=r_mask[:, None] & m_mask[None, :],
                                 other=0.0)
                    if UPCAST:
                        acc += tl.dot(b, xj.to(tl.float32), input_precision="ieee")
                    else:
                        acc += tl.dot(b.to(xj.dtype), xj)
            out = tl.trans(acc)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(k_start, k_end, 8 * BLOCK_R):
                r_mask = k0 + 8 * r < k_end
                wmask = r_mask[:, None] & n_mask[None, :]
                w = tl.load(QW + (k0 // 8 + r)[:, None] * N + offs_n[None, :], mask=wmask, other=0)
                grp = (k0 + 8 * r) // GROUP
                d, c = _group_affine(S, Off, grp[:, None] * N + offs_n[None, :], wmask, KIND)
                for j in tl.static_range(8):
                    b = ((w >> (4 * j)) & 0xF).to(tl.float32) * d + c
                    xj = tl.load(x_base[:, None] + k0 + 8 * r[None, :] + j, mask=m_mask[:, None] & r_mask[None, :],
                                 other=0.0)
                    if UPCAST:
                        acc += tl.dot(xj.to(tl.float32), b, input_precision="ieee")
                    else:
                        acc += tl.dot(xj, b.to(xj.dtype))
            out = acc
        y_ptr = Y + pid_s.to(tl.int64) * stride_ys + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptr, out.to(Y.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

    @triton.jit
    def _kn_dequant_kernel(QW, S, Off, W, N, K, GROUP: tl.constexpr, KIND: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_N: tl.constexpr):
        """W^T [K, N] (N contiguous, W's dtype) from the kn layout: for batches large enough that one dense matmul
        beats dequantizing in every output tile."""
        offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (offs_r < K // 8)[:, None] & (offs_n < N)[None, :]
        w = tl.load(QW + offs_r[:, None] * N + offs_n[None, :], mask=mask, other=0)
        d, c = _group_affine(S, Off, ((8 * offs_r) // GROUP)[:, None] * N + offs_n[None, :], mask, KIND)
        out = W + (8 * offs_r).to(tl.int64)[:, None] * N + offs_n[None, :]
        for j in tl.static_range(8):
            b = ((w >> (4 * j)) & 0xF).to(tl.float32) * d + c
            tl.store(out + j * N, b.to(W.dtype.element_ty), mask=mask)


def new_arrivals(out_features: int, device: torch.device | str) -> torch.Tensor:
    """Zeroed split-arrival counters for one weight's one-row calls (`quant_gemm_kn(arrivals=...)`): one per
    column tile of the narrowest GEMV tile allowed (MIN_GEMV_BLOCK_N)."""
    return torch.zeros(-(-out_features // MIN_GEMV_BLOCK_N), dtype=torch.int32, device=device)


def kn_gemv_tiles(n: int, k: int, sms: int,
                  tiles: tuple[int, int, int, int] | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_N, NSUB, split, warps): NSUB narrows until it divides K's sub-blocks; K splits (whole iterations per
    split) until about `programs per SM` programs are in flight on every SM."""
    block_n, nsub, per_sm, warps = tiles or GEMV_TILES
    if block_n < MIN_GEMV_BLOCK_N:
        raise ValueError(f"GEMV tiles need at least {MIN_GEMV_BLOCK_N} columns, got {block_n}")
    while (k // 32) % nsub:
        nsub //= 2
    iters = k // (32 * nsub)
    split = max(1, min(iters, (per_sm * sms) // -(-n // block_n)))
    return block_n, nsub, split, warps


def kn_gemm_tiles(m: int, n: int, k: int, sms: int,
                  tiles: tuple[int, int, int, int, bool] | None = None) -> tuple[int, int, int, int, bool, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_R, warps, SWAP_AB, split) of the GEMM: BLOCK_R word rows (8 BLOCK_R elements) per
    iteration, at least 16 (the MMA's K); K splits until about GEMM_PROGRAMS_PER_SM programs per SM. `tiles`:
    (BLOCK_M, BLOCK_N, BLOCK_R, warps, SWAP_AB) from a sweep."""
    block_m, block_n, block_r, warps, swap = tiles or GEMM_TILES[next(t for t in GEMM_TILES if m <= t)]
    iters = -(-k // (8 * block_r))
    programs = -(-m // block_m) * -(-n // block_n)
    split = max(1, min(iters, (GEMM_PROGRAMS_PER_SM * sms) // programs))
    return block_m, block_n, block_r, warps, swap, split


def dequantize_kn(qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, kind: int, group_size: int,
                  out_features: int, dtype: torch.dtype, tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """W^T [K, N] in `dtype` (one launch); `tiles`: (BLOCK_R word rows, BLOCK_N, warps) from a sweep."""
    require_triton("quant_gemm_kn")
    rows = qweight.shape[0]
    block_r, block_n, warps = tiles or DEQUANT_TILES
    wt = torch.empty(rows * 8, out_features, dtype=dtype, device=qweight.device)
    grid = (triton.cdiv(rows, block_r), triton.cdiv(out_features, block_n))
    _kn_dequant_kernel[grid](qweight, scales, offsets, wt, out_features, rows * 8, GROUP=group_size, KIND=kind,
                             BLOCK_R=block_r, BLOCK_N=block_n, num_warps=warps)
    return wt


def quant_gemm_kn(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, kind: int,
                  group_size: int, out_features: int, *, gemv_tiles: tuple[int, int, int, int] | None = None,
                  asm: bool | None = None, pipeline: bool | None = None,
                  gemm_tiles: tuple[int, int, int, int, bool] | None = None, dense: bool | None = None,
                  dequant_tiles: tuple[int, int, int] | None = None,
                  arrivals: torch.Tensor | None = None, pairs: bool | None = None,
                  mma: bool | None = None, regs: bool | None = None, wgmma: bool | None = None,
                  smem: bool | None = None) -> torch.Tensor:
    """x [M, K] (fp32 / bf16 / fp16) @ W^T -> [M, N] in x's dtype, W in the kn layout (int32 codes [K/8, N],
    scales int16 [K/G, N], offsets: mins int16 / zeros uint8 [K/G, N], any tensor for the symmetric kind).
    The keyword arguments override the defaults, for sweeps: `gemv_tiles`, `asm` (PTX lop3; default: on CUDA),
    `pipeline` (the GEMV loads one iteration ahead), `pairs` (the GEMV's nibble-pair form), `gemm_tiles`, `dense` (several rows:
    dequantize W once and run a dense matmul; default from DEQUANT_MIN_M), `dequant_tiles`, `mma` (several rows:
    the tensor-core kernel; default: 2 to MMA_MAX_M rows where it applies) and `regs` (the Gluon kernel of
    kernels/quant_mma_regs.py; default: the rows up to REGS_FALLBACK_MAX_M that the wgmma kernel does not take)
    and `wgmma` (Hopper's kernel of kernels/quant_wgmma.py; default: REGS_ENGINE_MAX_M + 1 to WGMMA_ENGINE_MAX_M rows
    where it applies) and `smem` (kernels/quant_wgmma_smem.py; default: from there to SMEM_ENGINE_MAX_M rows, where
    it applies).

    `arrivals`: int32 zeros from `new_arrivals`, owned by the caller (a layer) and used by one call at a time: a one-row call with K split then sums its partials in the same launch (see `_kn_gemv_kernel`); they are
    zero again when it returns."""
    require_triton("quant_gemm_kn")
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [M, K] with a contiguous last dim, got {tuple(x.shape)}")
    m, k = x.shape
    if k % 32 or group_size % 32 or k % group_size:
        raise ValueError(f"K={k} and group_size={group_size} must be multiples of 32 (group_size dividing K)")
    if qweight.dtype != torch.int32 or qweight.shape != (k // 8, out_features) or not qweight.is_contiguous():
        raise ValueError(f"qweight must be contiguous int32 [{k // 8}, {out_features}], got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    if kind not in (KIND_MIN, KIND_ZERO, KIND_SYM):
        raise ValueError(f"unsupported kind {kind}")
    if wgmma is None:  # (an explicit regs=True keeps the regs kernel)
        wgmma = (regs is not True and REGS_ENGINE_MAX_M < m <= WGMMA_ENGINE_MAX_M and x.is_cuda
                 and wgmma_supported(x.dtype, group_size, k, x.device))
    if m and wgmma:
        return quant_wgmma(x, qweight, scales, offsets, kind, group_size, out_features)
    if smem is None:
        smem = (WGMMA_ENGINE_MAX_M < m <= SMEM_ENGINE_MAX_M and x.is_cuda and regs is not True and dense is not True
                and wgmma_supported(x.dtype, group_size, k, x.device) and smem_applies(x))
    if m and smem:
        return quant_wgmma_smem(x, qweight, scales, offsets, kind, group_size, out_features)
    if m and ((m <= REGS_FALLBACK_MAX_M and x.is_cuda and regs_supported(x.dtype, group_size, k)) if regs is None
              else regs):
        return quant_mma_regs(x, qweight, scales, offsets, kind, group_size, out_features, arrivals=arrivals)
    y = torch.empty(m, out_features, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    sms = sm_count(x.device)
    if m == 1:
        block_n, nsub, split, warps = kn_gemv_tiles(out_features, k, sms, gemv_tiles)
        step = 32 * nsub
        per_split = -(-(k // step) // split) * step
        split = -(-k // per_split)
        tiles_n = triton.cdiv(out_features, block_n)
        if arrivals is not None and (arrivals.dtype != torch.int32 or arrivals.numel() < tiles_n):
            raise ValueError(f"arrivals must be int32 with at least {tiles_n} entries")
        partial = y if split == 1 else torch.empty(split, out_features, dtype=torch.float32, device=x.device)
        fused_sum = split > 1 and arrivals is not None
        _kn_gemv_kernel[(tiles_n, split)](
            x, qweight, scales, offsets, y, partial, arrivals if fused_sum else y, out_features, k, per_split, split,
            GROUP=group_size, KIND=kind, BLOCK_N=block_n, NSUB=nsub, ASM=x.is_cuda if asm is None else asm,
            PIPELINE=GEMV_PIPELINE if pipeline is None else pipeline, SUM_HERE=fused_sum,
            PAIRS=GEMV_PAIRS if pairs is None else pairs, num_warps=warps,
            **pdl_launch(x.device))
        if fused_sum:
            return y
    elif (m <= MMA_MAX_M and mma_supported(x.dtype, group_size, k)) if mma is None else mma:
        return quant_mma_kn(x, qweight, scales, offsets, kind, group_size, out_features, arrivals=arrivals)
    elif (m >= DEQUANT_MIN_M) if dense is None else dense:
        wt = dequantize_kn(qweight, scales, offsets, kind, group_size, out_features, x.dtype, dequant_tiles)
        return torch.mm(x, wt, out=y)
    else:
        block_m, block_n, block_r, warps, swap, split = kn_gemm_tiles(m, out_features, k, sms, gemm_tiles)
        step = 8 * block_r
        iters = -(-k // step)
        per_split = -(-iters // split) * step
        split = -(-k // per_split)
        partial = y if split == 1 else torch.empty(split, m, out_features, dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(m, block_m), triton.cdiv(out_features, block_n), split)
        upcast = x.dtype == torch.float32 or dot_needs_upcast(x.dtype)
        _kn_gemm_kernel[grid](
            x, qweight, scales, offsets, partial, m, out_features, k, per_split, x.stride(0), out_features,
            m * out_features, GROUP=group_size, KIND=kind, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
            UPCAST=upcast, SWAP_AB=swap and not upcast, num_warps=warps)
    if split > 1:  # (after the GEMM, launched without PDL, the split sum's wait is immediate)
        sum_splits(partial, y)
    return y
