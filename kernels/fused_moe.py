"""Fused mixture-of-experts MLP (issue 30): one grouped GEMM for every expert's gate|up with SwiGLU, one for down
with the routing weight applied, the way vLLM and SGLang run MoE layers.

Routing (top-k over the router logits) happens before (engine/models/moe.py `route`: kernels/moe_route.py or
torch). Then:

1. `moe_align`: the T*k (token, expert) slots are sorted by expert and each expert's run is padded to a multiple
   of BLOCK_M, so every BLOCK_M tile of sorted slots belongs to one expert. Sizes are the worst case (T*k +
   E*(BLOCK_M-1) slots, or T*k tiles if fewer), never read back to the host: no sync, so a decode step can be
   graph-captured.
   Padding slots hold the sentinel T*k and are masked out; tiles past the used length return at once.
2. `_moe_gemm` over w13 [E, 2I, H]: tile m of sorted slots times expert e's weight; slot s reads token s // k.
   SwiGLU on the [T*k, 2I] result (kernels/silu_and_mul.py).
3. `_moe_gemm` over w2 [E, H, I] with TOP_K = 1 (one activation row per slot), each row scaled by its routing
   weight; `_combine_kernel` sums each token's k rows in fp32 ([T, k, H] -> [T, H]), skipping dropped slots,
   whose rows no GEMM wrote. Decode-sized batches take kernels/moe_gemv.py instead (the engine picks).

Batch-size arguments (slot counts, capacities, spans) are not specialized by Triton: one compile per tile class
serves every batch (engine/runner/warmup.py `moe_rows` warms each class).

Invariants: accumulation is fp32; outputs are rounded to x's dtype once per GEMM (as the unfused path rounds
each linear). Weights are contiguous per expert: w13 rows are gate_proj's I rows then up_proj's. The torch
reference is `fused_moe_ref` (a loop over the experts that received tokens).
"""

from __future__ import annotations

import os

import torch

from kernels._triton import HAS_TRITON, dot_needs_upcast, next_pow2, require_triton, tl, triton
from kernels.moe_tiles import MoeTiles, moe_tiles, select_tiles
from kernels.silu_and_mul import silu_and_mul

__all__ = ["MoeTiles", "moe_tiles", "moe_align", "moe_align_ref", "moe_align_triton", "fused_moe",
           "fused_moe_ref"]


MOE_ALIGN_TRITON_MAX_SLOTS = 4096
"""Above this many T*k slots `moe_align` takes the torch path (~20 launches, a small share of a prefill chunk's
step). Up to it the Triton alignment's three launches serve every batch a CUDA graph captures (MAX_CAPTURE_SIZE
512 x top-8). It was one program walking the slots serially: ~50 us per layer at decode batches of 1-2k slots on
an H200 (a tenth of the GPU's busy time in a Qwen3-30B-A3B throughput profile, 2026-11-28)."""

MOE_ALIGN_TRITON_MAX_EXPERTS = 1024  # the kernel's [chunk, E_POW2] one-hot tiles: past this, registers spill


def moe_align(topk_ids: torch.Tensor, block_m: int, num_experts: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted slots [P], the expert of each BLOCK_M tile [P / block_m] (-1: unused), the used
    length [1]), all int32. P = min(roundup(T*k + E*(block_m-1), block_m), T*k*block_m), a host-known bound.

    Invariants (both implementations, bit for bit): slots are grouped by expert in ascending expert order, each
    expert's slots in ascending slot order (stable), each expert's run padded to a multiple of block_m with the
    sentinel T*k, which also fills everything past the used length; an id outside [0, num_experts) (an expert
    another expert-parallel rank holds) drops its slot: no tile holds it, so no row is computed. No host sync and
    no data-dependent shape, so a decode step can be graph-captured.

    Dispatch: the Triton alignment (`moe_align_triton`, three launches) for decode-sized inputs on CUDA (or on CPU
    under TRITON_INTERPRET=1, as the other kernels' tests run), else the torch reference `moe_align_ref`."""
    num_slots = topk_ids.numel()
    if (_triton_runs_on(topk_ids.device) and 0 < num_slots <= MOE_ALIGN_TRITON_MAX_SLOTS
            and num_experts <= MOE_ALIGN_TRITON_MAX_EXPERTS):
        return moe_align_triton(topk_ids, block_m, num_experts)
    return moe_align_ref(topk_ids, block_m, num_experts)


def _triton_runs_on(device: torch.device) -> bool:
    return HAS_TRITON and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1")


def _align_capacity(num_slots: int, block_m: int, num_experts: int) -> int:
    """Sorted slots to allocate: every expert's run is padded by at most block_m - 1, and each non-empty run holds
    at least one slot, so also at most num_slots tiles (the bound that matters at decode: top-8 of 128 experts at
    one token needs 8 tiles, not 121, and the GEMMs' grids shrink with it)."""
    return min(-(-(num_slots + num_experts * (block_m - 1)) // block_m) * block_m, num_slots * block_m)


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


ALIGN_SPAN = 256  # slots per program of the counting and scattering launches


def moe_align_triton(topk_ids: torch.Tensor, block_m: int, num_experts: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_align` in three Triton launches (decode-sized inputs; see MOE_ALIGN_TRITON_MAX_SLOTS): per span of
    ALIGN_SPAN slots, count each expert's slots (and fill the sentinel); one program turns the counts into every
    span's start inside each expert's padded run and tags the tiles; per span, scatter the slots in order."""
    require_triton("moe_align")
    device = topk_ids.device
    flat = topk_ids.reshape(-1)  # contiguous: a view, or a copy when topk_ids is strided
    num_slots = flat.numel()
    capacity = _align_capacity(num_slots, block_m, num_experts)
    sorted_ids = torch.empty(capacity, dtype=torch.int32, device=device)
    expert_ids = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    used = torch.empty(1, dtype=torch.int32, device=device)
    experts_pow2 = next_pow2(max(num_experts, 2))
    spans = triton.cdiv(num_slots, ALIGN_SPAN)
    span_counts = torch.empty((spans, experts_pow2), dtype=torch.int32, device=device)  # then each span's starts
    chunk = min(_align_chunk(experts_pow2), ALIGN_SPAN)
    warps = 8 if experts_pow2 >= 128 else 4
    fill_span = triton.cdiv(capacity, spans)
    _align_count_kernel[(spans,)](
        flat, span_counts, sorted_ids, num_slots, num_experts, capacity, fill_span,
        SPAN=ALIGN_SPAN, E_POW2=experts_pow2, CHUNK=chunk, FILL=512, num_warps=warps)
    _align_plan_kernel[(1,)](
        span_counts, expert_ids, used, spans, num_experts, capacity, BLOCK_M=block_m, E_POW2=experts_pow2,
        S_POW2=next_pow2(spans), CHUNK=_align_chunk(experts_pow2), num_warps=warps)
    _align_scatter_kernel[(spans,)](
        flat, span_counts, sorted_ids, num_slots, num_experts,
        SPAN=ALIGN_SPAN, E_POW2=experts_pow2, CHUNK=chunk, num_warps=warps)
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

    @triton.jit(do_not_specialize=["num_slots", "capacity", "fill_span"])
    def _align_count_kernel(Ids, SpanCounts, SortedIds, num_slots, num_experts, capacity, fill_span,
                            SPAN: tl.constexpr, E_POW2: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr):
        """Program s: its span's slots per expert -> SpanCounts[s]; and its share of SortedIds set to the sentinel
        (the scatter, two launches later, overwrites the used slots)."""
        span = tl.program_id(0)
        counts = tl.zeros((E_POW2,), dtype=tl.int32)
        for s0 in range(span * SPAN, span * SPAN + SPAN, CHUNK):
            onehot, _ = _onehot(Ids, s0 + tl.arange(0, CHUNK), num_slots, num_experts, E_POW2)
            counts += tl.sum(onehot, axis=0)
        tl.store(SpanCounts + span * E_POW2 + tl.arange(0, E_POW2), counts)
        fill_end = tl.minimum(span * fill_span + fill_span, capacity)
        for p0 in range(span * fill_span, span * fill_span + fill_span, FILL):
            offs = p0 + tl.arange(0, FILL)
            tl.store(SortedIds + offs, tl.full((FILL,), 0, tl.int32) + num_slots, mask=offs < fill_end)

    @triton.jit(do_not_specialize=["num_spans", "capacity"])
    def _align_plan_kernel(SpanCounts, ExpertIds, Used, num_spans, num_experts, capacity,
                           BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, S_POW2: tl.constexpr, CHUNK: tl.constexpr):
        """One program: each expert's total, padded to BLOCK_M and laid out in ascending expert order; SpanCounts
        [s, e] becomes where span s's first slot of expert e goes (the expert's padded start plus the earlier
        spans' slots of it); each tile tagged with its expert (-1 past the used length)."""
        rows = tl.arange(0, S_POW2)
        cols = tl.arange(0, E_POW2)
        mask = (rows < num_spans)[:, None]
        where = SpanCounts + rows[:, None] * E_POW2 + cols[None, :]
        counts = tl.load(where, mask=mask, other=0)
        totals = tl.sum(counts, axis=0)
        padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # columns past num_experts count 0, pad to 0
        padded_end = tl.cumsum(padded, axis=0)
        total = tl.sum(padded, axis=0)
        tl.store(Used, total)
        earlier = tl.cumsum(counts, axis=0) - counts  # this expert's slots in the spans before
        tl.store(where, (padded_end - padded)[None, :] + earlier, mask=mask)
        # Tile t belongs to the number of experts whose padded run ends at or before it; past `total` that is
        # E_POW2 >= num_experts (padded_end of the empty columns is `total`): -1.
        num_tiles = capacity // BLOCK_M
        for t0 in range(0, num_tiles, CHUNK):
            tiles = t0 + tl.arange(0, CHUNK)
            expert = tl.sum((padded_end[None, :] <= tiles[:, None] * BLOCK_M).to(tl.int32), axis=1)
            expert = tl.where(expert < num_experts, expert, -1)
            tl.store(ExpertIds + tiles, expert, mask=tiles < num_tiles)

    @triton.jit(do_not_specialize=["num_slots"])
    def _align_scatter_kernel(Ids, SpanStarts, SortedIds, num_slots, num_experts,
                              SPAN: tl.constexpr, E_POW2: tl.constexpr, CHUNK: tl.constexpr):
        """Program s: each of its span's slots to its expert's next place, in slot order (a running per-expert
        cursor across chunks plus an exclusive scan of the one-hot inside a chunk): the stable order."""
        span = tl.program_id(0)
        cursor = tl.load(SpanStarts + span * E_POW2 + tl.arange(0, E_POW2))
        for s0 in range(span * SPAN, span * SPAN + SPAN, CHUNK):
            offs = s0 + tl.arange(0, CHUNK)
            onehot, keep = _onehot(Ids, offs, num_slots, num_experts, E_POW2)
            before = tl.cumsum(onehot, axis=0) - onehot  # same-expert slots earlier in this chunk
            dest = tl.sum(onehot * (cursor[None, :] + before), axis=1)
            tl.store(SortedIds + dest, offs, mask=keep)
            cursor += tl.sum(onehot, axis=0)

    @triton.jit(do_not_specialize=["num_slots", "capacity"])
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

    @triton.jit
    def _combine_kernel(Rows, Ids, Out, hidden, num_experts, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
        """Out[t] = the fp32 sum of rows t*k .. t*k + k - 1 whose id is in [0, num_experts), in x's dtype."""
        token = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in range(TOP_K):
            slot = token * TOP_K + j
            expert = tl.load(Ids + slot)
            mine = (expert >= 0) & (expert < num_experts)
            total += tl.load(Rows + slot * hidden + offs, mask=offs < tl.where(mine, hidden, 0),
                             other=0.0).to(tl.float32)
        tl.store(Out + token * hidden + offs, total.to(Out.dtype.element_ty), mask=offs < hidden)


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
    outside [0, E) contribute nothing (expert parallelism: this rank's partial sum). `tiles`: both GEMMs'
    (default: this GPU's recorded table for the shape, else the heuristic; kernels/moe_tiles.py)."""
    require_triton("fused_moe")
    _check(x, w13, w2, topk_weights, topk_ids)
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_slots = tokens * top_k
    if num_slots == 0:
        return torch.zeros_like(x)
    tiles = tiles or select_tiles(tokens, top_k, w13.shape[0], w2.shape[2], x.device)
    aligned = moe_align(topk_ids, tiles.block_m, w13.shape[0])
    gate_up = torch.empty((num_slots, w13.shape[1]), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, None, aligned, top_k, tiles)
    act = silu_and_mul(gate_up)
    rows = torch.empty((num_slots, hidden), dtype=x.dtype, device=x.device)  # dropped slots' rows: never read
    _grouped_gemm(act, w2, rows, topk_weights.reshape(-1).contiguous(), aligned, 1, tiles)
    out = torch.empty_like(x)
    block = min(1024, next_pow2(hidden))
    _combine_kernel[(tokens, triton.cdiv(hidden, block))](
        rows, topk_ids.reshape(-1), out, hidden, w13.shape[0], TOP_K=top_k, BLOCK=block,
        num_warps=4 if block >= 512 else 1)
    return out


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
