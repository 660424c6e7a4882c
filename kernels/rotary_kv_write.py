"""Rotary embedding and the KV-cache write in one kernel (one launch per layer instead of two).

Same contract as ``rotary_embedding`` followed by ``write_kv_cache``: q and k are rotated in place (neox style,
fp32 math, the same expressions as kernels/rotary.py so the bits match), then the rotated k and v are stored at
their slot in the paged cache ``[num_blocks, block_size, Hkv, D]``; a negative slot skips the write. One program
per token: cos/sin are loaded once and k never makes a round trip through memory between the two steps.
"""

from __future__ import annotations

import torch

from kernels._triton import (
    HAS_TRITON,
    check_cache_layout,
    next_pow2,
    pdl_launch,
    pdl_wait,
    require_triton,
    tl,
    triton,
)
from kernels.fp8_kv import FP8_DTYPE
from kernels.kv_cache_write import write_kv_cache_ref
from kernels.rotary import rotary_embedding_ref

__all__ = ["rotary_and_write_kv", "rotary_and_write_kv_ref"]

if HAS_TRITON:
    from kernels.fp8_kv import round_to_e4m3
    from kernels.rotary import _cos_sin, _rotate_heads

    @triton.jit
    def _rotary_kv_kernel(
        Pos,
        Q,
        K,
        V,
        CS,
        KC,
        VC,
        Slots,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_cs,
        stride_cblk,
        stride_ctok,
        stride_ch,
        NUM_Q_HEADS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        QH_PAD: tl.constexpr,
        KH_PAD: tl.constexpr,
        HALF: tl.constexpr,
        HALF_PAD: tl.constexpr,
        PAGE: tl.constexpr,
        PDL: tl.constexpr,
        k_scale=1.0,
        v_scale=1.0,
        FP8: tl.constexpr = False,
    ):
        pdl_wait(PDL)
        t = tl.program_id(0).to(tl.int64)
        offs_half, cmask, cos, sin = _cos_sin(Pos, CS, t, stride_cs, HALF, HALF_PAD)
        _rotate_heads(Q, stride_qt, stride_qh, t, cos, sin, offs_half, NUM_Q_HEADS, QH_PAD, HALF)

        offs_h = tl.arange(0, KH_PAD)
        mask = (offs_h < NUM_KV_HEADS)[:, None] & cmask[None, :]
        pk = K + t * stride_kt + offs_h[:, None] * stride_kh + offs_half[None, :]
        k1 = tl.load(pk, mask=mask, other=0.0).to(tl.float32)
        k2 = tl.load(pk + HALF, mask=mask, other=0.0).to(tl.float32)
        r1 = (k1 * cos - k2 * sin).to(K.dtype.element_ty)
        r2 = (k2 * cos + k1 * sin).to(K.dtype.element_ty)
        tl.store(pk, r1, mask=mask)
        tl.store(pk + HALF, r2, mask=mask)

        slot = tl.load(Slots + t)
        if slot >= 0:
            pv = V + t * stride_vt + offs_h[:, None] * stride_vh + offs_half[None, :]
            v1 = tl.load(pv, mask=mask, other=0.0)
            v2 = tl.load(pv + HALF, mask=mask, other=0.0)
            dst = (slot // PAGE) * stride_cblk + (slot % PAGE) * stride_ctok + offs_h[:, None] * stride_ch
            dst = dst + offs_half[None, :]
            # New names in both branches: Triton refuses a variable whose type changes inside a runtime `if`.
            if FP8:  # e4m3 cache: value / scale on the e4m3 grid (kernels/fp8_kv.py)
                kc1 = round_to_e4m3(r1.to(tl.float32) / k_scale).to(KC.dtype.element_ty)
                kc2 = round_to_e4m3(r2.to(tl.float32) / k_scale).to(KC.dtype.element_ty)
                vc1 = round_to_e4m3(v1.to(tl.float32) / v_scale).to(VC.dtype.element_ty)
                vc2 = round_to_e4m3(v2.to(tl.float32) / v_scale).to(VC.dtype.element_ty)
            else:
                kc1 = r1.to(KC.dtype.element_ty)
                kc2 = r2.to(KC.dtype.element_ty)
                vc1 = v1.to(VC.dtype.element_ty)
                vc2 = v2.to(VC.dtype.element_ty)
            tl.store(KC + dst, kc1, mask=mask)
            tl.store(KC + dst + HALF, kc2, mask=mask)
            tl.store(VC + dst, vc1, mask=mask)
            tl.store(VC + dst + HALF, vc2, mask=mask)


def _check(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           cos_sin_cache: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
           slot_mapping: torch.Tensor) -> None:
    _, _, num_kv_heads, head_dim = check_cache_layout(key_cache, value_cache)
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q/k/v must be [T, H, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or k.shape[1:] != (num_kv_heads, head_dim) or q.shape[2] != head_dim:
        raise ValueError(f"k/v {tuple(k.shape)}/{tuple(v.shape)} and q {tuple(q.shape)} do not match the cache "
                         f"(Hkv={num_kv_heads}, D={head_dim})")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache must be [max_pos, head_dim={head_dim}], got {tuple(cos_sin_cache.shape)}")
    num_tokens = q.shape[0]
    if k.shape[0] != num_tokens:
        raise ValueError(f"k has {k.shape[0]} tokens, q {num_tokens}")
    for name, idx in (("positions", positions), ("slot_mapping", slot_mapping)):
        if idx.dtype != torch.int64 or idx.shape != (num_tokens,):
            raise ValueError(f"{name} must be int64 [T={num_tokens}], got {idx.dtype} {tuple(idx.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or (key_cache.dtype not in (q.dtype, FP8_DTYPE)):
        raise ValueError(f"q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype} != cache dtype {key_cache.dtype}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim")
    for name, x in (("positions", positions), ("q", q), ("k", k), ("v", v), ("cos_sin_cache", cos_sin_cache),
                    ("slot_mapping", slot_mapping)):
        if x.device != key_cache.device:
            raise ValueError(f"{name} is on {x.device}, the cache on {key_cache.device}")


def rotary_and_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        cos_sin_cache: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Rotate q [T, H, D] and k [T, Hkv, D] in place; store rotated k and v at their slots (negative: skip);
    an fp8 cache stores them divided by `k_scale` / `v_scale`.

    Views into a fused qkv buffer are fine. Positions and slots are not bounds-checked on the device.
    """
    require_triton("rotary_and_write_kv")
    _check(positions, q, k, v, cos_sin_cache, key_cache, value_cache, slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return
    if cos_sin_cache.stride(1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    half = head_dim // 2
    elems = (num_heads + 2 * num_kv_heads) * head_dim
    _rotary_kv_kernel[(num_tokens,)](
        positions.contiguous(), q, k, v, cos_sin_cache, key_cache, value_cache, slot_mapping.contiguous(),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, QH_PAD=next_pow2(num_heads),
        KH_PAD=next_pow2(num_kv_heads), HALF=half, HALF_PAD=next_pow2(half), PAGE=key_cache.shape[1],
        num_warps=4 if elems >= 2048 else 1, **pdl_launch(q.device),
        k_scale=float(k_scale), v_scale=float(v_scale), FP8=key_cache.dtype == FP8_DTYPE,
    )


def rotary_and_write_kv_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cos_sin_cache: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """The two unfused references in sequence (same in-place contract)."""
    _check(positions, q, k, v, cos_sin_cache, key_cache, value_cache, slot_mapping)
    rotary_embedding_ref(positions, q, k, cos_sin_cache)
    write_kv_cache_ref(k, v, key_cache, value_cache, slot_mapping, k_scale, v_scale)
