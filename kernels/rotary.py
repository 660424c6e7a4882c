"""Rotary position embedding, neox style (rotate-half; the HF Llama/Qwen convention), in place.

``cos_sin_cache`` is ``[max_position, rot_dim]``: the first ``rot_dim / 2`` columns hold cos,
the rest sin (vLLM's layout); here ``rot_dim == head_dim``. For each head, with
``x1 = x[:D/2]``, ``x2 = x[D/2:]``: ``x1' = x1*cos - x2*sin``, ``x2' = x2*cos + x1*sin``.
One program per token rotates all its q and k heads, so cos/sin are loaded once per token.
"""

from __future__ import annotations

import torch

from kernels._triton import HAS_TRITON, next_pow2, require_triton, tl, triton

__all__ = ["rotary_embedding", "rotary_embedding_ref", "build_cos_sin_cache"]

if HAS_TRITON:

    @triton.jit
    def _rotate_heads(X, stride_t, stride_h, t, cos, sin, offs_half,
                      NUM_HEADS: tl.constexpr, H_PAD: tl.constexpr, HALF: tl.constexpr):
        offs_h = tl.arange(0, H_PAD)
        mask = (offs_h < NUM_HEADS)[:, None] & (offs_half < HALF)[None, :]
        p1 = X + t * stride_t + offs_h[:, None] * stride_h + offs_half[None, :]
        x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
        tl.store(p1, (x1 * cos - x2 * sin).to(X.dtype.element_ty), mask=mask)
        tl.store(p1 + HALF, (x2 * cos + x1 * sin).to(X.dtype.element_ty), mask=mask)

    @triton.jit
    def _cos_sin(Pos, CS, t, stride_cs, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
        """Token t's (half offsets, their mask, cos [1, HALF_PAD], sin [1, HALF_PAD]) in fp32, zero past HALF."""
        pos = tl.load(Pos + t)
        offs_half = tl.arange(0, HALF_PAD)
        cmask = offs_half < HALF
        cos = tl.load(CS + pos * stride_cs + offs_half, mask=cmask, other=0.0).to(tl.float32)[None, :]
        sin = tl.load(CS + pos * stride_cs + HALF + offs_half, mask=cmask, other=0.0).to(tl.float32)[None, :]
        return offs_half, cmask, cos, sin

    @triton.jit
    def _rotary_kernel(
        Pos,
        Q,
        K,
        CS,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_cs,
        NUM_Q_HEADS: tl.constexpr,
        NUM_K_HEADS: tl.constexpr,
        QH_PAD: tl.constexpr,
        KH_PAD: tl.constexpr,
        HALF: tl.constexpr,
        HALF_PAD: tl.constexpr,
        HAS_K: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        offs_half, cmask, cos, sin = _cos_sin(Pos, CS, t, stride_cs, HALF, HALF_PAD)
        _rotate_heads(Q, stride_qt, stride_qh, t, cos, sin, offs_half, NUM_Q_HEADS, QH_PAD, HALF)
        if HAS_K:
            _rotate_heads(K, stride_kt, stride_kh, t, cos, sin, offs_half, NUM_K_HEADS, KH_PAD, HALF)


def _heads_view(x: torch.Tensor, head_dim: int, name: str) -> tuple[int, int, int]:
    """(num_heads, stride_token, stride_head) for x [T, H*D] or [T, H, D] with contiguous D."""
    if x.dim() == 2:
        if x.shape[1] % head_dim:
            raise ValueError(f"{name} width {x.shape[1]} is not a multiple of head_dim {head_dim}")
        if x.stride(1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim (it is rotated in place)")
        return x.shape[1] // head_dim, x.stride(0), head_dim
    if x.dim() == 3:
        if x.shape[2] != head_dim:
            raise ValueError(f"{name} head_dim {x.shape[2]} != rot_dim {head_dim}")
        if x.stride(2) != 1:
            raise ValueError(f"{name} needs a contiguous last dim (it is rotated in place)")
        return x.shape[1], x.stride(0), x.stride(1)
    raise ValueError(f"{name} must be [T, H*D] or [T, H, D], got {tuple(x.shape)}")


def _check(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
           cos_sin_cache: torch.Tensor) -> int:
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] % 2:
        raise ValueError(f"cos_sin_cache must be [max_pos, rot_dim] with even rot_dim, got "
                         f"{tuple(cos_sin_cache.shape)}")
    num_tokens = query.shape[0]
    if positions.dtype != torch.int64 or positions.shape != (num_tokens,):
        raise ValueError(f"positions must be int64 [T={num_tokens}], got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    if key is not None and key.shape[0] != num_tokens:
        raise ValueError(f"key has {key.shape[0]} tokens, query {num_tokens}")
    for name, t in (("positions", positions), ("key", key), ("cos_sin_cache", cos_sin_cache)):
        if t is not None and t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, query on {query.device}")
    return cos_sin_cache.shape[1]


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate query [T, H*D] / [T, H, D] and key [T, Hkv*D] / [T, Hkv, D] in place.

    Views into a fused qkv buffer work (only the last dim must be contiguous). Positions are
    not bounds-checked on the device. Returns (query, key).
    """
    require_triton("rotary_embedding")
    head_dim = _check(positions, query, key, cos_sin_cache)
    num_q, sqt, sqh = _heads_view(query, head_dim, "query")
    if key is not None:
        num_k, skt, skh = _heads_view(key, head_dim, "key")
    else:
        num_k, skt, skh = 1, 0, 0
    if query.shape[0] == 0:
        return query, key
    if cos_sin_cache.stride(1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    half = head_dim // 2
    elems = (num_q + num_k) * head_dim
    _rotary_kernel[(query.shape[0],)](
        positions.contiguous(),
        query,
        key if key is not None else query,
        cos_sin_cache,
        sqt,
        sqh,
        skt,
        skh,
        cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q,
        NUM_K_HEADS=num_k,
        QH_PAD=next_pow2(num_q),
        KH_PAD=next_pow2(num_k),
        HALF=half,
        HALF_PAD=next_pow2(half),
        HAS_K=key is not None,
        num_warps=4 if elems >= 2048 else 1,
    )
    return query, key


def rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain torch reference with the same in-place contract (float32 math, float64 for float64)."""
    head_dim = _check(positions, query, key, cos_sin_cache)
    half = head_dim // 2
    cdt = torch.float64 if query.dtype == torch.float64 else torch.float32
    cs = cos_sin_cache[positions].to(cdt)  # [T, rot_dim]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    for x in (query, key):
        if x is None:
            continue
        xv = x.view(x.shape[0], -1, head_dim)
        xf = xv.to(cdt)
        x1, x2 = xf[..., :half], xf[..., half:]
        xv.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))
    return query, key


def build_cos_sin_cache(
    max_position: int,
    rot_dim: int,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Unscaled RoPE table [max_position, rot_dim]: cos of each frequency, then sin.

    Models with rope scaling (e.g. Llama 3.1) must build their own inverse frequencies.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64, device=device) / rot_dim))
    t = torch.arange(max_position, dtype=torch.float64, device=device)
    freqs = torch.outer(t, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)
