"""Small-batch linear layer (decode at 1-16 tokens) with the neighbouring elementwise work fused in.

At batch 1 a decode step is a chain of weight-streaming GEMVs with small kernels between them (RMSNorm, SwiGLU,
cuBLAS's split-K reduce); on Llama-8B each boundary costs ~1 us of idle GPU and the small kernels ~0.4 ms per
token. This kernel streams the weight once per call and folds in what sits before or after it:

- prologue `norm`: y = rms_norm(x [+ residual]) @ W^T; the residual sum is also written out (vLLM's fused
  add + RMSNorm semantics: the norm uses the fp32 sum, the stored residual is rounded to its dtype);
- prologue `silu`: x is [M, 2I] = gate | up, y = (silu(gate) * up) @ W^T (the activation rounded to the weight
  dtype, as the separate SwiGLU kernel stores it);
- epilogue: bias, and optionally each program's row max / argmax of its output columns (the greedy sampler's
  argmax over the vocabulary then reduces a few thousand partials instead of re-reading the logits).

Each program owns BLOCK_N output columns for all M (<= 16) rows, so no split-K reduction is needed; the row tile
is padded to 16 for `tl.dot`, whose shared-memory pipeline keeps the weight stream at copy bandwidth. Every
program recomputes the prologue for its K tiles: for one row (batch-1 decode) that is a [BLOCK_K] vector
broadcast to the padded tile, cheap; for 2-16 rows it runs on the padded [16, BLOCK_K] tile, which made SwiGLU
prologues 2-6x slower than cuBLAS on an H100 (bench/GPU_NOTES.md), so the engine uses this kernel for single-row
steps. Rows of x are re-read by every program, from L2 (a few KB). The torch reference is `small_gemm_ref`.
"""

from __future__ import annotations

from dataclasses import dataclass

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

__all__ = ["MAX_ROWS", "GemvConfig", "prefers_gemv_head", "small_gemm", "small_gemm_ref", "argmax_from_partials", "PROLOGUES"]

MAX_ROWS = 16
PROLOGUES = ("none", "norm", "silu")
_PROLOGUE_CODE = {"none": 0, "norm": 1, "silu": 2}
_BLOCK_M = 16

if HAS_TRITON:

    @triton.jit
    def _row_rstd(X, Res, ResOut, K, eps, pid, HAS_RESIDUAL: tl.constexpr, BLOCK_K: tl.constexpr):
        """One row's 1 / rms of x (+ residual); program 0 stores the residual sum."""
        sq = 0.0
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            s = tl.load(X + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                s += tl.load(Res + offs_k, mask=mask_k, other=0.0).to(tl.float32)
                if pid == 0:
                    tl.store(ResOut + offs_k, s.to(ResOut.dtype.element_ty), mask=mask_k)
            sq += tl.sum(s * s, axis=0)
        return 1.0 / tl.sqrt(sq / K + eps)

    @triton.jit
    def _row_operand(X, Res, NormW, W, offs_k, mask_k, K, rstd, PROLOGUE: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr):
        """One row's [BLOCK_K] slice of prologue(x), rounded to the weight dtype as the unfused kernels store it."""
        if PROLOGUE == 2:
            gate = tl.load(X + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            up = tl.load(X + K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            a = (gate / (1.0 + tl.exp(-gate)) * up).to(W.dtype.element_ty)
        elif PROLOGUE == 1:
            s = tl.load(X + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                s += tl.load(Res + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            nw = tl.load(NormW + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            a = (s * rstd * nw).to(W.dtype.element_ty)
        else:
            a = tl.load(X + offs_k, mask=mask_k, other=0.0).to(W.dtype.element_ty)
        return a


    @triton.jit
    def _small_gemm_kernel(
        X, Res, ResOut, NormW, W, Bias, Y, PartMax, PartIdx,
        M, N, K,
        stride_xm, stride_rm, stride_om, stride_wn, stride_ym,
        eps,
        PROLOGUE: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        ARGMAX: tl.constexpr,
        UPCAST: tl.constexpr,
        ONE_ROW: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_wait(PDL)
        pid = tl.program_id(0)
        offs_m = tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm
        rstd1 = 1.0
        if PROLOGUE == 1 and ONE_ROW:
            rstd1 = _row_rstd(X, Res, ResOut, K, eps, pid, HAS_RESIDUAL, BLOCK_K)
        if PROLOGUE == 1 and not ONE_ROW:
            # First pass over K: the rows' mean square (and the residual sum, stored once by program 0).
            sq = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < K
                mask = mask_m[:, None] & mask_k[None, :]
                s = tl.load(x_rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
                if HAS_RESIDUAL:
                    s += tl.load(Res + offs_m.to(tl.int64)[:, None] * stride_rm + offs_k[None, :], mask=mask,
                                 other=0.0).to(tl.float32)
                    if pid == 0:
                        tl.store(ResOut + offs_m.to(tl.int64)[:, None] * stride_om + offs_k[None, :],
                                 s.to(ResOut.dtype.element_ty), mask=mask)
                sq += tl.sum(s * s, axis=1)
            rstd = 1.0 / tl.sqrt(sq / K + eps)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        w_cols = W + offs_n.to(tl.int64)[None, :] * stride_wn
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            if ONE_ROW:
                # One real row: the prologue runs on a [BLOCK_K] vector, which is then broadcast to the 16 rows
                # tl.dot needs (the copies are masked at the store), so the padding costs no arithmetic.
                a1 = _row_operand(X, Res, NormW, W, offs_k, mask_k, K, rstd1, PROLOGUE, HAS_RESIDUAL)
                a = tl.broadcast_to(a1[None, :], (BLOCK_M, BLOCK_K))
            else:
                mask = mask_m[:, None] & mask_k[None, :]
                if PROLOGUE == 2:
                    gate = tl.load(x_rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
                    up = tl.load(x_rows + K + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
                    a = (gate / (1.0 + tl.exp(-gate)) * up).to(W.dtype.element_ty)
                elif PROLOGUE == 1:
                    s = tl.load(x_rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
                    if HAS_RESIDUAL:
                        s += tl.load(Res + offs_m.to(tl.int64)[:, None] * stride_rm + offs_k[None, :], mask=mask,
                                     other=0.0).to(tl.float32)
                    nw = tl.load(NormW + offs_k, mask=mask_k, other=0.0).to(tl.float32)
                    a = (s * rstd[:, None] * nw[None, :]).to(W.dtype.element_ty)
                else:
                    a = tl.load(x_rows + offs_k[None, :], mask=mask, other=0.0).to(W.dtype.element_ty)
            w = tl.load(w_cols + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            if UPCAST:  # fp32 weights (no TF32), or bf16 under the CPU interpreter, whose tl.dot cannot
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, w)
        if HAS_BIAS:
            acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        out = acc.to(Y.dtype.element_ty)
        tl.store(Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], out,
                 mask=mask_m[:, None] & mask_n[None, :])
        if ARGMAX:  # over the values as stored, so the result is the argmax of Y
            vals = tl.where(mask_n[None, :], out.to(tl.float32), float("-inf"))
            best = tl.max(vals, axis=1)
            first = tl.min(tl.where(vals == best[:, None], offs_n[None, :], N), axis=1)
            parts = tl.num_programs(0)
            tl.store(PartMax + offs_m * parts + pid, best, mask=mask_m)
            tl.store(PartIdx + offs_m * parts + pid, first, mask=mask_m)

    @triton.jit
    def _argmax_reduce_kernel(PartMax, PartIdx, Out, P, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        row = tl.program_id(0)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_idx = tl.full([BLOCK], 2147483647, tl.int32)
        for p0 in range(0, P, BLOCK):
            offs = p0 + tl.arange(0, BLOCK)
            mask = offs < P
            v = tl.load(PartMax + row * P + offs, mask=mask, other=float("-inf"))
            i = tl.load(PartIdx + row * P + offs, mask=mask, other=2147483647)
            take = (v > best) | ((v == best) & (i < best_idx))
            best = tl.where(take, v, best)
            best_idx = tl.where(take, i, best_idx)
        top = tl.max(best, axis=0)
        idx = tl.min(tl.where(best == top, best_idx, 2147483647), axis=0)
        tl.store(Out + row, idx.to(tl.int64))


if HAS_TRITON:

    @triton.jit
    def _gemv_kernel(
        X, Res, ResOut, NormW, W, Bias, Y, PartMax, PartIdx,
        N, K, stride_wn, eps,
        PROLOGUE: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        ARGMAX: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PIPELINED: tl.constexpr,
        PREFETCH: tl.constexpr,
        EVICT: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """One row, no tensor cores: the prologue stays in registers (no trip through shared memory into the
        MMA), products accumulate elementwise in a [BLOCK_N, BLOCK_K] tile reduced once at the end.

        PIPELINED keeps the next weight tile (and operand slice) in flight while this one is multiplied, so each
        program has two tiles of loads outstanding instead of one. PREFETCH (with PDL) issues the first weight
        tile before `pdl_wait`: weights are never written during a step, so the program streams them while the
        previous kernel drains, and only the activations wait."""
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        offs_b = tl.arange(0, BLOCK_K)
        w_rows = W + offs_n.to(tl.int64)[:, None] * stride_wn
        if PDL and PREFETCH:
            w = tl.load(w_rows + offs_b[None, :], mask=mask_n[:, None] & (offs_b < K)[None, :], other=0.0,
                        eviction_policy=EVICT)
        pdl_wait(PDL)
        if not (PDL and PREFETCH):
            w = tl.load(w_rows + offs_b[None, :], mask=mask_n[:, None] & (offs_b < K)[None, :], other=0.0,
                        eviction_policy=EVICT)
        rstd = 1.0
        if PROLOGUE == 1:
            rstd = _row_rstd(X, Res, ResOut, K, eps, pid, HAS_RESIDUAL, BLOCK_K)
        a = _row_operand(X, Res, NormW, W, offs_b, offs_b < K, K, rstd, PROLOGUE, HAS_RESIDUAL)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(BLOCK_K, K + BLOCK_K, BLOCK_K):  # k0: the next tile (past K on the last pass: masked)
            offs_k = k0 + offs_b
            mask_k = offs_k < K
            if PIPELINED:
                w_next = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                                 eviction_policy=EVICT)
                a_next = _row_operand(X, Res, NormW, W, offs_k, mask_k, K, rstd, PROLOGUE, HAS_RESIDUAL)
                acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
                w, a = w_next, a_next
            else:
                acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
                w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                            eviction_policy=EVICT)
                a = _row_operand(X, Res, NormW, W, offs_k, mask_k, K, rstd, PROLOGUE, HAS_RESIDUAL)
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        out = y.to(Y.dtype.element_ty)
        tl.store(Y + offs_n, out, mask=mask_n)
        if ARGMAX:
            vals = tl.where(mask_n, out.to(tl.float32), float("-inf"))
            best = tl.max(vals, axis=0)
            tl.store(PartMax + pid, best)
            tl.store(PartIdx + pid, tl.min(tl.where(vals == best, offs_n, N), axis=0))


@dataclass(frozen=True)
class GemvConfig:
    """Tiling and load streaming of the one-row kernel (impl="gemv"); None tiles come from the shape.

    Defaults from bench/gpu_gemv.py on an H200 (every layer's GEMVs back to back with distinct weights, as in a
    decode step): prefetching the first weight tile before `pdl_wait` took the Llama-8B step's GEMVs from 3.74 to
    3.37 ms together with the tiles below; the pipelined loads and the evict-first hint changed little once the
    tiles were wide, so they stay off."""

    block_n: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    pipelined: bool = False  # next weight tile in flight while this one is multiplied
    prefetch: bool = True  # with PDL, the first weight tile loads before waiting on the previous kernel
    evict_first: bool = False  # weights are read once per step: ask L2 to drop them first

    def tiles(self, n: int, k: int, sm_count: int, argmax: bool = False) -> tuple[int, int, int]:
        """(BLOCK_N, BLOCK_K, num_warps). 4 rows x 1024 weights per program (8 KiB per load round; rows of 512
        when K is shorter); where 4-row programs would number fewer than 4 per SM (narrow outputs such as
        Qwen-0.5B's 896 / 1152 columns), 8 rows x 1024 (x 2048 with 8 warps when K >= 4096) so each program
        streams more; and 8 rows for the vocabulary projection, whose argmax partials the reduce kernel reads."""
        few_programs = n // 4 < 4 * sm_count
        block_n, block_k = (8, 2048 if k >= 4096 else 1024) if few_programs else (4, 1024 if k >= 1024 else 512)
        block_n = 8 if argmax else block_n
        block_k = min(block_k, max(16, 1 << (k - 1).bit_length()))  # no tile wider than K needs
        block_n, block_k = self.block_n or block_n, self.block_k or block_k
        return block_n, block_k, self.num_warps or (8 if block_n * block_k >= 16384 else 4)

    @staticmethod
    def parse(text: str) -> GemvConfig:
        """'none' or a comma list of the streaming flags (pipelined, prefetch, evict_first): the A/B switch."""
        flags = {f.strip() for f in text.split(",") if f.strip() and f.strip() != "none"}
        unknown = flags - {"pipelined", "prefetch", "evict_first"}
        if unknown:
            raise ValueError(f"unknown GEMV streaming flags {sorted(unknown)}; use pipelined, prefetch, evict_first")
        return GemvConfig(pipelined="pipelined" in flags, prefetch="prefetch" in flags,
                          evict_first="evict_first" in flags)


def prefers_gemv_head(hidden: int) -> bool:
    """Whether the vocabulary projection (with the fused argmax) runs faster on the GEMV than on the tl.dot kernel:
    for long rows (Llama-8B, 4096: 250 vs 275 us on an H200); for short ones the tensor-core kernel's multi-stage
    pipeline wins (Qwen-0.5B, 896: 81 vs 88 us)."""
    return hidden >= 2048


def _config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages): enough programs to cover every SM several times, K tiles long
    enough for wide loads. Chosen by bench/gpu_kernels.py on an H200."""
    block_n = 32 if n <= 16384 else 64
    block_k = 256 if k >= 256 else max(16, 1 << (k - 1).bit_length())
    return block_n, block_k, 4, 4


def _check(x: torch.Tensor, weight: torch.Tensor, prologue: str, residual: torch.Tensor | None,
           norm_weight: torch.Tensor | None, bias: torch.Tensor | None) -> int:
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue must be one of {PROLOGUES}, got {prologue!r}")
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"small_gemm takes at most {MAX_ROWS} rows, got {x.shape[0]}")
    k = weight.shape[1]
    if x.shape[1] != (2 * k if prologue == "silu" else k):
        raise ValueError(f"x {tuple(x.shape)} does not fit weight {tuple(weight.shape)} with prologue {prologue}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("x and weight need a contiguous last dim")
    if prologue == "norm":
        if norm_weight is None or norm_weight.shape != (k,):
            raise ValueError(f"the norm prologue needs norm_weight [{k}]")
        if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
            raise ValueError("residual must match x, with a contiguous last dim")
    elif residual is not None:
        raise ValueError("a residual is only added by the norm prologue")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}]")
    return k


def small_gemm(x: torch.Tensor, weight: torch.Tensor, *, prologue: str = "none", bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
               out: torch.Tensor | None = None, argmax: bool = False,
               config: tuple[int, ...] | None = None, impl: str = "dot", gemv: GemvConfig | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """y = prologue(x) @ weight^T (+ bias) for x of <= MAX_ROWS rows.

    Returns (y, residual_sum, argmax): residual_sum is x + residual (a new tensor) when the norm prologue adds a
    residual, else None; argmax ([M] int64, first index of the row max of y) when asked for, else None. `out` may
    give y's buffer (any float dtype, e.g. float32 logits); `config` overrides the (BLOCK_N, BLOCK_K, num_warps,
    num_stages) heuristic of the tl.dot kernel (the benchmark's sweep). `impl="gemv"` runs a single row on CUDA
    cores instead, tiled and streamed as `gemv` says (default GemvConfig()).
    """
    require_triton("small_gemm")
    k = _check(x, weight, prologue, residual, norm_weight, bias)
    m, n = x.shape[0], weight.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{m}, {n}] with a contiguous last dim")
    residual_sum = torch.empty_like(x) if residual is not None else None
    if impl not in ("dot", "gemv"):
        raise ValueError(f"impl must be 'dot' or 'gemv', got {impl!r}")
    gemv_cfg = (gemv or GemvConfig()) if impl == "gemv" and m == 1 else None
    if gemv_cfg is not None:
        block_n, block_k, num_warps = gemv_cfg.tiles(n, k, sm_count(x.device), argmax)
    else:
        block_n, block_k, num_warps, num_stages = config or _config(n, k)  # type: ignore[misc]
    grid = triton.cdiv(n, block_n)
    part_max = part_idx = tokens = None
    if argmax:
        part_max = torch.empty((m, grid), dtype=torch.float32, device=x.device)
        part_idx = torch.empty((m, grid), dtype=torch.int32, device=x.device)
        tokens = torch.empty(m, dtype=torch.int64, device=x.device)
    if m == 0:
        return out, residual_sum, tokens
    if gemv_cfg is not None:
        _gemv_kernel[(grid,)](
            x, residual if residual is not None else x, residual_sum if residual_sum is not None else x,
            norm_weight if norm_weight is not None else weight, weight, bias if bias is not None else weight, out,
            part_max if part_max is not None else out, part_idx if part_idx is not None else out,
            n, k, weight.stride(0), float(eps),
            PROLOGUE=_PROLOGUE_CODE[prologue], HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
            ARGMAX=argmax, BLOCK_N=block_n, BLOCK_K=block_k, PIPELINED=gemv_cfg.pipelined,
            PREFETCH=gemv_cfg.prefetch, EVICT="evict_first" if gemv_cfg.evict_first else "",
            num_warps=num_warps, **pdl_launch(x.device),
        )
        if argmax:
            argmax_from_partials(part_max, part_idx, tokens)  # type: ignore[arg-type]
        return out, residual_sum, tokens
    _small_gemm_kernel[(grid,)](
        x, residual if residual is not None else x, residual_sum if residual_sum is not None else x,
        norm_weight if norm_weight is not None else weight, weight, bias if bias is not None else weight, out,
        part_max if part_max is not None else out, part_idx if part_idx is not None else out,
        m, n, k,
        x.stride(0), residual.stride(0) if residual is not None else 0,
        residual_sum.stride(0) if residual_sum is not None else 0, weight.stride(0), out.stride(0),
        float(eps),
        PROLOGUE=_PROLOGUE_CODE[prologue], HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        ARGMAX=argmax, UPCAST=dot_needs_upcast(weight.dtype) or weight.dtype == torch.float32, ONE_ROW=m == 1,
        BLOCK_M=_BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
        **pdl_launch(x.device),
    )
    if argmax:
        argmax_from_partials(part_max, part_idx, tokens)  # type: ignore[arg-type]
    return out, residual_sum, tokens


def argmax_from_partials(part_max: torch.Tensor, part_idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Per row, the index of the largest partial max (lowest index on ties): [M, P] -> out [M] int64."""
    require_triton("argmax_from_partials")
    m, p = part_max.shape
    _argmax_reduce_kernel[(m,)](part_max, part_idx, out, p, BLOCK=1024, num_warps=4, **pdl_launch(out.device))
    return out


def small_gemm_ref(x: torch.Tensor, weight: torch.Tensor, *, prologue: str = "none",
                   bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                   norm_weight: torch.Tensor | None = None, eps: float = 1e-6
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch reference with the unfused kernels' roundings: (y in x's dtype, residual sum or None)."""
    k = _check(x, weight, prologue, residual, norm_weight, bias)
    residual_sum = None
    if prologue == "silu":
        a = (torch.nn.functional.silu(x[:, :k].float()) * x[:, k:].float()).to(weight.dtype)
    elif prologue == "norm":
        s = x.float() if residual is None else x.float() + residual.float()
        if residual is not None:
            residual_sum = s.to(x.dtype)
        rstd = torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps)
        a = (s * rstd * norm_weight.float()).to(weight.dtype)  # type: ignore[union-attr]
    else:
        a = x.to(weight.dtype)
    y = a.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype), residual_sum
