"""Prefill / extend attention over the paged KV cache (varlen, causal).

Sequence ``b`` contributes ``q_len = cu_seqlens_q[b+1] - cu_seqlens_q[b]`` new query tokens,
packed in ``query[cu_seqlens_q[b]:cu_seqlens_q[b+1]]``. Its cache already holds
``seq_lens[b]`` tokens, the new ones included (they are written before attention runs), so
new token ``i`` sits at absolute position ``seq_lens[b] - q_len + i`` and attends to cache
positions ``0..that position``. This covers plain prefill (q_len == seq_len), chunked
prefill and prefix-cache hits (q_len < seq_len) with one kernel.

Kernel design: one program per (sequence, query head, tile of BLOCK_M new tokens), flash
attention with an online softmax over BLOCK_N-token tiles of keys gathered through the
block table. Key tiles past the tile's last position are never visited (causal skip), and
tiles wholly before its first position run without any mask; only the diagonal tiles pay
for the causal and length masks.
"""

from __future__ import annotations

import torch

from kernels._triton import (
    HAS_TRITON,
    check_cache_layout,
    dot_needs_upcast,
    next_pow2,
    require_triton,
    tl,
    triton,
)
from kernels.fp8_kv import FP8_DTYPE

__all__ = ["paged_prefill_attention", "paged_prefill_attention_ref"]

_LOG2E = 1.4426950408889634

if HAS_TRITON:

    @triton.jit
    def _attend_tile(
        acc, m_i, l_i, q, K, V, bt_row, n0, end, pos_m, offs_n, offs_d, d_mask, qk_scale,
        kv_head_off, stride_kblk, stride_ktok,
        PAGE: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        EVEN_D: tl.constexpr,
        MASKED: tl.constexpr,
        FP8: tl.constexpr,
    ):
        """One BLOCK_N tile of keys: online-softmax update of (acc, m_i, l_i)."""
        tok = n0 + offs_n
        if MASKED:
            n_mask = tok < end
            page = tl.load(bt_row + tok // PAGE, mask=n_mask, other=0).to(tl.int64)
            kv_mask = n_mask[:, None] & d_mask[None, :]
        else:
            page = tl.load(bt_row + tok // PAGE).to(tl.int64)
            kv_mask = d_mask[None, :]
        row = page * stride_kblk + (tok % PAGE) * stride_ktok + kv_head_off
        ptr = row[:, None] + offs_d[None, :]
        if MASKED or not EVEN_D:
            k = tl.load(K + ptr, mask=kv_mask, other=0.0)
            v = tl.load(V + ptr, mask=kv_mask, other=0.0)
        else:
            k = tl.load(K + ptr)
            v = tl.load(V + ptr)
        if FP8:  # e4m3 -> the query's dtype (exact); scales applied outside the dots
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, N]
        if MASKED:
            keep = (tok[None, :] <= pos_m[:, None]) & n_mask[None, :]
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return acc, m_new, l_i

    @triton.jit
    def _prefill_kernel(
        Q,
        K,
        V,
        BT,
        CU,
        SL,
        Out,
        qk_scale,  # scale * log2(e)
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_btb,
        stride_kblk,
        stride_ktok,
        stride_kh,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        EVEN_D: tl.constexpr,
        v_scale,  # fp8 cache: V's per-tensor scale, applied to the output (K's is folded into qk_scale)
        FP8: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        mblk = tl.program_id(2)

        q_start = tl.load(CU + b)
        q_len = tl.load(CU + b + 1) - q_start
        if mblk * BLOCK_M >= q_len:
            return
        seq_len = tl.load(SL + b)
        prefix = seq_len - q_len

        offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        offs_n = tl.arange(0, BLOCK_N)
        m_mask = offs_m < q_len
        d_mask = offs_d < HEAD_DIM
        pos_m = prefix + offs_m  # absolute positions of this tile's queries

        q_rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(
            Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
            mask=m_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)

        bt_row = BT + b.to(tl.int64) * stride_btb
        kv_head_off = (h // GROUP) * stride_kh
        # Keys before the tile's first query position are visible to every row: those full
        # tiles need no causal or length mask. Keys past its last position are masked for
        # every row: skip them.
        full_end = ((prefix + mblk * BLOCK_M) // BLOCK_N) * BLOCK_N
        end = tl.minimum(prefix + (mblk + 1) * BLOCK_M, seq_len)
        for n0 in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, K, V, bt_row, n0, end, pos_m, offs_n, offs_d, d_mask, qk_scale,
                kv_head_off, stride_kblk, stride_ktok, PAGE, PRECISION, UPCAST, EVEN_D, False, FP8,
            )
        # The first masked tile holds key full_end <= every row's position, so m_i is finite
        # after it and fully masked rows in later tiles give p == 0, never NaN.
        for n0 in range(full_end, end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, K, V, bt_row, n0, end, pos_m, offs_n, offs_d, d_mask, qk_scale,
                kv_head_off, stride_kblk, stride_ktok, PAGE, PRECISION, UPCAST, EVEN_D, True, FP8,
            )

        out = acc / l_i[:, None]
        if FP8:
            out = out * v_scale
        tl.store(
            Out + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=m_mask[:, None] & d_mask[None, :],
        )


def _check_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
) -> tuple[int, int, int, int]:
    _, _, num_kv_heads, head_dim = check_cache_layout(key_cache, value_cache)
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}")
    _, num_heads, qd = query.shape
    if qd != head_dim:
        raise ValueError(f"query head_dim {qd} != cache head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if query.dtype != key_cache.dtype and key_cache.dtype != FP8_DTYPE:
        raise ValueError(f"query dtype {query.dtype} != cache dtype {key_cache.dtype}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError(f"block_tables must be int32 [batch, max_blocks], got {block_tables.dtype} "
                         f"{tuple(block_tables.shape)}")
    batch = block_tables.shape[0]
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.shape != (batch + 1,):
        raise ValueError(f"cu_seqlens_q must be int32 [batch+1={batch + 1}], got {cu_seqlens_q.dtype} "
                         f"{tuple(cu_seqlens_q.shape)}")
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must be int32 [batch={batch}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    for name, t in (("query", query), ("block_tables", block_tables), ("cu_seqlens_q", cu_seqlens_q),
                    ("seq_lens", seq_lens)):
        if t.device != key_cache.device:
            raise ValueError(f"{name} is on {t.device}, the cache on {key_cache.device}")
    return batch, num_heads, num_kv_heads, head_dim


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_q_len: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of packed new tokens over their sequences' paged caches (an fp8 cache read as stored
    value x ``k_scale`` / ``v_scale``).

    query [T, H, D] packed by ``cu_seqlens_q`` (int32 [B+1], cu[0] == 0, cu[B] == T);
    ``seq_lens`` int32 [B] counts cached tokens including the new ones (so seq_lens[b] >=
    q_len). ``max_q_len`` (host int) bounds the grid; without it the bound is T, which avoids
    a device sync at the price of programs that exit at once. Returns [T, H, D].
    """
    require_triton("paged_prefill_attention")
    batch, num_heads, num_kv_heads, head_dim = _check_inputs(
        query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens
    )
    num_tokens = query.shape[0]
    if query.stride(-1) != 1:
        query = query.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    cu_seqlens_q = cu_seqlens_q.contiguous()
    seq_lens = seq_lens.contiguous()
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError("out must match query's shape and dtype, with a contiguous last dim")
    if batch == 0 or num_tokens == 0:
        return out

    is_fp32 = query.dtype == torch.float32
    if block_m is None:
        block_m = 32 if is_fp32 else 64
    if block_n is None:
        block_n = 32 if is_fp32 else 64
    block_m = max(16, next_pow2(block_m))
    block_n = max(16, next_pow2(block_n))
    if num_warps is None:
        num_warps = 4
    if num_stages is None:
        num_stages = 2
    bound = num_tokens if max_q_len is None else min(int(max_q_len), num_tokens)
    grid = (batch, num_heads, triton.cdiv(max(bound, 1), block_m))
    _prefill_kernel[grid](
        query,
        key_cache,
        value_cache,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        out,
        float(scale) * _LOG2E * float(k_scale),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        D_PAD=next_pow2(head_dim),
        PAGE=key_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PRECISION="ieee" if is_fp32 else "tf32",
        UPCAST=dot_needs_upcast(query.dtype),
        EVEN_D=next_pow2(head_dim) == head_dim,
        v_scale=float(v_scale),
        FP8=key_cache.dtype == FP8_DTYPE,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def paged_prefill_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Plain torch reference: per sequence, gather the cache and run masked softmax attention (an fp8 cache
    dequantized as value x scale).

    Computes in float32 (float64 for float64 inputs); returns the query dtype.
    """
    batch, num_heads, num_kv_heads, head_dim = _check_inputs(
        query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens
    )
    page = key_cache.shape[1]
    group = num_heads // num_kv_heads
    cdt = torch.float64 if query.dtype == torch.float64 else torch.float32
    out = torch.zeros_like(query)
    for b in range(batch):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        n, q_len = int(seq_lens[b]), q1 - q0
        if q_len == 0:
            continue
        if q_len > n:
            raise ValueError(f"sequence {b}: q_len {q_len} > seq_len {n}")
        pages = block_tables[b, : (n + page - 1) // page].long()
        k = key_cache[pages].reshape(-1, num_kv_heads, head_dim)[:n].to(cdt) * k_scale  # [n, Hkv, D]
        v = value_cache[pages].reshape(-1, num_kv_heads, head_dim)[:n].to(cdt) * v_scale
        q = query[q0:q1].to(cdt)  # [q_len, H, D]
        q_pos = torch.arange(n - q_len, n, device=query.device)
        k_pos = torch.arange(n, device=query.device)
        future = k_pos[None, :] > q_pos[:, None]  # [q_len, n]
        for h in range(num_heads):  # one head at a time bounds memory to a [q_len, n] matrix
            scores = (q[:, h] @ k[:, h // group].T) * scale
            probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
            out[q0:q1, h] = (probs @ v[:, h // group]).to(query.dtype)
    return out
