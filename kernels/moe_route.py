"""MoE router top-k in one kernel: router logits [T, E] -> (weights [T, k], expert ids [T, k]).

The torch routing (engine/models/moe.py `route`) is five to seven kernels per layer: softmax, top-k (a gather and
a bitonic sort), the renormalizing sum and divide, the cast. At batch-1 decode on Qwen3-30B-A3B shapes they took
~14 us of each layer's ~118 (an H200 profile, 2026-11-28), more than the expert GEMMs' weight streaming. One
program per token row does the same arithmetic in registers.

Invariants (as `route`, transformers' arithmetic): an fp32 softmax over all E logits; the k largest
probabilities in descending order, the lowest expert id first among equal ones; divided by their fp32 sum when
`renormalize`; cast to `dtype`. Ids are int64, as torch.topk gives them. The exponential is Triton's (not
bit-equal to torch's), so the engine takes this kernel for half-precision activations only; fp32 keeps the torch
routing that the HF-equality checks compare.
"""

from __future__ import annotations

import torch

from kernels._triton import HAS_TRITON, next_pow2, pdl_launch, pdl_wait, require_triton, tl, triton

__all__ = ["MAX_EXPERTS", "moe_route", "moe_route_ref"]

MAX_EXPERTS = 1024  # one row in registers: past this it would spill


if HAS_TRITON:

    @triton.jit
    def _moe_route_kernel(Logits, Weights, Ids, num_experts, stride_row,
                          TOP_K: tl.constexpr, K_POW2: tl.constexpr, RENORMALIZE: tl.constexpr,
                          E_POW2: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        pdl_wait(PDL)
        offs = tl.arange(0, E_POW2)
        valid = offs < num_experts
        logits = tl.load(Logits + row * stride_row + offs, mask=valid, other=float("-inf")).to(tl.float32)
        exp = tl.exp(logits - tl.max(logits, axis=0))  # padding: exp(-inf) = 0
        probs = tl.where(valid, exp / tl.sum(exp, axis=0), -1.0)  # padding can never be picked
        slots = tl.arange(0, K_POW2)
        picked = tl.zeros((K_POW2,), dtype=tl.float32)
        picked_ids = tl.zeros((K_POW2,), dtype=tl.int64)
        for j in tl.static_range(TOP_K):
            best = tl.max(probs, axis=0)
            best_id = tl.min(tl.where(probs == best, offs, E_POW2), axis=0)
            picked = tl.where(slots == j, best, picked)
            picked_ids = tl.where(slots == j, best_id.to(tl.int64), picked_ids)
            probs = tl.where(offs == best_id, -1.0, probs)
        if RENORMALIZE:
            picked = picked / tl.sum(tl.where(slots < TOP_K, picked, 0.0), axis=0)
        keep = slots < TOP_K
        tl.store(Weights + row * TOP_K + slots, picked.to(Weights.dtype.element_ty), mask=keep)
        tl.store(Ids + row * TOP_K + slots, picked_ids, mask=keep)


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] in `dtype`, expert ids [T, k] int64), one launch."""
    require_triton("moe_route")
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [T, E] with a contiguous last dim, got {tuple(logits.shape)}")
    tokens, num_experts = logits.shape
    if not 0 < top_k <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"moe_route needs 0 < top_k ({top_k}) <= experts ({num_experts}) <= {MAX_EXPERTS}")
    weights = torch.empty((tokens, top_k), dtype=dtype, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    if tokens == 0:
        return weights, ids
    e_pow2 = next_pow2(num_experts)
    _moe_route_kernel[(tokens,)](
        logits, weights, ids, num_experts, logits.stride(0), TOP_K=top_k, K_POW2=next_pow2(top_k),
        RENORMALIZE=renormalize, E_POW2=e_pow2, num_warps=4 if e_pow2 >= 256 else 1, **pdl_launch(logits.device))
    return weights, ids


def moe_route_ref(logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch routing the kernel replaces (engine/models/moe.py `route`)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids
