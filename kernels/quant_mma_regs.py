"""4-bit weight-only GEMV / small GEMM on mma.sync with both operands built in registers (Gluon), over the kn
layout of engine/quant/kn_layout.py: y[M, N] = x[M, K] W^T for bf16 / fp16 activations, groups of a multiple of
128 (AWQ / GPTQ), 1 to 64 rows.

Why: the CUDA-core GEMV (kernels/quant_gemm_kn.py) spends ~4.8 sm_90 loop instructions per 4-bit code (a shift,
a lop3 and an FMA each, plus x's widening and sums) and the plain-Triton tensor-core kernel (kernels/quant_mma_kn.py)
stages x through shared memory with a barrier before each of its eight MMAs per iteration. Here nothing goes
through shared memory: Gluon's explicit layouts let each thread load exactly the words and x elements that its
mma.sync fragments hold, so the layout conversions to the MMA operands are trivial (asserted at compile time).
Offline sm_90 SASS (Triton 3.6): 2.2-2.8 loop instructions per code at 1-8 rows, no LDS / STS. On an H100 it runs
the Llama-8B decode step's AWQ-shaped weights in 2.15 ms at one row (GEMV 2.48) and 3.11 at 16 (3.85); one row is
now bound by memory latency (Nsight Compute: 56 % of the DRAM peak, 62 % of warp cycles waiting on loads), not
issue (bench/results/quant_regs_h100.json).

The mapping (m16n8k16, operand A = a tile of W's output columns, B = x^T, the swapped product Y^T = W X^T):
- An iteration is one group's 128-element slice of K: 16 word rows of the kn layout, 8 codes each.
- Lane (g, t) of a warp (g = lane // 4, t = lane % 4) holds word rows 4 c + t (c = 0..3) of its columns. A word's
  nibbles j and j + 4 make one 32-bit A register: one lop3 puts both codes under the bits of 128 (bf16: the pair
  reads as 128 + q_j, 128 + q_{j+4}; fp16: 1024 + q), so a word is four A registers after three shifts.
- The MMA's K order is therefore a permutation of K: logical k = 16 (2 c + c2) + 8 h + 2 t + p is element
  8 (4 c + t) + 2 c2 + h + 4 p. x is loaded 8 contiguous elements (16 bytes) per lane and word row, and the same
  permutation (reshape + permute of the loaded tile) gives the B operand.
- A thread's 2 T MMA rows are 2 T adjacent output columns (16-byte word loads): logical MMA row
  16 (W i + w) + 8 h' + g is column ((w * 8 + g) T + i) 2 + h' of the program's tile.
- The group's scale is applied after the products, in fp32. Zero-point and symmetric weights enter the MMA as
  q - z (one packed sub.bf16x2 / f16x2 per register, exact), so sum_k w_k x_k = d sum_k (q_k - z) x_k. The min kind
  (w = d q + m) takes v = 128 + q and the group's sum of x: d sum_k v_k x_k + (m - 128 d) sum_k x_k (the products
  of v and x are exact, as in quant_mma_kn).
- K splits across programs until about `programs per SM` are in flight; with the caller's arrival counters the
  last program of a column tile to arrive sums the fp32 partials in split order (kernels/split_sum.py's scheme).

Needs CUDA (Gluon has no CPU interpreter): tests/kernels/test_kernels_quant_mma_regs.py checks it on a GPU machine.
Reference: `engine.quant.group_quant.quant_matmul_ref` of `engine.quant.kn_layout.from_kn(w)`.
"""

from __future__ import annotations

import functools

import torch

from kernels._triton import HAS_TRITON, require_triton, sm_count, triton, use_pdl
from kernels.quant_gemm import KIND_MIN, KIND_SYM, KIND_ZERO
from kernels.split_sum import SUM_BATCH, sum_splits

try:  # pragma: no cover - depends on the Triton version
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

    HAS_GLUON = HAS_TRITON
except ImportError:  # pragma: no cover - depends on the Triton version
    gluon = gl = async_copy = mma_v2 = None  # type: ignore[assignment]
    HAS_GLUON = False

__all__ = ["REGS_MAX_M", "check_gluon_kn_args", "regs_block_m", "regs_supported", "regs_tiles", "quant_mma_regs"]

GROUP_STEP = 128  # K elements per iteration: 16 word rows, one group's slice
REGS_MAX_M = 64  # token rows one program holds (8 per MMA column tile)
# (warps, column tiles of 16 per warp, programs per SM, cp.async stages: 0 = words prefetched into registers) by
# the padded row count they serve: the H100 sweeps' best over the Llama-8B decode step's AWQ-shaped weights
# (bench/results/quant_regs_h100.json run 2: 2.15 ms at 1 row, 2.70 at 4, 3.11 at 16, 4.43 at 32); 64 rows is
# slower than the kn GEMM (12.0 vs 8.1 ms), so the engine sends it 1-8 rows on sm_90 (kernels/quant_wgmma.py from 9)
# and 1-32 elsewhere (kernels/quant_gemm_kn.py REGS_ENGINE_MAX_M, REGS_FALLBACK_MAX_M)
REGS_TILES: dict[int, tuple[int, int, int, int]] = {8: (4, 2, 8, 0), 16: (2, 2, 8, 3), 32: (1, 2, 8, 0), 64: (1, 2, 4, 0)}
REGS_AHEAD = 1  # iterations of words in registers beyond the one in use (2: 2.79 vs 2.15 ms at one row)
REGS_SUBZ = True  # zero-point / symmetric kinds: q - z as the MMA operand (3.25 vs 3.33 ms at 16 rows)
_DTYPES = (torch.bfloat16, torch.float16)  # the activations whose bits hold a code as 128 + q (1024 + q)


def regs_block_m(m: int) -> int:
    """The token rows a program holds for m rows: m padded to a power of two, at least one MMA column tile (8)."""
    return max(8, 1 << (m - 1).bit_length())


def _table_entry(block_m: int) -> tuple[int, int, int, int]:
    """REGS_TILES' entry for a padded row count."""
    return REGS_TILES[next(t for t in sorted(REGS_TILES) if block_m <= t)]


def _bits(n: int) -> list[int]:
    """The powers of two below n (a power of two): one linear-layout basis each."""
    return [1 << i for i in range(n.bit_length() - 1)]


@functools.cache  # (a launch argument: built once per tile, not per call)
def words_layout(warps: int, tiles: int) -> gl.DistributedLinearLayout:
    """[16 warps tiles columns, 16 word rows]: a lane's 2 T adjacent columns in registers (16-byte loads), lane
    bits 0-1 the word row within 4, bits 2-4 the column group g; registers again for word rows 4 and 8."""
    return gl.DistributedLinearLayout(
        reg_bases=[[b, 0] for b in _bits(2 * tiles)] + [[0, 4], [0, 8]],
        lane_bases=[[0, 1], [0, 2]] + [[2 * tiles * b, 0] for b in (1, 2, 4)],
        warp_bases=[[16 * tiles * b, 0] for b in _bits(warps)], block_bases=[], shape=[16 * warps * tiles, 16])


@functools.cache
def x_layout(warps: int, block_m: int) -> gl.DistributedLinearLayout:
    """[BM tokens, 128 elements of K]: 8 contiguous elements per lane and word row (one 16-byte load), lane bits
    0-1 the word row within 4, bits 2-4 the token; every warp holds the whole tile."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 32], [0, 64]] + [[8 * b, 0] for b in _bits(block_m // 8)],
        lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[0, 0] for _ in _bits(warps)], block_bases=[], shape=[block_m, 128])


@functools.cache
def words_shared_layout() -> gl.SwizzledSharedLayout:
    """[columns, 16 word rows] (one buffer of the ring) with columns contiguous (16-byte cp.async per lane) and
    each word row's 16-byte vectors XOR-swizzled, so the four word rows a quarter-warp reads back hit different
    banks."""
    return gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=4, order=[0, 1])


if HAS_GLUON:

    @gluon.jit
    def _pair(w, SHIFT: gl.constexpr, FP16: gl.constexpr, zz, SUBZ: gl.constexpr):
        """Nibbles SHIFT / 4 and SHIFT / 4 + 4 of each word as 16-bit floats 128 + q (bf16; fp16: 1024 + q): the
        (low, high) halves of one lop3's result, which the MMA reads back as that one register. SUBZ: minus zz's
        pair of 128 + z (1024 + z), one packed subtraction (q - z exactly)."""
        MAGIC: gl.constexpr = 0x64006400 if FP16 else 0x43004300
        DT: gl.constexpr = gl.float16 if FP16 else gl.bfloat16
        if SHIFT == 0:  # noqa: SIM108  (a constexpr branch: only one side is compiled)
            moved = w
        else:
            moved = w >> SHIFT
        v = gl.inline_asm_elementwise(f"lop3.b32 $0, $1, 0x000F000F, {MAGIC}, 0xea;", "=r,r", [moved],
                                      dtype=gl.int32, is_pure=True, pack=1)
        if SUBZ:
            sub: gl.constexpr = "sub.f16x2" if FP16 else "sub.bf16x2"
            v = gl.inline_asm_elementwise(f"{sub} $0, $1, $2;", "=r,r,r", [v, zz], dtype=gl.int32, is_pure=True,
                                          pack=1)
        return gl.join(v.to(gl.int16).to(DT, bitcast=True), (v >> 16).to(gl.int16).to(DT, bitcast=True))

    @gluon.jit
    def _pdl_wait():
        """Programmatic dependent launch: wait for the previous kernel's writes, then release the next kernel."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _group_step(acc, w, x_ptrs, x_mask, S, Off, N, phys, n_ok, cols, grp, KIND: gl.constexpr,
                    WARPS: gl.constexpr, T: gl.constexpr, BM: gl.constexpr, FP16: gl.constexpr, mma: gl.constexpr,
                    SUBZ: gl.constexpr):
        """acc + one group's 128-element slice of the product: its words w [BN, 16] (WL) against x's slice.
        SUBZ (zero-point and symmetric kinds): the MMA takes q - z itself (exact in 16 bits), so the product needs
        no sum of x; else it takes 128 + q and the group's sum of x removes the offset."""
        BN: gl.constexpr = 16 * WARPS * T
        MAGIC: gl.constexpr = 0x64006400 if FP16 else 0x43004300
        BIAS: gl.constexpr = 1024.0 if FP16 else 128.0
        xt = gl.load(x_ptrs, mask=x_mask, other=0.0)
        if SUBZ and KIND == 1:  # MAGIC + z in both halves, per column
            z = gl.load(Off + grp * N + cols, mask=cols < N, other=0).to(gl.int32)
            zz = gl.expand_dims((z | (MAGIC & 0xFFFF)) * 65537, 1) + gl.zeros_like(w)
        else:
            zz = gl.zeros_like(w) + MAGIC
        # [BN, 16, 2 (p), 2 (h), 2 (c2)]: nibble pairs (0, 4), (1, 5) | (2, 6), (3, 7)
        a5 = gl.join(gl.join(_pair(w, 0, FP16, zz, SUBZ), _pair(w, 4, FP16, zz, SUBZ)),
                     gl.join(_pair(w, 8, FP16, zz, SUBZ), _pair(w, 12, FP16, zz, SUBZ)))
        a9 = gl.reshape(a5, [WARPS, 8, T, 2, 4, 4, 2, 2, 2])  # (w, g, i, h', c, t, p, h, c2)
        a = gl.reshape(gl.permute(a9, [2, 0, 3, 1, 4, 8, 7, 5, 6]), [BN, 128])
        b6 = gl.reshape(xt, [BM, 4, 4, 2, 2, 2])  # (token, c, t, p, c2, h)
        b = gl.reshape(gl.permute(b6, [1, 4, 5, 2, 3, 0]), [128, BM])
        part = mma_v2(gl.convert_layout(a, gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
                                        assert_trivial=True),
                      gl.convert_layout(b, gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2),
                                        assert_trivial=True),
                      gl.zeros([BN, BM], gl.float32, layout=mma))
        d = gl.load(S + grp * N + phys, mask=n_ok, other=0).to(gl.float16, bitcast=True).to(gl.float32)
        if SUBZ:
            return acc + gl.expand_dims(d, 1) * part
        sum_x = gl.convert_layout(gl.sum(xt.to(gl.float32), axis=1), gl.SliceLayout(0, mma))
        if KIND == 0:  # min: w = d q + m
            c = gl.load(Off + grp * N + phys, mask=n_ok, other=0).to(gl.float16, bitcast=True).to(gl.float32)
        elif KIND == 1:  # zero point: w = d (q - z)
            c = -gl.load(Off + grp * N + phys, mask=n_ok, other=0).to(gl.float32) * d
        else:
            c = gl.zeros_like(d)
        return acc + gl.expand_dims(d, 1) * part + gl.expand_dims(c - BIAS * d, 1) * gl.expand_dims(sum_x, 0)

    @gluon.jit
    def _regs_kernel(X, QW, S, Off, Y, P, Arrivals, M, N, K, stride_xm, K_PER_SPLIT, NUM_SPLITS,
                     WL: gl.constexpr, XL: gl.constexpr, GROUP: gl.constexpr, KIND: gl.constexpr,
                     WARPS: gl.constexpr, T: gl.constexpr, BM: gl.constexpr, FP16: gl.constexpr,
                     PDL: gl.constexpr, SUM_HERE: gl.constexpr, AHEAD: gl.constexpr, STAGES: gl.constexpr,
                     SMEM: gl.constexpr, SUBZ: gl.constexpr):
        """One program: a [16 WARPS T columns] tile of Y's columns over one K split, all BM token rows. With the
        split, its fp32 partial goes to P [NUM_SPLITS, M, N]; SUM_HERE: the last program of the column tile to
        arrive sums them into Y and zeroes its counter (else `sum_splits` does, in a second launch)."""
        BN: gl.constexpr = 16 * WARPS * T
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8])
        pid_n = gl.program_id(0)
        pid_s = gl.program_id(1)
        cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, WL))
        word_rows = gl.arange(0, 16, layout=gl.SliceLayout(0, WL))
        q_ptrs = QW + gl.expand_dims(word_rows, 0) * N + gl.expand_dims(cols, 1)
        q_mask = gl.expand_dims(cols < N, 1)
        tokens = gl.arange(0, BM, layout=gl.SliceLayout(1, XL))
        x_ptrs = (X + gl.expand_dims(tokens.to(gl.int64) * stride_xm, 1)
                  + gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, XL)), 0))
        x_mask = gl.expand_dims(tokens < M, 1)
        # the accumulator's logical rows (MMA order) as the tile's physical columns
        rows = gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
        phys = pid_n * BN + ((((rows // 16) % WARPS) * 8 + rows % 8) * T + rows // (16 * WARPS)) * 2 + (rows // 8) % 2
        n_ok = phys < N
        out_tokens = gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
        out_offs = gl.expand_dims(out_tokens * N, 0) + gl.expand_dims(phys, 1)
        out_mask = gl.expand_dims(n_ok, 1) & gl.expand_dims(out_tokens < M, 0)
        k_start = pid_s * K_PER_SPLIT
        k_end = gl.minimum(k_start + K_PER_SPLIT, K)
        acc = gl.zeros([BN, BM], gl.float32, layout=mma)
        # weights are never written during a step: the first tiles stream before the PDL wait
        if STAGES > 0:  # cp.async into shared memory, STAGES - 1 iterations ahead: each lane copies and later
            # reads back its own words (one layout for both), so no barrier orders them
            bufs = gl.allocate_shared_memory(gl.int32, [STAGES, BN, 16], SMEM)
            for s in gl.static_range(STAGES - 1):
                async_copy.async_copy_global_to_shared(bufs.index(s), q_ptrs + ((k_start + 128 * s) // 8) * N,
                                                       mask=q_mask & (k_start + 128 * s < k_end))
                async_copy.commit_group()
            if PDL:
                _pdl_wait()
            stage = 0
            for k0 in range(k_start, k_end, 128):
                async_copy.wait_group(STAGES - 2)
                w = bufs.index(stage).load(WL)
                k_fill = k0 + 128 * (STAGES - 1)
                async_copy.async_copy_global_to_shared(bufs.index((stage + STAGES - 1) % STAGES),
                                                       q_ptrs + (k_fill // 8) * N, mask=q_mask & (k_fill < k_end))
                async_copy.commit_group()
                acc = _group_step(acc, w, x_ptrs + k0, x_mask, S, Off, N, phys, n_ok, cols, k0 // GROUP, KIND,
                                  WARPS, T, BM, FP16, mma, SUBZ)
                stage = (stage + 1) % STAGES
            async_copy.wait_group(0)
        else:
            w = gl.load(q_ptrs + (k_start // 8) * N, mask=q_mask, other=0)
            if AHEAD == 2:
                w_ahead = gl.load(q_ptrs + ((k_start + 128) // 8) * N, mask=q_mask & (k_start + 128 < k_end),
                                  other=0)
            if PDL:
                _pdl_wait()
            for k0 in range(k_start, k_end, 128):
                if AHEAD == 2:  # two iterations' words in flight
                    w_next = w_ahead
                    w_ahead = gl.load(q_ptrs + ((k0 + 256) // 8) * N, mask=q_mask & (k0 + 256 < k_end), other=0)
                else:
                    w_next = gl.load(q_ptrs + ((k0 + 128) // 8) * N, mask=q_mask & (k0 + 128 < k_end), other=0)
                acc = _group_step(acc, w, x_ptrs + k0, x_mask, S, Off, N, phys, n_ok, cols, k0 // GROUP, KIND,
                                  WARPS, T, BM, FP16, mma, SUBZ)
                w = w_next
        if NUM_SPLITS == 1:
            gl.store(Y + out_offs, acc.to(Y.dtype.element_ty), mask=out_mask)
        else:
            gl.store(P + pid_s.to(gl.int64) * M * N + out_offs, acc, mask=out_mask)
            if SUM_HERE:
                gl.thread_barrier()  # every thread's partial is stored before the arrival is counted
                arrived = gl.atomic_add(Arrivals + pid_n, 1, sem="acq_rel", scope="gpu")
                if arrived == NUM_SPLITS - 1:
                    total = gl.zeros([BN, BM], gl.float32, layout=mma)
                    # L2 reads (other SMs wrote them), SUM_BATCH splits' loads in flight together: the tail costs
                    # NUM_SPLITS / SUM_BATCH L2 latencies, not NUM_SPLITS; the sum stays in split order
                    for first in range(0, NUM_SPLITS, SUM_BATCH):
                        for j in gl.static_range(SUM_BATCH):
                            live = first + j < NUM_SPLITS
                            part = gl.load(P + (first + j) * M * N + out_offs, mask=out_mask & live, other=0.0,
                                           cache_modifier=".cg")
                            total = gl.where(live, total + part, total)
                    gl.store(Y + out_offs, total.to(Y.dtype.element_ty), mask=out_mask)
                    gl.atomic_xchg(Arrivals + pid_n, 0)


def regs_supported(dtype: torch.dtype, group_size: int, k: int) -> bool:
    """Whether the kernel applies: bf16 / fp16 activations, groups of a multiple of 128, Gluon present."""
    return HAS_GLUON and dtype in _DTYPES and group_size % GROUP_STEP == 0 and k % group_size == 0


def regs_tiles(m: int, n: int, k: int, sms: int,
               tiles: tuple[int, int, int] | None = None) -> tuple[int, int, int, int, int]:
    """(warps, T, BM, split, K per split): BM the token rows padded to a multiple of 8 (a power of two), K split
    in whole iterations until about `programs per SM` programs are in flight."""
    block_m = regs_block_m(m)
    warps, per_warp, per_sm = tiles or _table_entry(block_m)[:3]
    tiles_n = -(-n // (16 * warps * per_warp))
    iters = k // GROUP_STEP
    split = max(1, min(iters, (per_sm * sms) // tiles_n))
    per_split = -(-iters // split) * GROUP_STEP
    return warps, per_warp, block_m, -(-k // per_split), per_split


def check_gluon_kn_args(name: str, x: torch.Tensor, qweight: torch.Tensor, kind: int, group_size: int,
                        out_features: int) -> tuple[int, int]:
    """(M, K) of a Gluon int4 kernel's call over the kn layout, or ValueError naming what it does not take: bf16 /
    fp16 x [M, K] with a contiguous last dim, a known kind, groups of a multiple of 128 dividing K, int32 codes
    [K / 8, N]."""
    require_triton(name)
    if not HAS_GLUON:
        raise RuntimeError(f"{name} needs Triton's Gluon (triton.experimental.gluon)")
    if x.dim() != 2 or x.dtype not in _DTYPES or x.stride(-1) != 1:
        raise ValueError(f"x must be [M, K] bf16 / fp16 with a contiguous last dim, got {x.dtype} "
                         f"{tuple(x.shape)}")
    m, k = x.shape
    if kind not in (KIND_MIN, KIND_ZERO, KIND_SYM):
        raise ValueError(f"unsupported kind {kind}")
    if group_size % GROUP_STEP or k % group_size:
        raise ValueError(f"group_size={group_size} must be a multiple of {GROUP_STEP} dividing K={k}")
    if qweight.dtype != torch.int32 or qweight.shape != (k // 8, out_features) or not qweight.is_contiguous():
        raise ValueError(f"qweight must be contiguous int32 [{k // 8}, {out_features}]")
    return m, k


def quant_mma_regs(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, kind: int,
                   group_size: int, out_features: int, *, tiles: tuple[int, int, int] | None = None,
                   arrivals: torch.Tensor | None = None, ahead: int | None = None,
                   stages: int | None = None, subz: bool | None = None) -> torch.Tensor:
    """x [M, K] (bf16 / fp16, M <= REGS_MAX_M) @ W^T -> [M, N] in x's dtype, W in the kn layout (as
    `quant_gemm_kn`). `tiles`: (warps, column tiles per warp, programs per SM) from a sweep. `arrivals`: int32 zeros
    from `kernels.quant_gemm_kn.new_arrivals`, used by one call at a time: the split is then summed in the same
    launch, and they are zero again when it returns. `ahead`: iterations of words loaded ahead into registers
    (1 or 2); `stages` > 1: cp.async into that many shared-memory buffers instead (0: registers; default: the row
    count's REGS_TILES entry, 0 with `tiles`); `subz`: the zero-point and symmetric kinds subtract z in the MMA
    operand instead of summing x (default REGS_SUBZ)."""
    m, k = check_gluon_kn_args("quant_mma_regs", x, qweight, kind, group_size, out_features)
    if not 1 <= m <= REGS_MAX_M:
        raise ValueError(f"quant_mma_regs takes 1 to {REGS_MAX_M} rows, got {m}")
    ahead = REGS_AHEAD if ahead is None else ahead
    if stages is None:  # the row count's table entry; none with tiles from a sweep
        stages = _table_entry(regs_block_m(m))[3] if tiles is None else 0
    if ahead not in (1, 2):
        raise ValueError(f"ahead must be 1 or 2, got {ahead}")
    if stages == 1 or not 0 <= stages <= 8:
        raise ValueError(f"stages must be 0 (registers) or 2-8, got {stages}")
    if x.device.type != "cuda":
        raise ValueError("quant_mma_regs runs on CUDA only (Gluon has no CPU interpreter)")
    warps, per_warp, block_m, split, per_split = regs_tiles(m, out_features, k, sm_count(x.device), tiles)
    tiles_n = triton.cdiv(out_features, 16 * warps * per_warp)
    if arrivals is not None and (arrivals.dtype != torch.int32 or arrivals.numel() < tiles_n):
        raise ValueError(f"arrivals must be int32 with at least {tiles_n} entries")
    y = torch.empty(m, out_features, dtype=x.dtype, device=x.device)
    fused = split > 1 and arrivals is not None
    partial = y if split == 1 else torch.empty(split, m, out_features, dtype=torch.float32, device=x.device)
    pdl = use_pdl(x.device)
    _regs_kernel[(tiles_n, split)](
        x, qweight, scales, offsets, y, partial, arrivals if fused else y, m, out_features, k, x.stride(0),
        per_split, split, WL=words_layout(warps, per_warp), XL=x_layout(warps, block_m), GROUP=group_size,
        KIND=kind, WARPS=warps, T=per_warp, BM=block_m, FP16=x.dtype == torch.float16, PDL=pdl, SUM_HERE=fused,
        AHEAD=ahead, STAGES=stages, SMEM=words_shared_layout(),
        SUBZ=(REGS_SUBZ if subz is None else subz) and kind != KIND_MIN,
        num_warps=warps, **({"launch_pdl": True} if pdl else {}))
    if split > 1 and not fused:
        sum_splits(partial, y)
    return y
