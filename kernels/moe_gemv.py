"""The MoE experts for a few tokens (decode): two GEMV kernels over each token's own experts, no sorting.

kernels/fused_moe.py sorts the T*k (token, expert) slots by expert and pads each expert's run to a tensor-core
tile, which pays once experts get many tokens. At decode sizes (top-8 of 128 experts at one token) every expert
holds one slot: the sort is a launch of its own (~6 us on an H200), each 16-row tile carries one real row, and the
zeroed output, the SwiGLU kernel and the top-k sum are three more launches. Here:

1. `_gate_up_kernel`, grid (slot, column block): the slot's token row times its expert's gate and up rows, on CUDA
   cores, SwiGLU in the epilogue -> act [T*k, I];
2. `_down_kernel`, grid (token, column block): for each of the token's k slots, its act row times its expert's
   down rows, scaled by the routing weight, summed over the k slots in fp32 -> out [T, H].

Two launches instead of six, and each weight row is read once per slot that needs it (a token's k experts are
distinct; two tokens sharing an expert read it twice, which is why this path is for T*k well below E).

Invariants (the grouped path's arithmetic, fused_moe.py): fp32 accumulation; gate and up rounded to x's dtype
before SwiGLU, as the grouped GEMM stores them; each slot's down row times its weight rounded to x's dtype before
the fp32 sum over k. An id outside [expert_offset, expert_offset + E_local) is another expert-parallel rank's:
its loads are masked off, it adds zero. No host read and no data-dependent shape (graph capture).
"""

from __future__ import annotations

import torch

from kernels._triton import HAS_TRITON, next_pow2, pdl_launch, pdl_wait, require_triton, tl, triton

__all__ = ["GEMV_MAX_SLOTS", "gemv_suits", "moe_gemv", "moe_gemv_tiles"]

GEMV_MAX_SLOTS = 64
"""The most (token, expert) slots the GEMV path takes: 8 tokens at top-8. Past it the grouped GEMMs' tensor cores
and shared expert reads win (untuned: measured at one token only, bench/results/moe_x1_*.json)."""


def gemv_suits(num_slots: int, num_experts: int) -> bool:
    """Whether `num_slots` routed slots take the GEMV path: few of them, and at most half as many as the model has
    experts, so that tokens rarely share an expert (each sharer reads its weights again)."""
    return 0 < num_slots <= min(GEMV_MAX_SLOTS, num_experts // 2)


if HAS_TRITON:

    @triton.jit
    def _gate_up_kernel(X, W13, Ids, Act, hidden, inter, num_local, expert_offset, stride_we,
                        TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        slot = tl.program_id(0).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        pdl_wait(PDL)
        expert = tl.load(Ids + slot).to(tl.int64) - expert_offset
        mine = (expert >= 0) & (expert < num_local)
        expert = tl.where(mine, expert, 0)
        mask_n = offs_n < tl.where(mine, inter, 0)  # a bound, not `& mine`: Triton's interpreter refuses that mask
        gate_rows = W13 + expert * stride_we + offs_n.to(tl.int64)[:, None] * hidden
        up_rows = gate_rows + inter * hidden
        x_row = X + (slot // TOP_K) * hidden
        acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < hidden
            a = tl.load(x_row + offs_k, mask=mask_k, other=0.0).to(tl.float32)[None, :]
            mask = mask_n[:, None] & mask_k[None, :]
            acc_gate += tl.load(gate_rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32) * a
            acc_up += tl.load(up_rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32) * a
        gate = tl.sum(acc_gate, axis=1).to(Act.dtype.element_ty).to(tl.float32)
        up = tl.sum(acc_up, axis=1).to(Act.dtype.element_ty).to(tl.float32)
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(Act + slot * inter + offs_n, act.to(Act.dtype.element_ty), mask=mask_n)

    @triton.jit
    def _down_kernel(Act, W2, Ids, Weights, Out, hidden, inter, num_local, expert_offset, stride_we,
                     TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        pdl_wait(PDL)
        total = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for j in range(TOP_K):
            slot = token * TOP_K + j
            expert = tl.load(Ids + slot).to(tl.int64) - expert_offset
            mine = (expert >= 0) & (expert < num_local)
            expert = tl.where(mine, expert, 0)
            mask_n = offs_n < tl.where(mine, hidden, 0)
            inter_mine = tl.where(mine, inter, 0)
            rows = W2 + expert * stride_we + offs_n.to(tl.int64)[:, None] * inter
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for k0 in range(0, inter, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < inter_mine
                a = tl.load(Act + slot * inter + offs_k, mask=mask_k, other=0.0).to(tl.float32)
                w = tl.load(rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
                acc += w.to(tl.float32) * a[None, :]
            weight = tl.where(mine, tl.load(Weights + slot).to(tl.float32), 0.0)
            total += (tl.sum(acc, axis=1) * weight).to(Out.dtype.element_ty).to(tl.float32)
        tl.store(Out + token * hidden + offs_n, total.to(Out.dtype.element_ty), mask=offs_n < hidden)


def moe_gemv_tiles(k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for rows of length k: 4 weight rows x up to 1024 per load round, as the dense
    GEMV (kernels/small_gemm.py `GemvConfig`) streams them. Untuned for the MoE shapes."""
    return 4, min(1024, next_pow2(max(k, 16))), 4


def moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, expert_offset: int = 0) -> torch.Tensor:
    """x [T, H], w13 [E_local, 2I, H], w2 [E_local, H, I], topk_weights / topk_ids [T, k] (global ids; this rank
    holds experts [expert_offset, expert_offset + E_local)) -> [T, H] in x's dtype: this rank's partial sum.
    Shapes are checked by the caller (fused_moe.py `fused_moe`)."""
    require_triton("moe_gemv")
    tokens, hidden = x.shape
    num_local, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1)
    weights = topk_weights.reshape(-1)
    act = torch.empty((tokens * top_k, inter), dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    pdl = pdl_launch(x.device)
    block_n, block_k, warps = moe_gemv_tiles(hidden)
    _gate_up_kernel[(tokens * top_k, triton.cdiv(inter, block_n))](
        x, w13, ids, act, hidden, inter, num_local, expert_offset, w13.stride(0),
        TOP_K=top_k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, **pdl)
    block_n, block_k, warps = moe_gemv_tiles(inter)
    _down_kernel[(tokens, triton.cdiv(hidden, block_n))](
        act, w2, ids, weights, out, hidden, inter, num_local, expert_offset, w2.stride(0),
        TOP_K=top_k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, **pdl)
    return out
