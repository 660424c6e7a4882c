"""Summing a K split's fp32 partials, for the kernels that split K across programs (kernels/quant_gemm_kn.py's
GEMV and GEMM, kernels/quant_mma_kn.py): in a second launch (`sum_splits`), or inside the split kernel itself by
the last program of a tile to arrive (`sum_here`, with the caller's arrival counters)."""

from __future__ import annotations

import torch

from kernels._triton import HAS_TRITON, pdl_launch, pdl_wait, tl, triton

__all__ = ["SUM_BATCH", "sum_splits", "sum_here"]

# Split partials that the last program of a tile loads at once: their loads are independent, so a tail of S splits
# costs S / SUM_BATCH L2 round trips instead of S (a one-row o_proj on an H100 splits K 32 ways)
SUM_BATCH = tl.constexpr(8) if HAS_TRITON else 8

if HAS_TRITON:

    @triton.jit
    def sum_here(P, Y, Arrivals, tile, NUM_SPLITS, split_stride, offs, mask, like):
        """Called by every program of a split after it stored its partial at P + split * split_stride + offs: the
        last to arrive at `tile` (an acq_rel counter in Arrivals, zero between calls) sums the partials in split
        order, writes Y + offs and zeroes the counter, so the next call (a CUDA graph replay) starts clean.
        `like`: a tensor of the partial's shape and layout."""
        tl.debug_barrier()  # every thread's partial is stored before the arrival is counted
        arrived = tl.atomic_add(Arrivals + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == NUM_SPLITS - 1:
            total = tl.zeros_like(like)
            # L2 reads (.cg): other SMs wrote them, L1 may hold stale lines; SUM_BATCH splits in flight together,
            # added in split order
            for first in range(0, NUM_SPLITS, SUM_BATCH):
                for j in tl.static_range(SUM_BATCH):
                    live = (tl.zeros_like(offs) + first + j) < NUM_SPLITS  # (a tensor: the interpreter's masks)
                    part = tl.load(P + (first + j) * split_stride + offs, mask=mask & live, other=0.0,
                                   cache_modifier=".cg")
                    total = tl.where(live, total + part, total)
            tl.store(Y + offs, total.to(Y.dtype.element_ty), mask=mask)
            tl.atomic_xchg(Arrivals + tile, 0)

    @triton.jit
    def _sum_splits_kernel(P, Y, NUMEL, SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """y = the sum over splits of the fp32 partials [SPLIT, NUMEL], in y's dtype (one launch)."""
        pdl_wait(PDL)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < NUMEL
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            total += tl.load(P + s * NUMEL + offs, mask=mask, other=0.0)
        tl.store(Y + offs, total.to(Y.dtype.element_ty), mask=mask)

else:  # pragma: no cover - depends on the environment
    sum_here = None  # the kernel modules import it unconditionally and use it only with Triton


def sum_splits(partial: torch.Tensor, y: torch.Tensor) -> None:
    """y = partial [split, *y.shape] (fp32) summed over its first axis in split order, in y's dtype: one launch,
    under PDL where the split kernel ran under it (its wait orders the partials' reads)."""
    split, numel = partial.shape[0], y.numel()
    _sum_splits_kernel[(triton.cdiv(numel, 1024),)](partial, y, numel, SPLIT=split, BLOCK=1024,
                                                    **pdl_launch(y.device))
