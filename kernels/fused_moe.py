"""Fused mixture-of-experts MLP (issue 30): one grouped GEMM for every expert's gate|up with SwiGLU, one for down
with the routing weight applied, the way vLLM and SGLang run MoE layers.

Routing (top-k over the router logits) happens before, in torch: it is [T, E] and cheap. Then:

1. `moe_align`: the T*k (token, expert) slots are sorted by expert and each expert's run is padded to a multiple
   of BLOCK_M, so every BLOCK_M tile of sorted slots belongs to one expert. Sizes are the worst case
   (T*k + E*(BLOCK_M-1) slots), never read back to the host: no sync, so a decode step can be graph-captured.
   Padding slots hold the sentinel T*k and are masked out; tiles past the used length return at once.
2. `_moe_gemm` over w13 [E, 2I, H]: tile m of sorted slots times expert e's weight; slot s reads token s // k.
   SwiGLU on the [T*k, 2I] result (kernels/silu_and_mul.py).
3. `_moe_gemm` over w2 [E, H, I] with TOP_K = 1 (one activation row per slot), each row scaled by its routing
   weight; the k rows of a token are summed in torch ([T, k, H] -> [T, H]).

Invariants: accumulation is fp32; outputs are rounded to x's dtype once per GEMM (as the unfused path rounds
each linear). Weights are contiguous per expert: w13 rows are gate_proj's I rows then up_proj's. The torch
reference is `fused_moe_ref` (a loop over the experts that received tokens).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kernels._triton import HAS_TRITON, dot_needs_upcast, next_pow2, require_triton, tl, triton
from kernels.silu_and_mul import silu_and_mul

__all__ = ["MoeTiles", "moe_tiles", "moe_align", "moe_align_ref", "moe_align_triton", "fused_moe",
           "fused_moe_ref"]


@dataclass(frozen=True)
class MoeTiles:
    """One GEMM's tile shape and launch settings."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


def moe_tiles(num_slots: int, num_experts: int) -> MoeTiles:
    """A heuristic until per-GPU sweeps are recorded: decode-sized batches spread few slots over many experts, so
    a 16-row tile wastes least padding; large prefill batches fill 64-row tiles."""
    per_expert = num_slots / max(num_experts, 1)
    if per_expert <= 16:
        return MoeTiles(16, 64, 128, group_m=1, num_warps=4, num_stages=4)
    if per_expert <= 64:
        return MoeTiles(32, 64, 64, num_warps=4, num_stages=4)
    return MoeTiles(64, 128, 64, num_warps=8, num_stages=3)


MOE_ALIGN_TRITON_MAX_SLOTS = 4096
"""Above this many T*k slots `moe_align` takes the torch path: the Triton kernel is one program walking the slots in
sequential chunks (twice), so its time grows with T*k on one SM while the torch path's ~20 launches cost the same at
any size. 4096 = the largest batch a CUDA graph captures (engine/runner/cuda_graphs.py MAX_CAPTURE_SIZE, 512) x
top-8, so every captured decode step of Qwen3-MoE-like models takes one launch; prefill chunks (thousands of
tokens) go to torch, whose many small kernels are then a small share of the step. Not yet tuned on a GPU."""

MOE_ALIGN_TRITON_MAX_EXPERTS = 1024  # the kernel's [chunk, E_POW2] one-hot tiles: past this, registers spill


def moe_align(topk_ids: torch.Tensor, block_m: int, num_experts: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted slots [P], the expert of each BLOCK_M tile [P / block_m] (-1: unused), the used
    length [1]), all int32. P = roundup(T*k + E*(block_m-1), block_m), a host-known bound.

    Invariants (both implementations, bit for bit): slots are grouped by expert in ascending expert order, each
    expert's slots in ascending slot order (stable), each expert's run padded to a multiple of block_m with the
    sentinel T*k, which also fills everything past the used length; an id outside [0, num_experts) (an expert
    another expert-parallel rank holds) drops its slot: no tile holds it, so no row is computed. No host sync and
    no data-dependent shape, so a decode step can be graph-captured.

    Dispatch: one Triton launch (`moe_align_triton`) for decode-sized inputs on CUDA (or on CPU under
    TRITON_INTERPRET=1, as the other kernels' tests run), else the torch reference `moe_align_ref`."""
    num_slots = topk_ids.numel()
    if (_triton_runs_on(topk_ids.device) and 0 < num_slots <= MOE_ALIGN_TRITON_MAX_SLOTS
            and num_experts <= MOE_ALIGN_TRITON_MAX_EXPERTS):
        return moe_align_triton(topk_ids, block_m, num_experts)
    return moe_align_ref(topk_ids, block_m, num_experts)


def _triton_runs_on(device: torch.device) -> bool:
    return HAS_TRITON and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1")


def _align_capacity(num_slots: int, block_m: int, num_experts: int) -> int:
    return -(-(num_slots + num_experts * (block_m - 1)) // block_m) * block_m


def moe_align_ref(topk_ids: torch.Tensor, block_m: int, num_experts: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_align` in plain torch (~20 small ops): the reference, and the path for large inputs and no Triton."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_slots = flat.numel()
    flat = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # bucket num_experts: dropped
    capacity = _align_capacity(num_slots, block_m, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts:].zero_()  # a device fill: a scalar store would copy from the host, which graph capture refuses
    padded_start = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    experts_in_order = flat[order]
    rank = torch.arange(num_slots, device=device) - start[experts_in_order]
    dest = torch.where(experts_in_order < num_experts, padded_start[experts_in_order] + rank, capacity)
    sorted_ids = torch.full((capacity + 1,), num_slots, dtype=torch.int32, device=device)  # + 1: the drop slot
    sorted_ids[dest] = order.to(torch.int32)
    sorted_ids = sorted_ids[:capacity]
    tile_end = torch.cumsum(padded[:num_experts] // block_m, 0)  # searchsorted, not repeat_interleave: no sync
    expert_ids = torch.searchsorted(tile_end, torch.arange(capacity // block_m, device=device), right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids, padded.sum().reshape(1).to(torch.int32)


def _align_chunk(experts_pow2: int) -> int:
    """Slots (and tiles) per loop step: the one-hot tile [chunk, E_POW2] stays near 8K elements (registers)."""
    return max(16, min(256, 8192 // experts_pow2))


def moe_align_triton(topk_ids: torch.Tensor, block_m: int, num_experts: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_align` in one Triton launch of one program (decode-sized inputs; see MOE_ALIGN_TRITON_MAX_SLOTS)."""
    require_triton("moe_align")
    device = topk_ids.device
    flat = topk_ids.reshape(-1)  # contiguous: a view, or a copy when topk_ids is strided
    num_slots = flat.numel()
    capacity = _align_capacity(num_slots, block_m, num_experts)
    sorted_ids = torch.empty(capacity, dtype=torch.int32, device=device)
    expert_ids = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    used = torch.empty(1, dtype=torch.int32, device=device)
    experts_pow2 = next_pow2(max(num_experts, 2))
    chunk = _align_chunk(experts_pow2)
    _moe_align_kernel[(1,)](
        flat, sorted_ids, expert_ids, used, num_slots, num_experts, capacity,
        BLOCK_M=block_m, E_POW2=experts_pow2, CHUNK=chunk, FILL=1024, num_warps=8 if experts_pow2 >= 128 else 4)
    return sorted_ids, expert_ids, used


if HAS_TRITON:

    @triton.jit
    def _onehot(Ids, offs, num_slots, num_experts, E_POW2: tl.constexpr):
        """Slots offs -> ([chunk, E_POW2] int32 one-hot of their expert, in range): a dropped id (outside
        [0, num_experts)) or a slot past the end matches no column."""
        in_range = offs < num_slots
        ids = tl.load(Ids + offs, mask=in_range, other=-1).to(tl.int32)
        keep = in_range & (ids >= 0) & (ids < num_experts)
        ids = tl.where(keep, ids, -1)
        return (ids[:, None] == tl.arange(0, E_POW2)[None, :]).to(tl.int32), keep

    @triton.jit
    def _moe_align_kernel(Ids, SortedIds, ExpertIds, Used, num_slots, num_experts, capacity,
                          BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr):
        """One program: count per expert, pad, exclusive-scan the padded counts, fill sorted_ids with the
        sentinel, then scatter each slot to its expert's start + its stable rank (a running per-expert cursor
        across chunks plus an exclusive scan of the one-hot inside a chunk), and tag each tile with its expert."""
        counts = tl.zeros((E_POW2,), dtype=tl.int32)
        for s0 in range(0, num_slots, CHUNK):
            onehot, _ = _onehot(Ids, s0 + tl.arange(0, CHUNK), num_slots, num_experts, E_POW2)
            counts += tl.sum(onehot, axis=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # columns past num_experts count 0, pad to 0
        padded_end = tl.cumsum(padded, axis=0)
        total = tl.sum(padded, axis=0)
        tl.store(Used, total)
        for p0 in range(0, capacity, FILL):
            offs = p0 + tl.arange(0, FILL)
            tl.store(SortedIds + offs, tl.full((FILL,), 0, tl.int32) + num_slots, mask=offs < capacity)
        # The scatter below overwrites some sentinels: other threads of this program must see the fill first.
        tl.debug_barrier()
        cursor = padded_end - padded  # where each expert's next slot goes
        for s0 in range(0, num_slots, CHUNK):
            offs = s0 + tl.arange(0, CHUNK)
            onehot, keep = _onehot(Ids, offs, num_slots, num_experts, E_POW2)
            before = tl.cumsum(onehot, axis=0) - onehot  # same-expert slots earlier in this chunk
            dest = tl.sum(onehot * (cursor[None, :] + before), axis=1)
            tl.store(SortedIds + dest, offs, mask=keep)
            cursor += tl.sum(onehot, axis=0)
        # Tile t belongs to the number of experts whose padded run ends at or before it; past `total` that is
        # E_POW2 >= num_experts (padded_end of the empty columns is `total`): -1.
        for t0 in range(0, capacity // BLOCK_M, CHUNK):
            tiles = t0 + tl.arange(0, CHUNK)
            expert = tl.sum((padded_end[None, :] <= tiles[:, None] * BLOCK_M).to(tl.int32), axis=1)
            expert = tl.where(expert < num_experts, expert, -1)
            tl.store(ExpertIds + tiles, expert, mask=tiles < capacity // BLOCK_M)

    @triton.jit
    def _moe_gemm(A, B, C, Weights, SortedIds, ExpertIds, NumUsed, N, K, num_slots, capacity,
                  stride_am, stride_be, stride_bn, stride_cm,
                  TOP_K: tl.constexpr, MUL_WEIGHT: tl.constexpr, UPCAST: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """C[slot] = A[slot // TOP_K] @ B[expert]^T (x the slot's routing weight), for the BLOCK_M sorted slots of
        this program's tile and BLOCK_N output columns. Rows of A and B are contiguous along K."""
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(capacity, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        group = GROUP_M * num_pid_n
        first_m = (pid // group) * GROUP_M
        rows = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % group) % rows
        pid_n = (pid % group) // rows
        if pid_m * BLOCK_M >= tl.load(NumUsed):
            return
        expert = tl.load(ExpertIds + pid_m).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        slots = tl.load(SortedIds + offs_m).to(tl.int64)
        valid = slots < num_slots
        a_rows = slots // TOP_K
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            a = tl.load(A + a_rows[:, None] * stride_am + offs_k[None, :], mask=valid[:, None] & mask_k[None, :],
                        other=0.0)
            b = tl.load(B + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None],
                        mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc += tl.dot(a, b)
        if MUL_WEIGHT:
            weight = tl.load(Weights + slots, mask=valid, other=0.0).to(tl.float32)
            acc = acc * weight[:, None]
        tl.store(C + slots[:, None] * stride_cm + offs_n[None, :], acc.to(C.dtype.element_ty),
                 mask=valid[:, None] & mask_n[None, :])


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, weights: torch.Tensor | None,
                  aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor], top_k: int, tiles: MoeTiles) -> None:
    sorted_ids, expert_ids, used = aligned
    num_experts, n, k = w.shape
    capacity = sorted_ids.numel()
    grid = (triton.cdiv(capacity, tiles.block_m) * triton.cdiv(n, tiles.block_n),)
    _moe_gemm[grid](
        a, w, out, weights if weights is not None else out, sorted_ids, expert_ids, used, n, k, out.shape[0], capacity,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        TOP_K=top_k, MUL_WEIGHT=weights is not None, UPCAST=dot_needs_upcast(a.dtype),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor) -> None:
    tokens, hidden = x.shape
    experts, two_inter, w13_hidden = w13.shape
    if w13_hidden != hidden or two_inter % 2 or w2.shape != (experts, hidden, two_inter // 2):
        raise ValueError(f"w13 must be [E, 2I, {hidden}] and w2 [E, {hidden}, I], got {tuple(w13.shape)} and "
                         f"{tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != tokens:
        raise ValueError(f"topk_ids and topk_weights must both be [{tokens}, k], got {tuple(topk_ids.shape)} and "
                         f"{tuple(topk_weights.shape)}")
    if not (x.is_contiguous() and w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("x, w13 and w2 must be contiguous")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, tiles: MoeTiles | None = None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights / topk_ids [T, k] -> [T, H] in x's dtype. Ids
    outside [0, E) contribute nothing (expert parallelism: this rank's partial sum)."""
    require_triton("fused_moe")
    _check(x, w13, w2, topk_weights, topk_ids)
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_slots = tokens * top_k
    if num_slots == 0:
        return torch.zeros_like(x)
    tiles = tiles or moe_tiles(num_slots, w13.shape[0])
    aligned = moe_align(topk_ids, tiles.block_m, w13.shape[0])
    gate_up = torch.empty((num_slots, w13.shape[1]), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, None, aligned, top_k, tiles)
    act = silu_and_mul(gate_up)
    out = torch.zeros((num_slots, hidden), dtype=x.dtype, device=x.device)  # dropped slots' rows stay zero
    _grouped_gemm(act, w2, out, topk_weights.reshape(-1).contiguous(), aligned, 1, tiles)
    return out.view(tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """Plain torch, fp32 math: a loop over the experts that received tokens (ids outside [0, E) skipped)."""
    _check(x, w13, w2, topk_weights, topk_ids)
    inter = w13.shape[1] // 2
    xf = x.float()
    out = torch.zeros_like(xf)
    for expert in topk_ids.unique().tolist():
        if not 0 <= expert < w13.shape[0]:
            continue
        token, which = (topk_ids == expert).nonzero(as_tuple=True)
        gate_up = xf[token] @ w13[expert].float().T
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, token, (act @ w2[expert].float().T) * topk_weights[token, which, None].float())
    return out.to(x.dtype)
