"""Decode attention over the paged KV cache (one new query token per sequence).

Layout contract (shared with the engine): ``key_cache``/``value_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]`` and contiguous; sequence ``b`` owns
pages ``block_tables[b, :ceil(seq_lens[b] / block_size)]``; its token ``t`` lives in page
``block_tables[b, t // block_size]`` at offset ``t % block_size``.

Kernel design (memory bound: every cached K/V byte is read exactly once):
* one program per (sequence, kv head, split). The program handles *all* query heads of the
  GQA group at once, so each K/V tile is loaded once per kv head instead of once per query
  head; the group is padded to 16 rows so the two products run on ``tl.dot``.
* split-KV (flash-decoding): with few sequences the (B, Hkv) grid cannot fill the GPU, so
  each sequence's context is cut into ``num_splits`` contiguous chunks processed in
  parallel; each writes a normalised partial output and its log-sum-exp. The last split of
  each (sequence, kv head) to finish (an atomic ticket) combines them in the same launch, so
  a decode layer costs one attention kernel, not two (``single_pass=False`` keeps the older
  separate combine kernel, for comparison). With one split the output is written directly.
* the softmax runs in base 2 (``exp2``) with ``scale * log2(e)`` folded into the scores.
"""

from __future__ import annotations

import functools
import math

import torch

from kernels._triton import (
    HAS_TRITON,
    check_cache_layout,
    dot_needs_upcast,
    next_pow2,
    pdl_launch,
    pdl_wait,
    require_triton,
    tl,
    triton,
)
from kernels.fp8_kv import FP8_DTYPE

__all__ = ["paged_decode_attention", "paged_decode_attention_ref", "default_num_splits", "MIN_SPLIT_TOKENS"]

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 64
_PROGRAMS_PER_SM = 4
MIN_SPLIT_TOKENS = 256  # tokens per split at least, when max_seq_len is known

if HAS_TRITON:

    @triton.jit
    def _decode_split_kernel(
        Q,
        K,
        V,
        BT,
        SL,
        Out,
        MidO,
        MidL,
        Tickets,  # int32 [B * Hkv], zero between launches: the last split resets its entry
        qk_scale,  # scale * log2(e)
        stride_qb,
        stride_qh,
        stride_ob,
        stride_oh,
        stride_btb,
        stride_kblk,
        stride_ktok,
        stride_kh,
        num_splits,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        PAGE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLIT: tl.constexpr,  # False: num_splits == 1 and the output is written directly
        COMBINE: tl.constexpr,  # SPLIT and the last split to finish merges the partials (single pass)
        S_PAD: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        PDL: tl.constexpr,
        v_scale,  # fp8 cache: V's per-tensor scale, applied to the output (K's is folded into qk_scale)
        FP8: tl.constexpr,
        FP8_F16: tl.constexpr = True,  # widen e4m3 to float16 (else to the query's dtype)
    ):
        pdl_wait(PDL)
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)

        seq_len = tl.load(SL + b)
        # Per-sequence chunk, a multiple of BLOCK_N so that only the last tile is ragged.
        chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        start = split * chunk
        end = tl.minimum(start + chunk, seq_len)

        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, D_PAD)
        offs_n = tl.arange(0, BLOCK_N)
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM
        heads = kvh * GROUP + offs_g

        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=g_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        elif FP8 and FP8_F16:
            # An e4m3 cache widens to float16 in one hardware convert per two values (to bfloat16 it goes through
            # float32, two more converts each at a quarter of the FMA rate): q joins it in float16 (exact for any
            # query under 65504) and the products run as fp16 MMAs accumulating in fp32.
            q = q.to(tl.float16)

        m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], dtype=tl.float32)

        bt_row = BT + b.to(tl.int64) * stride_btb
        kv_head_off = kvh * stride_kh
        for n0 in range(start, end, BLOCK_N):
            tok = n0 + offs_n
            n_mask = tok < end
            page = tl.load(bt_row + tok // PAGE, mask=n_mask, other=0).to(tl.int64)
            row = page * stride_kblk + (tok % PAGE) * stride_ktok + kv_head_off
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(K + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            if FP8:  # e4m3 -> the query's dtype (exact); the scale is applied outside the dot
                k = k.to(q.dtype)
            if UPCAST:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [G, N]
            s = tl.where(n_mask[None, :], s, float("-inf"))
            # Every tile holds >= 1 valid token, so m_new is finite and no NaN can appear.
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(V + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            if FP8:
                v = v.to(q.dtype)
            if UPCAST:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new

        has = l_i > 0.0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        if FP8:
            out = out * v_scale
        out_mask = g_mask[:, None] & d_mask[None, :]
        if not SPLIT:
            tl.store(
                Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                out.to(Out.dtype.element_ty),
                mask=out_mask,
            )
        else:
            # MidO: [B, H, num_splits, D_PAD] fp32, MidL: [B, H, num_splits] fp32 (log2 domain).
            row_id = (b * (GROUP * tl.num_programs(1)) + heads).to(tl.int64) * num_splits + split
            tl.store(MidO + row_id[:, None] * D_PAD + offs_d[None, :], out, mask=out_mask)
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            tl.store(MidL + row_id, lse, mask=g_mask)
            if COMBINE:
                # Every thread's partial stores are issued before the ticket (barrier), and the ticket's
                # acq_rel at GPU scope publishes them to whichever program draws the last ticket.
                tl.debug_barrier()
                ticket_ptr = Tickets + b * tl.num_programs(1) + kvh
                ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
                if ticket == num_splits - 1:
                    tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next launch
                    # One unrolled pass per head over the splits that hold tokens (independent loads, no
                    # serial loop over splits: a 32-step loop made this tail cost ~10 us on an H200).
                    offs_s = tl.arange(0, S_PAD)
                    s_mask = offs_s < (seq_len + chunk - 1) // tl.maximum(chunk, 1)
                    for g in tl.static_range(GROUP):
                        head = kvh * GROUP + g
                        first = (b * (GROUP * tl.num_programs(1)) + head).to(tl.int64) * num_splits
                        lse_s = tl.load(MidL + first + offs_s, mask=s_mask, other=float("-inf"),
                                        cache_modifier=".cg")
                        m_s = tl.max(lse_s, axis=0)
                        m_s = tl.where(m_s == float("-inf"), 0.0, m_s)  # empty sequence: all weights 0
                        w = tl.where(lse_s != float("-inf"), tl.exp2(lse_s - m_s), 0.0)
                        o = tl.load(MidO + (first + offs_s)[:, None] * D_PAD + offs_d[None, :],
                                    mask=s_mask[:, None] & d_mask[None, :], other=0.0, cache_modifier=".cg")
                        total = tl.sum(w, axis=0)
                        res = tl.sum(o * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
                        tl.store(Out + b * stride_ob + head * stride_oh + offs_d, res.to(Out.dtype.element_ty),
                                 mask=d_mask)

    @triton.jit
    def _decode_reduce_kernel(
        MidO,
        MidL,
        Out,
        stride_ob,
        stride_oh,
        num_heads,
        num_splits,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        S_PAD: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_wait(PDL)
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, S_PAD)
        offs_d = tl.arange(0, D_PAD)
        s_mask = offs_s < num_splits
        d_mask = offs_d < HEAD_DIM
        base = (b * num_heads + h).to(tl.int64) * num_splits
        lse = tl.load(MidL + base + offs_s, mask=s_mask, other=float("-inf"))
        m = tl.max(lse, axis=0)
        m = tl.where(m == float("-inf"), 0.0, m)  # empty sequence: all weights are 0
        valid = lse != float("-inf")
        w = tl.where(valid, tl.exp2(lse - m), 0.0)
        o = tl.load(
            MidO + (base + offs_s)[:, None] * D_PAD + offs_d[None, :],
            mask=valid[:, None] & d_mask[None, :],
            other=0.0,
        )
        total = tl.sum(w, axis=0)
        res = tl.sum(o * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
        tl.store(Out + b * stride_ob + h * stride_oh + offs_d, res.to(Out.dtype.element_ty), mask=d_mask)


@functools.lru_cache(maxsize=16)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(
    batch: int, num_kv_heads: int, device: torch.device, max_seq_len: int | None = None
) -> int:
    """Splits so that the (batch, kv head, split) grid gives about four programs per SM.

    Measured on an H200 (bench/KERNELS_NOTES.md): the kernel streams K/V at 90-100% of copy
    bandwidth once the grid holds ~512 programs (4 per SM), and the best split count in each
    sweep was floor(4 * SMs / (batch * kv_heads)); rounding up (one split more) cost 6-30%.
    Chosen from shapes only (no device sync on seq_lens, so it is CUDA-graph safe);
    ``max_seq_len`` (a host-side bound the scheduler knows) keeps every split at least
    ``MIN_SPLIT_TOKENS`` tokens, so short contexts skip the second (reduce) launch.
    """
    if device.type != "cuda":
        return 1
    programs = batch * num_kv_heads
    target = _PROGRAMS_PER_SM * _sm_count(
        device.index if device.index is not None else torch.cuda.current_device()
    )
    splits = max(1, min(_MAX_SPLITS, target // programs))
    if max_seq_len is not None:
        splits = min(splits, max(1, math.ceil(max_seq_len / MIN_SPLIT_TOKENS)))
    return splits


def _check_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> tuple[int, int, int, int]:
    _, _, num_kv_heads, head_dim = check_cache_layout(key_cache, value_cache)
    if query.dim() != 3:
        raise ValueError(f"query must be [batch, num_heads, head_dim], got {tuple(query.shape)}")
    batch, num_heads, qd = query.shape
    if qd != head_dim:
        raise ValueError(f"query head_dim {qd} != cache head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if query.dtype != key_cache.dtype and key_cache.dtype != FP8_DTYPE:
        raise ValueError(f"query dtype {query.dtype} != cache dtype {key_cache.dtype}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be int32 [batch={batch}, max_blocks], got "
                         f"{block_tables.dtype} {tuple(block_tables.shape)}")
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must be int32 [batch={batch}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    for name, t in (("query", query), ("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.device != key_cache.device:
            raise ValueError(f"{name} is on {t.device}, the cache on {key_cache.device}")
    return batch, num_heads, num_kv_heads, head_dim


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    *,
    max_seq_len: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    tickets: torch.Tensor | None = None,
    single_pass: bool = True,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp8_f16: bool = True,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    query [B, H, D]; caches [num_blocks, block_size, Hkv, D]; block_tables int32 [B, max_blocks];
    seq_lens int32 [B] (tokens in the cache, including the current one). Returns [B, H, D] in
    the query dtype; a sequence with seq_len 0 gets zeros. ``max_seq_len`` (optional host int,
    >= every seq_len) lets the default split count avoid splitting short contexts.
    ``block_n``/``num_warps`` are tuning knobs (tokens per loop iteration, warps per program).
    ``tickets`` (int32, >= B * Hkv elements, all zero; they are zero again after the launch) lets a
    caller keep one persistent buffer, e.g. across CUDA graph replays; without it a zeroed one is
    allocated per call. ``single_pass=False`` combines the splits in a second kernel instead.
    An fp8 (e4m3) cache is read as stored value x ``k_scale`` / ``v_scale`` (per tensor); with a 16-bit query it
    is widened to float16 for the products (``fp8_f16=False``: to the query's dtype, for comparison).
    ``num_stages`` overrides Triton's software-pipelining depth (a tuning knob).
    """
    require_triton("paged_decode_attention")
    batch, num_heads, num_kv_heads, head_dim = _check_inputs(
        query, key_cache, value_cache, block_tables, seq_lens
    )
    if query.stride(-1) != 1:
        query = query.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError("out must match query's shape and dtype, with a contiguous last dim")
    if batch == 0:
        return out

    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, query.device, max_seq_len)
    if not 1 <= num_splits <= 256:
        raise ValueError(f"num_splits must be in [1, 256], got {num_splits}")

    page = key_cache.shape[1]
    group = num_heads // num_kv_heads
    d_pad = next_pow2(head_dim)
    fp8 = key_cache.dtype == FP8_DTYPE
    if block_n is None:
        # ~16 KB of K per iteration: 64 tokens at D=128, 128 at D=64 (H200 sweep: +10-25%
        # for Qwen-0.5B's D=64 over 64 tokens). An fp8 cache keeps the token count (8 KB of K): in an H100 sweep
        # at 32k x 16 sequences (not kept as a file), 64 tokens with 2 warps took 427 us against 470 for 128 tokens
        # with 4; with these defaults bench/results/quant_gpu_h100.json (kv) has fp8 at 1.60x bf16 there.
        block_n = max(16, min(128, 8192 // head_dim))
    block_n = max(16, next_pow2(block_n))
    if num_warps is None:
        num_warps = 2 if fp8 else 4
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    combine = num_splits > 1 and single_pass
    common = dict(
        COMBINE=combine,
        S_PAD=next_pow2(num_splits),
        GROUP=group,
        GROUP_PAD=max(16, next_pow2(group)),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        PAGE=page,
        BLOCK_N=block_n,
        SPLIT=num_splits > 1,
        PRECISION=precision,
        UPCAST=dot_needs_upcast(query.dtype),
    )
    if num_splits == 1:
        mid_o = mid_l = out  # unused placeholders
    else:
        mid_o = torch.empty((batch, num_heads, num_splits, d_pad), dtype=torch.float32, device=query.device)
        mid_l = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=query.device)
    if not combine:
        tickets = seq_lens  # unused placeholder
    elif tickets is None:
        tickets = torch.zeros(batch * num_kv_heads, dtype=torch.int32, device=query.device)
    elif tickets.dtype != torch.int32 or tickets.numel() < batch * num_kv_heads or tickets.device != query.device:
        raise ValueError(f"tickets must be int32 with >= {batch * num_kv_heads} elements on {query.device}")
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        out,
        mid_o,
        mid_l,
        tickets,
        float(scale) * _LOG2E * float(k_scale),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        num_splits,
        v_scale=float(v_scale),
        FP8=fp8,
        FP8_F16=fp8 and fp8_f16 and query.dtype != torch.float32 and not common["UPCAST"],
        num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}),
        **common,
        **pdl_launch(query.device),
    )
    if num_splits > 1 and not combine:
        _decode_reduce_kernel[(batch, num_heads)](
            mid_o,
            mid_l,
            out,
            out.stride(0),
            out.stride(1),
            num_heads,
            num_splits,
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            S_PAD=next_pow2(num_splits),
            num_warps=4,
            **pdl_launch(query.device),
        )
    return out


def paged_decode_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Plain torch reference: gathers each sequence's pages and runs softmax attention (an fp8 cache
    dequantized as value x scale).

    Computes in float32 (or float64 when given float64 inputs); returns the query dtype.
    """
    batch, num_heads, num_kv_heads, head_dim = _check_inputs(
        query, key_cache, value_cache, block_tables, seq_lens
    )
    page = key_cache.shape[1]
    cdt = torch.float64 if query.dtype == torch.float64 else torch.float32
    group = num_heads // num_kv_heads
    out = torch.zeros_like(query)
    for b in range(batch):
        n = int(seq_lens[b])
        if n == 0:
            continue
        pages = block_tables[b, : (n + page - 1) // page].long()
        k = key_cache[pages].reshape(-1, num_kv_heads, head_dim)[:n].to(cdt) * k_scale  # [n, Hkv, D]
        v = value_cache[pages].reshape(-1, num_kv_heads, head_dim)[:n].to(cdt) * v_scale
        k = k.repeat_interleave(group, dim=1)  # [n, H, D]: query head h uses kv head h // group
        v = v.repeat_interleave(group, dim=1)
        q = query[b].to(cdt)  # [H, D]
        scores = torch.einsum("hd,nhd->hn", q, k) * scale
        probs = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", probs, v).to(query.dtype)
    return out
