"""4-bit weight-only GEMM for Hopper's warpgroup MMA with both operands in shared memory (Gluon), over the kn layout
of engine/quant/kn_layout.py: y[M, N] = x[M, K] W^T for bf16 / fp16 activations, groups of a multiple of 128
(AWQ / GPTQ), a hundred token rows and more (large decode batches, prefill chunks).

Why: kernels/quant_wgmma.py keeps the dequantized weights in registers as the MMA's A operand, so its MMA is
synchronous (an asynchronous MMA would read registers the next iteration rewrites) and x goes through registers
into shared memory in the operand's permuted K order. From 128 rows it runs at half of bf16's speed: every warp
waits on its own MMA and on x's L2 latency, and x is read once per 128 weight columns. Here the roles turn:
- x is the MMA's A operand (token rows as M, 64 or 128 per warpgroup), copied by TMA, in K's natural order, into
  a ring of shared-memory stages loaded `S - 2` iterations ahead;
- the weights are its B operand: each thread dequantizes whole 32-bit words (8 codes = 8 consecutive k of one
  column) into 16 contiguous bytes of a [BN, 64] tile in shared memory, so no permutation is needed anywhere, and
  up to 256 columns share each x tile (instruction N = BN);
- the MMA is asynchronous: iteration i's dequantization runs while MMA i - 1 is in flight.

Hazards (written invariants): each iteration starts with a block barrier, which every warpgroup reaches after
its wait (at most one MMA in flight) of the iteration before, so MMA i - 2 is done there. Past it, iteration i
stores its dequantized tile into buffer i % 2 and issues x's TMA for iteration i + S - 2 into the slot of iteration
i - 2: both last read by MMA i - 2. A second barrier (after a proxy fence) orders the tile's stores before MMA i.
Gluon's shared-memory analysis adds one barrier of its own (between the mbarrier's expect and the TMA issue).

An iteration is half a group (64 k): 8 word rows. Each code, moved to bits 12-15 or 16-19 (`_word_code`), becomes
fp32 d (2^11 + q) + (c - 2048 d) or d (2^7 + q) + (c - 128 d) = d q + c exactly, rounded once to the activations'
dtype: the operand is the dense checkpoint's 16-bit weight bit for bit (zero-point and symmetric weights). K splits
across programs until about `programs per SM` are in flight; the fp32 partials are summed by a second launch
(kernels/split_sum.py).

Needs CUDA on sm_90 (wgmma, TMA; Gluon has no CPU interpreter): tests/kernels/test_kernels_quant_wgmma_smem.py checks
it on a GPU machine. Reference: `engine.quant.group_quant.quant_matmul_ref` of `engine.quant.kn_layout.from_kn(w)`.
"""

from __future__ import annotations

import functools

import torch

from kernels._triton import sm_count, triton, use_pdl
from kernels.quant_mma_regs import HAS_GLUON, check_gluon_kn_args
from kernels.quant_wgmma import wgmma_supported
from kernels.split_sum import sum_splits

if HAS_GLUON:  # pragma: no cover - depends on the Triton version
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from kernels.quant_wgmma import _affine, _store_out, _word_codes

__all__ = ["SMEM_TILES", "smem_tiles", "quant_wgmma_smem"]

K_STEP = 64  # K elements per iteration: 8 word rows, half a group; x's TMA box is [BM, 64] (128-byte rows)
# (columns per program BN, warps, x stages S, programs per SM, token rows per program BM: 16 or 32 a warp, i.e. one
# or two 64-row MMA blocks a warpgroup) by the row count they serve: the H100 sweep's best at every row count from
# 64 to 1024 (bench/results/quant_smem_h100.json; 256 columns were 5-15 % slower, 4 warps slower still). Two blocks
# a warpgroup (BM 256 with 8 warps) dequantize each weight tile once per 256 rows instead of 128: compiled offline
# only (bench/results/int4_smem_sass_offline.json), not yet timed
SMEM_TILES: dict[int, tuple[int, int, int, int, int]] = {1 << 20: (128, 8, 3, 2, 128)}


def smem_entry(m: int) -> tuple[int, int, int, int, int]:
    """SMEM_TILES' entry for m rows (the last one past the table)."""
    return SMEM_TILES[next((t for t in sorted(SMEM_TILES) if m <= t), max(SMEM_TILES))]


@functools.cache
def operand_layout() -> gl.NVMMASharedLayout:
    """[rows, 64] bf16 / fp16 with 128-byte rows, 128-byte swizzle: x's TMA box (wgmma's A) and the dequantized
    weights (wgmma's B, as its transpose)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


@functools.cache
def words_layout(warps: int, bn: int) -> gl.BlockedLayout:
    """[BN columns, 8 word rows]: lanes over consecutive columns (coalesced loads; the 16-byte stores of a warp
    land on 32 consecutive rows of the swizzled tile, conflict-free), warps over columns first, then word rows."""
    warps_n = min(warps, bn // 32)
    warps_r = warps // warps_n
    return gl.BlockedLayout(size_per_thread=[1, 8 // warps_r], threads_per_warp=[32, 1],
                            warps_per_cta=[warps_n, warps_r], order=[1, 0])


@functools.cache
def tile_layout(warps: int, bn: int) -> gl.BlockedLayout:
    """[BN, 64] dequantized: each thread's words as 8 contiguous elements each (words_layout, codes unrolled)."""
    warps_n = min(warps, bn // 32)
    warps_r = warps // warps_n
    return gl.BlockedLayout(size_per_thread=[1, 64 // warps_r], threads_per_warp=[32, 1],
                            warps_per_cta=[warps_n, warps_r], order=[1, 0])


if HAS_GLUON:
    @gluon.jit
    def _dequant_tile(w, S, Off, grp, N, cols, KIND: gl.constexpr, BN: gl.constexpr, TL: gl.constexpr,
                      FP16: gl.constexpr):
        """Words [BN, 8] (one per word row) -> [BN, 64] codes in K's natural order: element (n, 8 r + j) is code j
        of word row r."""
        d, c4 = _affine(S, Off, grp * N + cols, KIND)  # c4 = c - 128 d
        d = gl.expand_dims(d, 1)
        c4 = gl.expand_dims(c4, 1)
        # [BN, 8, 2, 2, 2]: code 4 a + 2 b + p of each word at (.., a, b, p)
        codes = _word_codes(w, d, c4)
        DT: gl.constexpr = gl.float16 if FP16 else gl.bfloat16
        tile = gl.reshape(codes, [BN, 64]).to(DT)
        return gl.convert_layout(tile, TL, assert_trivial=True)

    @gluon.jit
    def _smem_kernel(x_desc, QW, S, Off, Y, M, N, K, ITERS_PER_SPLIT, WL: gl.constexpr, TL: gl.constexpr,
                     GROUP: gl.constexpr, KIND: gl.constexpr, WARPS: gl.constexpr, BN: gl.constexpr,
                     STAGES: gl.constexpr, FP16: gl.constexpr, PDL: gl.constexpr, SPLIT: gl.constexpr,
                     EVEN_N: gl.constexpr, BM: gl.constexpr):
        """One program: BM token rows (16 WARPS: 64 a warpgroup, or 32 WARPS: two 64-row MMA blocks a warpgroup)
        x BN columns over one K split (SPLIT: its fp32 partial to Y [splits, M, N])."""
        AHEAD: gl.constexpr = STAGES - 2  # x iterations in flight beyond the current one
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                      instr_shape=[16, BN, 16])
        pid_m = gl.program_id(0)
        pid_n = gl.program_id(1)
        pid_s = gl.program_id(2)
        cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, WL))
        if not EVEN_N:  # (a clamp breaks vectorized word loads: only for a ragged last column tile)
            cols = gl.minimum(cols, N - 1)
        word_rows = gl.arange(0, 8, layout=gl.SliceLayout(0, WL))
        q_ptrs = QW + gl.expand_dims(word_rows, 0) * N + gl.expand_dims(cols, 1)
        it_start = pid_s * ITERS_PER_SPLIT
        it_end = gl.minimum(it_start + ITERS_PER_SPLIT, K // 64)
        n_it = it_end - it_start

        x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, 64], x_desc.layout)
        b_bufs = gl.allocate_shared_memory(x_desc.dtype, [2, BN, 64], x_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        acc = gl.zeros([BM, BN], gl.float32, layout=mma)
        # weights are never written during a step: the first words stream before the PDL wait
        w = gl.load(q_ptrs + it_start * 8 * N)
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                                      pack=1)
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
        m0 = pid_m * BM
        for a in gl.static_range(AHEAD):
            mbarrier.expect(bars.index(a), x_desc.block_type.nbytes, pred=a < n_it)
            tma.async_copy_global_to_shared(x_desc, [m0, (it_start + a) * 64], bars.index(a), x_bufs.index(a),
                                            pred=a < n_it)
        for i in range(n_it):
            it = it_start + i
            it_next = gl.minimum(it + 1, it_end - 1)  # (the last iteration loads itself again)
            w_next = gl.load(q_ptrs + it_next * 8 * N)
            tile = _dequant_tile(w, S, Off, (it * 64) // GROUP, N, cols, KIND, BN, TL, FP16)
            gl.thread_barrier()  # every warpgroup is past iteration i - 1's wait: MMA i - 2 is done
            ahead = i + AHEAD  # (its slot is iteration i - 2's)
            slot = ahead % STAGES
            mbarrier.expect(bars.index(slot), x_desc.block_type.nbytes, pred=ahead < n_it)
            tma.async_copy_global_to_shared(x_desc, [m0, (it_start + ahead) * 64], bars.index(slot),
                                            x_bufs.index(slot), pred=ahead < n_it)
            b_buf = b_bufs.index(i % 2)  # (last read by MMA i - 2)
            b_buf.store(tile)
            fence_async_shared()
            gl.thread_barrier()  # the whole tile is stored before the MMA reads it
            mbarrier.wait(bars.index(i % STAGES), (i // STAGES) & 1)
            acc = warpgroup_mma(x_bufs.index(i % STAGES), b_buf.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=[acc])
            w = w_next
        acc = warpgroup_mma_wait(0, deps=[acc])
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))
        tokens = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
        out_cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
        out_offs = gl.expand_dims(tokens.to(gl.int64) * N, 1) + gl.expand_dims(out_cols, 0)
        out_mask = gl.expand_dims(tokens < M, 1) & gl.expand_dims(out_cols < N, 0)
        _store_out(Y, acc, out_offs, out_mask, pid_s, M, N, SPLIT)


def smem_tiles(m: int, n: int, k: int, sms: int,
               tiles: tuple[int, int, int, int, int] | None = None) -> tuple[int, int, int, int, int, int]:
    """(BM, BN, warps, stages, split, iterations per split): K split in whole iterations until about `programs per
    SM` programs are in flight."""
    bn, warps, stages, per_sm, bm = tiles or smem_entry(m)
    programs = -(-m // bm) * -(-n // bn)
    iters = k // K_STEP
    split = max(1, min(iters, (per_sm * sms) // programs))
    per_split = -(-iters // split)
    return bm, bn, warps, stages, -(-iters // per_split), per_split


def smem_applies(x: torch.Tensor) -> bool:
    """TMA's conditions on x: 16-byte aligned base and row stride (the kernel's other conditions are
    `wgmma_supported`'s)."""
    return x.data_ptr() % 16 == 0 and (x.stride(0) * x.element_size()) % 16 == 0


def quant_wgmma_smem(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                     kind: int, group_size: int, out_features: int, *,
                     tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (bf16 / fp16) @ W^T -> [M, N] in x's dtype, W in the kn layout (as `quant_gemm_kn`). `tiles`:
    (columns per program 128 / 256, warps 4 / 8, x stages 3-5, programs per SM, token rows per program 16 or 32 a
    warp) from a sweep (default: the row count's SMEM_TILES entry)."""
    m, k = check_gluon_kn_args("quant_wgmma_smem", x, qweight, kind, group_size, out_features)
    if tiles is not None and (len(tiles) != 5 or tiles[0] not in (128, 256) or tiles[1] not in (4, 8)
                              or tiles[2] not in (3, 4, 5) or tiles[3] < 1 or tiles[4] not in (16 * tiles[1],
                                                                                              32 * tiles[1])):
        raise ValueError(f"tiles must be (128 or 256 columns, 4 or 8 warps, 3-5 x stages, programs per SM >= 1, "
                         f"16 or 32 token rows a warp), got {tiles}")
    if not wgmma_supported(x.dtype, group_size, k, x.device):
        raise ValueError("quant_wgmma_smem runs on CUDA devices of compute capability 9.x only (wgmma)")
    if not smem_applies(x):
        raise ValueError("x must have a 16-byte aligned base and row stride (TMA)")
    y = torch.empty(m, out_features, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bm, bn, warps, stages, split, per_split = smem_tiles(m, out_features, k, sm_count(x.device), tiles)
    partial = y if split == 1 else torch.empty(split, m, out_features, dtype=torch.float32, device=x.device)
    x_desc = TensorDescriptor.from_tensor(x, [bm, K_STEP], operand_layout())
    pdl = use_pdl(x.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(out_features, bn), split)
    _smem_kernel[grid](
        x_desc, qweight, scales, offsets, partial, m, out_features, k, per_split,
        WL=words_layout(warps, bn), TL=tile_layout(warps, bn), GROUP=group_size, KIND=kind, WARPS=warps, BN=bn,
        STAGES=stages, FP16=x.dtype == torch.float16, PDL=pdl, SPLIT=split > 1, EVEN_N=out_features % bn == 0,
        BM=bm, num_warps=warps, **({"launch_pdl": True} if pdl else {}))
    if split > 1:
        sum_splits(partial, y)
    return y
