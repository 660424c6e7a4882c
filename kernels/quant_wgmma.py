"""4-bit weight-only GEMM for Hopper's warpgroup MMA (Gluon), over the kn layout of engine/quant/kn_layout.py:
y[M, N] = x[M, K] W^T for bf16 / fp16 activations, groups of a multiple of 128 (AWQ / GPTQ), tens to hundreds of
token rows (batched decode).

Why: kernels/quant_mma_regs.py builds both mma.sync operands in registers, which wins at 1-16 rows but makes every
warp hold and reload the whole x tile; at 64 rows x is 4x the weight bytes each warp reads (from L2) and 128
registers a thread, and the kernel falls to 0.68x bf16. Here a program's warpgroups share x through shared
memory: the wgmma reads its B operand (x^T, [128, BM]) from there, and its A operand (the dequantized weights,
64 T columns per warpgroup) from registers, built as quant_mma_regs builds mma.sync's A (the two operand layouts
are the same linear layout; asserted trivial at compile time). x is still read once per column tile (from L2):
4 BM / BN times the weight bytes, so programs span several warpgroups.

The mapping (as kernels/quant_mma_regs.py):
- An iteration is one group's 128-element slice of K: 16 word rows of the kn layout, 8 codes each. Lane (g, t)
  holds word rows 4 c + t of its columns, and each MMA register pairs two adjacent elements of one word, so the
  MMA's K order is a permutation of K that moves 4-byte pairs: logical k = 16 (2 c + c2) + 8 h + 2 t + p is
  element 8 (4 c + t) + 4 c2 + 2 h + p. x is loaded 16 bytes per lane and stored to shared memory in that order
  (stmatrix, no byte shuffles).
- Unlike quant_mma_regs, the group's affine map is applied to the operand, in fp32, before it is rounded to the
  activations' dtype: a nibble OR-ed into 128.0's bits reads as v = 128 + q, and w = d v + (c - 128 d) is d q + c
  exactly (both products and the sum fit fp32's mantissa for zero-point and symmetric weights), so the operand is
  the dense checkpoint's 16-bit weight bit for bit, and the MMA accumulates into one fp32 accumulator over all of
  K (no per-group partial product: twice the rows fit the registers).
- K splits across programs until about `programs per SM` are in flight; the fp32 partials are summed by a
  second launch (kernels/split_sum.py).

On an H200 it runs the Llama-8B decode step's AWQ-shaped weights in 3.22 / 4.19 / 7.07 ms at 32 / 64 / 128 rows
(bf16: 3.93 / 4.00 / 4.32); from 256 rows the dense dequantization + cuBLAS is faster
(bench/results/quant_wgmma_h200.json).

Needs CUDA on sm_90 (wgmma; Gluon has no CPU interpreter): tests/kernels/test_kernels_quant_wgmma.py checks it on
a GPU machine. Reference: `engine.quant.group_quant.quant_matmul_ref` of `engine.quant.kn_layout.from_kn(w)`.
"""

from __future__ import annotations

import functools

import torch

from kernels._triton import cuda_major, sm_count, triton, use_pdl
from kernels.quant_mma_regs import HAS_GLUON, check_gluon_kn_args, words_layout
from kernels.split_sum import sum_splits

if HAS_GLUON:  # pragma: no cover - depends on the Triton version
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

__all__ = ["WGMMA_TILES", "wgmma_entry", "wgmma_supported", "wgmma_tiles", "quant_wgmma"]

GROUP_STEP = 128  # K elements per iteration: 16 word rows, one group's slice
# (warpgroups per program, column tiles of 64 per warpgroup, padded token rows per program, programs per SM, x
# loaded an iteration ahead, asynchronous MMA) by the row count they serve: the H200 sweep's best over the
# Llama-8B decode step's AWQ-shaped weights (bench/results/quant_wgmma_h200.json: 3.22 / 4.19 / 7.07 ms at
# 32 / 64 / 128 rows against 4.34 / 7.90 / 10.47 for the engine's path before it); x ahead and the asynchronous
# MMA were slower at every batch
WGMMA_TILES: dict[int, tuple[int, int, int, int, bool, bool]] = {
    32: (1, 1, 32, 4, False, False), 64: (2, 1, 64, 2, False, False), 128: (2, 1, 64, 2, False, False)}
# Each word's codes placed by three operations (`_word_codes`: -10 % loop instructions offline at 64 rows, the same
# operand) instead of a shift each: 0.5-1.5 % faster at 32-1024 rows on an H100, the same error
# (bench/results/quant_smem_h100.json); `codes3=False` keeps the shifts
WGMMA_CODES3 = True
_DTYPES = (torch.bfloat16, torch.float16)


def wgmma_block_m(m: int, block_m: int | None = None) -> int:
    """The token rows a program holds: m padded to a power of two (at least 16), at most the table's entry."""
    padded = max(16, 1 << (m - 1).bit_length())
    return min(padded, block_m or wgmma_entry(m)[2])


def wgmma_entry(m: int) -> tuple[int, int, int, int, bool, bool]:
    """WGMMA_TILES' entry for m rows (the last one past the table)."""
    return WGMMA_TILES[next((t for t in sorted(WGMMA_TILES) if m <= t), max(WGMMA_TILES))]


@functools.cache  # (a launch argument: built once per tile, not per call)
def x_stage_layout(warps: int) -> gl.BlockedLayout:
    """[BM tokens, 128 elements of K] loaded 8 contiguous elements (16 bytes) per lane, the warps over tokens."""
    return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[8, 4], warps_per_cta=[warps, 1],
                            order=[1, 0])


@functools.cache
def x_shared_layout() -> gl.NVMMASharedLayout:
    """[BM tokens, 128 permuted K] with K contiguous (256 bytes a token), 128-byte swizzle: wgmma's B (as its
    transpose)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


if HAS_GLUON:
    @gluon.jit
    def _nibble(w, J: gl.constexpr, d, c):
        """Nibble J of each word as the fp32 weight d q + c: moved to bits 16-19 and OR-ed into 128.0's bits (one
        lop3) it reads as 128 + q exactly, and c here is already less 128 d (one FMA)."""
        if J < 4:
            moved = w << (16 - 4 * J)
        elif J == 4:
            moved = w
        else:
            moved = w >> (4 * J - 16)
        v = gl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000F0000, 0x43000000, 0xea;", "=r,r", [moved],
                                      dtype=gl.int32, is_pure=True, pack=1)
        return v.to(gl.float32, bitcast=True) * d + c

    @gluon.jit
    def _word_elements(w, d, c, P: gl.constexpr):
        """[.., 2 (c2), 2 (h)] of each word: its elements 4 c2 + 2 h + P (P = 0 or 1, the MMA register's half)."""
        return gl.join(gl.join(_nibble(w, P, d, c), _nibble(w, 4 + P, d, c)),
                       gl.join(_nibble(w, 2 + P, d, c), _nibble(w, 6 + P, d, c)))

    @gluon.jit
    def _code(u, P: gl.constexpr, d, c):
        """The code at bits 4P..4P+3 of u (P = 3 or 4) as fp32 d q + c: OR-ed into the bits of 2^(23 - 4P) (one lop3)
        it reads as 2^(23 - 4P) + q exactly, and c here is already less 2^(23 - 4P) d (one FMA)."""
        if P == 3:
            v = gl.inline_asm_elementwise("lop3.b32 $0, $1, 0x0000F000, 0x45000000, 0xea;", "=r,r", [u],
                                          dtype=gl.int32, is_pure=True, pack=1)
        else:
            v = gl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000F0000, 0x43000000, 0xea;", "=r,r", [u],
                                          dtype=gl.int32, is_pure=True, pack=1)
        return v.to(gl.float32, bitcast=True) * d + c

    @gluon.jit
    def _word_code(w, lo, mid, hi, J: gl.constexpr, d, c3, c4):
        """Code J of each word, read at bits 12-15 (P = 3) or 16-19 (P = 4) of: lo = w << 12 (codes 0, 1), mid = w
        with bytes 1 and 2 swapped (codes 5, 2), w (codes 3, 4), hi = w >> 12 (codes 6, 7). Three operations a word
        instead of a shift for 7 of its 8 codes; the mantissa ends at bit 22, so a code at bits 20-23 must move."""
        P: gl.constexpr = (3, 4, 4, 3, 4, 3, 3, 4)[J]
        return _code((lo, lo, mid, w, w, mid, hi, hi)[J], P, d, (c3, c4)[P - 3])

    @gluon.jit
    def _word_half(w, lo, mid, hi, d, c3, c4, P: gl.constexpr):
        """[.., 2 (a), 2 (b)]: code 4 a + 2 b + P of each word."""
        return gl.join(gl.join(_word_code(w, lo, mid, hi, P, d, c3, c4), _word_code(w, lo, mid, hi, 4 + P, d, c3, c4)),
                       gl.join(_word_code(w, lo, mid, hi, 2 + P, d, c3, c4),
                               _word_code(w, lo, mid, hi, 6 + P, d, c3, c4)))

    @gluon.jit
    def _word_codes(w, d, c4):
        """[.., 2 (a), 2 (b), 2 (p)]: code 4 a + 2 b + p of each word as fp32 d q + c (c4 = c - 128 d, `_affine`),
        three operations a word to place its codes (`_word_code`)."""
        c3 = c4 - 1920.0 * d  # c - 2048 d: exact for zero-point and symmetric weights (d (z + 2048) fits fp32)
        lo = w << 12
        hi = w >> 12
        mid = gl.inline_asm_elementwise("prmt.b32 $0, $1, 0, 0x3120;", "=r,r", [w], dtype=gl.int32, is_pure=True,
                                        pack=1)
        return gl.join(_word_half(w, lo, mid, hi, d, c3, c4, 0), _word_half(w, lo, mid, hi, d, c3, c4, 1))

    @gluon.jit
    def _affine(S, Off, offs, KIND: gl.constexpr):
        """(d, c - 128 d) of a row of group entries as fp32, for w = d v + (c - 128 d) with v = 128 + q."""
        d = gl.load(S + offs).to(gl.float16, bitcast=True).to(gl.float32)
        if KIND == 0:  # min: w = d q + m
            c = gl.load(Off + offs).to(gl.float16, bitcast=True).to(gl.float32)
        elif KIND == 1:  # zero point: w = d (q - z)
            c = -gl.load(Off + offs).to(gl.float32) * d
        else:
            c = gl.zeros_like(d)
        return d, c - 128.0 * d

    @gluon.jit
    def _operand(w, S, Off, grp, N, cols, KIND: gl.constexpr, WARPS: gl.constexpr, T: gl.constexpr,
                 FP16: gl.constexpr, mma: gl.constexpr, CODES3: gl.constexpr):
        """The dequantized [16 WARPS T, 128] A operand of one group's words w (words_layout(WARPS, T))."""
        BN: gl.constexpr = 16 * WARPS * T
        d, c = _affine(S, Off, grp * N + cols, KIND)
        d = gl.expand_dims(d, 1)
        c = gl.expand_dims(c, 1)
        # [BN, 16, 2 (c2), 2 (h), 2 (p)]: element 4 c2 + 2 h + p of each word, pairs (p) adjacent, so one
        # conversion packs an MMA register
        DT: gl.constexpr = gl.float16 if FP16 else gl.bfloat16
        if CODES3:  # (the same elements in the same order, three operations a word instead of seven shifts)
            a5 = _word_codes(w, d, c).to(DT)
        else:
            a5 = gl.join(_word_elements(w, d, c, 0), _word_elements(w, d, c, 1)).to(DT)
        a9 = gl.reshape(a5, [WARPS, 8, T, 2, 4, 4, 2, 2, 2])  # (w, g, i, h', c, t, c2, h, p)
        a = gl.reshape(gl.permute(a9, [2, 0, 3, 1, 4, 6, 7, 5, 8]), [BN, 128])
        return gl.convert_layout(a, gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
                                 assert_trivial=True)

    @gluon.jit
    def _store_x(buf, xt, BM: gl.constexpr):
        """x's [BM, 128] slice into a shared buffer in the MMA's K order (see the module docstring)."""
        x6 = gl.reshape(xt, [BM, 4, 4, 2, 2, 2])  # (token, c, t, c2, h, p)
        buf.store(gl.reshape(gl.permute(x6, [0, 1, 3, 4, 2, 5]), [BM, 128]))

    @gluon.jit
    def _wgmma_kernel(X, QW, S, Off, Y, M, N, K, stride_xm, K_PER_SPLIT, WL: gl.constexpr, XL: gl.constexpr,
                      XS: gl.constexpr, GROUP: gl.constexpr, KIND: gl.constexpr, WARPS: gl.constexpr,
                      T: gl.constexpr, BM: gl.constexpr,
                      FP16: gl.constexpr, PDL: gl.constexpr, SPLIT: gl.constexpr, EVEN_N: gl.constexpr,
                      XPRE: gl.constexpr, ASYNC: gl.constexpr, CODES3: gl.constexpr):
        """One program: a [16 WARPS T columns] tile of Y's columns (64 T per warpgroup), BM token rows, one K
        split (SPLIT: its fp32 partial to Y [splits, M, N]). Its warpgroups share x's shared buffers."""
        BN: gl.constexpr = 16 * WARPS * T
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                      instr_shape=[16, BM, 16])
        pid_m = gl.program_id(0)
        pid_n = gl.program_id(1)
        pid_s = gl.program_id(2)
        # loads take clamped columns and token rows (no masks, no zero fills): the stores below mask them
        cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, WL))
        if not EVEN_N:  # (a clamp breaks the 8 / 16-byte word loads: only for a ragged last column tile)
            cols = gl.minimum(cols, N - 1)
        word_rows = gl.arange(0, 16, layout=gl.SliceLayout(0, WL))
        q_ptrs = QW + gl.expand_dims(word_rows, 0) * N + gl.expand_dims(cols, 1)
        tokens = gl.minimum(pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, XL)), M - 1)
        x_ptrs = (X + gl.expand_dims(tokens.to(gl.int64) * stride_xm, 1)
                  + gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, XL)), 0))
        # A buffer is rewritten two iterations after the MMA that read it: every warp has finished that
        # (synchronous) MMA before it reached the barrier in between. ASYNC: the MMA reads A from shared memory too
        # and runs under the next iteration's work, so three buffers: one is rewritten three iterations after its
        # MMA, which every warpgroup has waited for by then (each waits until at most one of its MMAs is in
        # flight, before the next barrier)
        STAGES: gl.constexpr = 3 if ASYNC else 2
        bufs = gl.allocate_shared_memory(X.dtype.element_ty, [STAGES, BM, 128], XS)
        if ASYNC:
            a_bufs = gl.allocate_shared_memory(X.dtype.element_ty, [STAGES, BN, 128], XS)
        k_start = pid_s * K_PER_SPLIT
        k_end = gl.minimum(k_start + K_PER_SPLIT, K)
        acc = gl.zeros([BN, BM], gl.float32, layout=mma)
        # weights are never written during a step: the first words stream before the PDL wait
        w = gl.load(q_ptrs + (k_start // 8) * N)
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                                      pack=1)
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
        stage = 0
        if XPRE:
            xt = gl.load(x_ptrs + k_start)
        for k0 in range(k_start, k_end, 128):
            k_next = gl.minimum(k0 + 128, k_end - 128)  # (the last iteration loads itself again)
            w_next = gl.load(q_ptrs + (k_next // 8) * N)
            buf = bufs.index(stage)
            if XPRE:  # x one iteration ahead in registers: its L2 latency off the MMA's path
                x_next = gl.load(x_ptrs + k_next)
                _store_x(buf, xt, BM)
                xt = x_next
            else:
                _store_x(buf, gl.load(x_ptrs + k0), BM)
            a = _operand(w, S, Off, k0 // GROUP, N, cols, KIND, WARPS, T, FP16, mma, CODES3)
            if ASYNC:
                a_buf = a_bufs.index(stage)
                a_buf.store(a)
            fence_async_shared()
            gl.thread_barrier()  # every warp's slice of x is in the buffer before the warpgroup's MMA reads it
            if ASYNC:
                acc = warpgroup_mma(a_buf, buf.permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(1, deps=[acc])
            else:
                acc = warpgroup_mma(a, buf.permute((1, 0)), acc)
            w = w_next
            stage = (stage + 1) % STAGES
        if ASYNC:
            acc = warpgroup_mma_wait(0, deps=[acc])
        rows = gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
        phys = pid_n * BN + ((((rows // 16) % WARPS) * 8 + rows % 8) * T + rows // (16 * WARPS)) * 2 + (rows // 8) % 2
        out_tokens = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
        out_offs = gl.expand_dims(out_tokens.to(gl.int64) * N, 0) + gl.expand_dims(phys, 1)
        out_mask = gl.expand_dims(phys < N, 1) & gl.expand_dims(out_tokens < M, 0)
        _store_out(Y, acc, out_offs, out_mask, pid_s, M, N, SPLIT)

    @gluon.jit
    def _store_out(Y, acc, offs, mask, pid_s, M, N, SPLIT: gl.constexpr):
        """A program's output tile at Y + offs: its fp32 partial of K split pid_s (SPLIT: Y is [splits, M, N]) or
        the product in Y's dtype."""
        if SPLIT:
            gl.store(Y + pid_s.to(gl.int64) * M * N + offs, acc, mask=mask)
        else:
            gl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=mask)


def wgmma_supported(dtype: torch.dtype, group_size: int, k: int, device: torch.device | None = None) -> bool:
    """Whether the kernel applies: bf16 / fp16 activations, groups of a multiple of 128, Gluon present, and (for a
    CUDA device) compute capability 9.x (wgmma is Hopper's)."""
    if not (HAS_GLUON and dtype in _DTYPES and group_size % GROUP_STEP == 0 and k % group_size == 0):
        return False
    return device is None or cuda_major(device) == 9


def wgmma_tiles(m: int, n: int, k: int, sms: int,
                tiles: tuple[int, int, int, int] | None = None) -> tuple[int, int, int, int, int]:
    """(warpgroups, T, BM, split, K per split): 64 T columns per warpgroup and BM token rows per program, K split
    in whole iterations until about `programs per SM` programs are in flight."""
    groups, per_group, block_m, per_sm = tiles or wgmma_entry(m)[:4]
    block_m = wgmma_block_m(m, block_m)
    programs = -(-m // block_m) * -(-n // (64 * groups * per_group))
    iters = k // GROUP_STEP
    split = max(1, min(iters, (per_sm * sms) // programs))
    per_split = -(-iters // split) * GROUP_STEP
    return groups, per_group, block_m, -(-k // per_split), per_split


def quant_wgmma(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, kind: int,
                group_size: int, out_features: int, *,
                tiles: tuple[int, int, int, int] | None = None, x_ahead: bool | None = None,
                overlap: bool | None = None, codes3: bool | None = None) -> torch.Tensor:
    """x [M, K] (bf16 / fp16) @ W^T -> [M, N] in x's dtype, W in the kn layout (as `quant_gemm_kn`). `tiles`:
    (warpgroups per program, column tiles of 64 per warpgroup, token rows per program, programs per SM) from a
    sweep; `x_ahead`: x's next slice is loaded into registers an iteration ahead; `overlap`: the dequantized
    weights go through shared memory too and each MMA runs asynchronously under the next iteration (defaults: the
    row count's WGMMA_TILES entry; off with `tiles`); `codes3`: each word's codes placed by three operations
    (`_word_codes`) instead of a shift each (default WGMMA_CODES3)."""
    m, k = check_gluon_kn_args("quant_wgmma", x, qweight, kind, group_size, out_features)
    if tiles is not None and (len(tiles) != 4 or tiles[0] not in (1, 2, 4) or tiles[1] not in (1, 2)
                              or tiles[2] not in (16, 32, 64, 128, 256) or tiles[3] < 1):
        raise ValueError(f"tiles must be (1, 2 or 4 warpgroups, 1 or 2 column tiles each, 16-256 rows a power of "
                         f"two, programs per SM >= 1), got {tiles}")
    if not wgmma_supported(x.dtype, group_size, k, x.device):
        raise ValueError("quant_wgmma runs on CUDA devices of compute capability 9.x only (wgmma)")
    y = torch.empty(m, out_features, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    groups, per_group, block_m, split, per_split = wgmma_tiles(m, out_features, k, sm_count(x.device), tiles)
    flags = wgmma_entry(m)[4:] if tiles is None else (False, False)
    warps = 4 * groups
    partial = y if split == 1 else torch.empty(split, m, out_features, dtype=torch.float32, device=x.device)
    pdl = use_pdl(x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(out_features, 16 * warps * per_group), split)
    _wgmma_kernel[grid](
        x, qweight, scales, offsets, partial, m, out_features, k, x.stride(0), per_split,
        WL=words_layout(warps, per_group), XL=x_stage_layout(warps), XS=x_shared_layout(), GROUP=group_size,
        KIND=kind, WARPS=warps, T=per_group, BM=block_m, FP16=x.dtype == torch.float16, PDL=pdl, SPLIT=split > 1,
        EVEN_N=out_features % (16 * warps * per_group) == 0, XPRE=flags[0] if x_ahead is None else x_ahead,
        ASYNC=flags[1] if overlap is None else overlap, CODES3=WGMMA_CODES3 if codes3 is None else codes3,
        num_warps=warps, **({"launch_pdl": True} if pdl else {}))
    if split > 1:
        sum_splits(partial, y)
    return y
