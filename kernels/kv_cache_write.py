"""Scatter new tokens' K/V into the paged cache by slot mapping.

``slot = block_id * block_size + offset``; a negative slot (padding tokens, or tokens whose
KV the engine does not keep) is skipped. Each program writes a few tokens, all kv heads of each: in the contiguous
``[num_blocks, block_size, Hkv, D]`` layout a token's ``Hkv * D`` elements are one
contiguous run, so every token is one coalesced read and one coalesced write.
"""

from __future__ import annotations

import torch

from kernels._triton import HAS_TRITON, check_cache_layout, next_pow2, require_triton, tl, triton
from kernels.fp8_kv import FP8_DTYPE, quantize_fp8

__all__ = ["write_kv_cache", "write_kv_cache_ref"]

if HAS_TRITON:
    from kernels.fp8_kv import round_to_e4m3

    @triton.jit
    def _write_kv_kernel(
        Key,
        Value,
        KC,
        VC,
        Slots,
        num_tokens,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_cblk,
        stride_ctok,
        stride_ch,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HD_PAD: tl.constexpr,
        PAGE: tl.constexpr,
        BLOCK_T: tl.constexpr,
        k_scale=1.0,
        v_scale=1.0,
        FP8: tl.constexpr = False,
    ):
        # BLOCK_T tokens per program, each token's Hkv*D elements flattened on one axis, so
        # small-head models still move a few KB per program instead of a few hundred bytes.
        offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_mask = offs_t < num_tokens
        slot = tl.load(Slots + offs_t, mask=t_mask, other=-1)
        keep = slot >= 0
        blk = slot // PAGE
        off = slot % PAGE
        offs = tl.arange(0, HD_PAD)
        head = offs // HEAD_DIM
        dim = offs % HEAD_DIM
        mask = keep[:, None] & (offs < NUM_KV_HEADS * HEAD_DIM)[None, :]
        t64 = offs_t.to(tl.int64)[:, None]
        k = tl.load(Key + t64 * stride_kt + (head * stride_kh + dim)[None, :], mask=mask)
        v = tl.load(Value + t64 * stride_vt + (head * stride_vh + dim)[None, :], mask=mask)
        dst = (blk * stride_cblk + off * stride_ctok)[:, None] + (head * stride_ch + dim)[None, :]
        if FP8:  # e4m3 cache: value / scale, rounded onto the e4m3 grid (kernels/fp8_kv.py)
            k = round_to_e4m3(k.to(tl.float32) / k_scale)
            v = round_to_e4m3(v.to(tl.float32) / v_scale)
        tl.store(KC + dst, k.to(KC.dtype.element_ty), mask=mask)
        tl.store(VC + dst, v.to(VC.dtype.element_ty), mask=mask)


def _check_inputs(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    _, _, num_kv_heads, head_dim = check_cache_layout(key_cache, value_cache)
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key/value must both be [T, Hkv, D], got {tuple(key.shape)} and {tuple(value.shape)}")
    if key.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"key heads/dim {tuple(key.shape[1:])} != cache {(num_kv_heads, head_dim)}")
    if key.dtype != value.dtype or (key.dtype != key_cache.dtype and key_cache.dtype != FP8_DTYPE):
        raise ValueError(f"key/value dtype {key.dtype}/{value.dtype} != cache dtype {key_cache.dtype}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be int64 [T={key.shape[0]}], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    for name, t in (("key", key), ("value", value), ("slot_mapping", slot_mapping)):
        if t.device != key_cache.device:
            raise ValueError(f"{name} is on {t.device}, the cache on {key_cache.device}")


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """key/value [T, Hkv, D] (last dim contiguous; views of a fused qkv are fine) into the caches. An fp8 (e4m3)
    cache stores value / scale (per-tensor `k_scale`, `v_scale`).

    Slots must lie in ``[0, num_blocks * block_size)`` or be negative (skipped); they are not
    bounds-checked on the device (that would need a sync).
    """
    require_triton("write_kv_cache")
    _check_inputs(key, value, key_cache, value_cache, slot_mapping)
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    hd_pad = next_pow2(num_kv_heads * head_dim)
    block_t = max(1, min(16, 4096 // hd_pad))  # about 4K elements per program
    _write_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping.contiguous(),
        num_tokens,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HD_PAD=hd_pad,
        PAGE=key_cache.shape[1],
        BLOCK_T=block_t,
        k_scale=float(k_scale),
        v_scale=float(v_scale),
        FP8=key_cache.dtype == FP8_DTYPE,
        num_warps=4 if block_t * hd_pad >= 1024 else 1,
    )


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Plain torch reference (in place): index_copy into the flattened token dimension."""
    _check_inputs(key, value, key_cache, value_cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    num_blocks, page, num_kv_heads, head_dim = key_cache.shape
    if key_cache.dtype == FP8_DTYPE:
        key, value = quantize_fp8(key, k_scale), quantize_fp8(value, v_scale)
    key_cache.view(num_blocks * page, num_kv_heads, head_dim)[slots] = key[keep]
    value_cache.view(num_blocks * page, num_kv_heads, head_dim)[slots] = value[keep]
