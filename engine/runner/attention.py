"""Attention over the paged KV cache: the batch description, and the torch backend that runs on CPU.

KV cache layout, per layer: `key_cache` and `value_cache`, each [num_blocks, block_size, num_kv_heads, head_dim].
Block 0 is never handed out (it pads block tables), so gathered padding is finite and masked away.

The torch backend batches every sequence of a step into at most two padded calls (decode rows with one query
token, and prefill/extend rows with several): no per-sequence Python loop on the hot path. The Triton kernels
of the GPU path implement the same `AttentionBackend` protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.quant.kv_fp8 import DEFAULT_KV_SCALES, KVScales
from kernels.cpu_decode_attention import load_extension
from kernels.cpu_prefill_attention import prefill_attention_kernel
from kernels.cpu_rotary_kv_write import load_rotary_extension
from kernels.fp8_kv import FP8_DTYPE, quantize_fp8

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class AttentionBatch:
    """What attention needs to know about one step's flattened batch (host lists, built by the runner)."""

    query_lens: list[int]  # new tokens per sequence, in batch order
    seq_lens: list[int]  # context length per sequence after this step (cached prefix + new tokens)
    block_tables: list[list[int]]
    slot_mapping: list[int]  # cache slot (block * block_size + offset) of every new token


class AttentionBackend(Protocol):
    def build_metadata(self, batch: AttentionBatch, device: torch.device) -> object: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: object,
                scale: float, kv_scales: KVScales = DEFAULT_KV_SCALES) -> torch.Tensor:
        """q [T,H,D], k/v [T,Hkv,D] of the new tokens -> [T,H,D]; writes k/v into the cache first. `kv_scales`:
        the layer's (k_scale, v_scale) for an fp8 cache (engine/quant/kv_fp8.py); other caches ignore them."""
        ...


@dataclass(frozen=True)
class _Group:
    """A padded group of sequences: rows[b, i] is the flat token row of query i of sequence b."""

    rows: torch.Tensor  # [B, Lq] int64 (padding points at row 0 and is dropped)
    query_starts: torch.Tensor  # [B] int64: flat row of each sequence's first query
    query_lens: torch.Tensor  # [B] int64
    valid: torch.Tensor | None  # [B, Lq] bool; None when no query is padding
    flat_rows: torch.Tensor  # [n_valid] rows in the same order as rows[valid]
    block_tables: torch.Tensor  # [B, max_blocks] int64
    seq_lens: torch.Tensor  # [B] int64
    mask: torch.Tensor  # [B, 1, Lq, L] bool, True where the query may attend
    # Every sequence is a whole new prompt of this one length (no cached prefix, no padding): attention is then
    # plain causal attention over the step's own tokens, without the mask or the padded key length.
    causal_len: int | None = None


@dataclass(frozen=True)
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    decode: _Group | None
    prefill: _Group | None


def _pad_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(len(t) for t in tables)
    out = torch.zeros(len(tables), width, dtype=torch.int64)
    for i, table in enumerate(tables):
        out[i, : len(table)] = torch.as_tensor(table, dtype=torch.int64)
    return out.to(device)


class TorchPagedAttention:
    """Reference paged attention in plain torch (CPU path; also correct on GPU, only slower)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # Decode rows on CPU in fp32 go through a compiled kernel that reads each block once (None: torch only).
        self.cpu_decode_kernel = load_extension()
        # Rotary + KV write in one compiled pass over qkv (CPU fp32; None: the torch ops).
        self.cpu_rotary_kernel = load_rotary_extension()
        # Prefill rows (fresh or continuing a cached prefix) on CPU in fp32: a compiled causal GQA kernel that reads
        # the cache blocks in place. Against the gather + SDPA below (bench/results/cpu_prefill_attention.json):
        # 1.4-2.5x at 8 x 128-512 tokens, 1.1-1.2x continuing a cached prefix, 4.2-4.8x on ragged lengths, 2x on
        # short rows after a long context, level (0.99-1.12x) on one 2,048-token prompt; nowhere beyond the noise
        # slower, so it takes every case. None: torch only (KVFLOW_CPU_PREFILL_ATTENTION=0, or no compiler here).
        self.cpu_prefill_kernel = prefill_attention_kernel()

    def build_metadata(self, batch: AttentionBatch, device: torch.device) -> TorchAttentionMetadata:
        starts = [0]
        for n in batch.query_lens:
            starts.append(starts[-1] + n)
        decode_ids = [i for i, n in enumerate(batch.query_lens) if n == 1]
        prefill_ids = [i for i, n in enumerate(batch.query_lens) if n > 1]
        slot_mapping = torch.as_tensor(batch.slot_mapping, dtype=torch.int64, device=device)
        return TorchAttentionMetadata(
            slot_mapping=slot_mapping,
            decode=self._group(decode_ids, batch, starts, device),
            prefill=self._group(prefill_ids, batch, starts, device),
        )

    def _group(self, ids: list[int], batch: AttentionBatch, starts: list[int],
               device: torch.device) -> _Group | None:
        if not ids:
            return None
        q_lens = torch.as_tensor([batch.query_lens[i] for i in ids], dtype=torch.int64)
        seq_lens = torch.as_tensor([batch.seq_lens[i] for i in ids], dtype=torch.int64)
        q_starts = torch.as_tensor([starts[i] for i in ids], dtype=torch.int64)
        tables = _pad_tables([batch.block_tables[i] for i in ids], device)
        max_q = int(q_lens.max())
        key_len = tables.shape[1] * self.block_size
        offsets = torch.arange(max_q, dtype=torch.int64)
        valid = offsets[None, :] < q_lens[:, None]
        rows = torch.where(valid, q_starts[:, None] + offsets[None, :], 0)
        # Query i of a sequence sits at absolute position seq_len - q_len + i and sees keys 0..that position.
        q_pos = seq_lens[:, None] - q_lens[:, None] + offsets[None, :]
        k_pos = torch.arange(key_len, dtype=torch.int64)
        mask = k_pos[None, None, :] <= q_pos[:, :, None]
        all_valid = bool(valid.all())
        fresh = all_valid and all(batch.seq_lens[i] == batch.query_lens[i] for i in ids)
        return _Group(
            rows=rows.to(device),
            query_starts=q_starts.to(device),
            query_lens=q_lens.to(device),
            valid=None if all_valid else valid.to(device),
            flat_rows=rows[valid].to(device),
            block_tables=tables,
            seq_lens=seq_lens.to(device),
            mask=mask[:, None, :, :].to(device),
            causal_len=max_q if fresh else None,
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                meta: TorchAttentionMetadata, scale: float, kv_scales: KVScales = DEFAULT_KV_SCALES) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        if key_cache.dtype == FP8_DTYPE:  # stored as value / scale in e4m3, written as bytes (no fp8 index_copy_)
            key_cache.view(torch.uint8).view(-1, num_kv_heads, head_dim).index_copy_(
                0, meta.slot_mapping, quantize_fp8(k, kv_scales[0]).view(torch.uint8))
            value_cache.view(torch.uint8).view(-1, num_kv_heads, head_dim).index_copy_(
                0, meta.slot_mapping, quantize_fp8(v, kv_scales[1]).view(torch.uint8))
        else:
            key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
            value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
        return self._attend_cached(q, kv_cache, meta, scale, kv_scales)

    def forward_qkv(self, positions: torch.Tensor, qkv: torch.Tensor, cos_half: torch.Tensor,
                    sin_half: torch.Tensor, num_heads: int, kv_cache: KVCache, meta: TorchAttentionMetadata,
                    scale: float, kv_scales: KVScales = DEFAULT_KV_SCALES) -> torch.Tensor | None:
        """CPU fp32 activations: rotate q and k in place inside `qkv` [T, (H + 2 Hkv) D] and write k and v into
        the cache (fp32, or fp8 as e4m3(value / scale)) in one compiled pass, bit-identical to rotating with torch
        ops, then `forward`; then attend. None when the kernel does not apply here: the caller runs the torch ops."""
        key_cache, value_cache = kv_cache
        if (self.cpu_rotary_kernel is None or key_cache.device.type != "cpu"
                or key_cache.dtype not in (torch.float32, FP8_DTYPE)
                or qkv.dtype != torch.float32 or not qkv.is_contiguous()):
            return None
        num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        if key_cache.dtype == FP8_DTYPE:
            self.cpu_rotary_kernel.rotary_kv_write_fp8(qkv, positions, cos_half, sin_half, key_cache.view(torch.uint8),
                                                       value_cache.view(torch.uint8), meta.slot_mapping, num_heads,
                                                       num_kv_heads, kv_scales[0], kv_scales[1])
        else:
            self.cpu_rotary_kernel.rotary_kv_write(qkv, positions, cos_half, sin_half, key_cache, value_cache,
                                                   meta.slot_mapping, num_heads, num_kv_heads)
        q = qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)
        return self._attend_cached(q, kv_cache, meta, scale, kv_scales)

    def _attend_cached(self, q: torch.Tensor, kv_cache: KVCache, meta: TorchAttentionMetadata,
                       scale: float, kv_scales: KVScales = DEFAULT_KV_SCALES) -> torch.Tensor:
        """Attention of the step's queries over the cache, which already holds this step's keys and values."""
        key_cache, value_cache = kv_cache
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        decode = meta.decode
        if decode is not None and self._kernel_fits(q, key_cache):
            rows = q[decode.flat_rows]
            if key_cache.dtype == FP8_DTYPE:  # read as e4m3 bytes, widened in the kernel: a quarter of the traffic
                out[decode.flat_rows] = self.cpu_decode_kernel.paged_decode_attention_fp8(  # type: ignore[union-attr]
                    rows, key_cache.view(torch.uint8), value_cache.view(torch.uint8), decode.block_tables,
                    decode.seq_lens, scale, kv_scales[0], kv_scales[1])
            else:
                out[decode.flat_rows] = self.cpu_decode_kernel.paged_decode_attention(  # type: ignore[union-attr]
                    rows, key_cache, value_cache, decode.block_tables, decode.seq_lens, scale)
            decode = None
        prefill = meta.prefill
        if prefill is not None and self._prefill_kernel_fits(q, key_cache):
            if q.stride(2) != 1 or q.stride(1) != q.shape[2]:  # the kernel takes rows of contiguous heads
                q = q.contiguous()
            if key_cache.dtype == FP8_DTYPE:
                self.cpu_prefill_kernel.prefill_attention_fp8(  # type: ignore[union-attr]
                    q, key_cache.view(torch.uint8), value_cache.view(torch.uint8), prefill.block_tables,
                    prefill.query_starts, prefill.query_lens, prefill.seq_lens, scale, kv_scales[0], kv_scales[1], out)
            else:
                self.cpu_prefill_kernel.prefill_attention(  # type: ignore[union-attr]
                    q, key_cache, value_cache, prefill.block_tables, prefill.query_starts, prefill.query_lens,
                    prefill.seq_lens, scale, out)
            prefill = None
        for group in (decode, prefill):
            if group is not None:
                self._attend(q, key_cache, value_cache, group, scale, out, *kv_scales)
        return out

    def _kernel_fits(self, q: torch.Tensor, key_cache: torch.Tensor) -> bool:
        return (self.cpu_decode_kernel is not None and key_cache.device.type == "cpu" and q.dtype == torch.float32
                and key_cache.dtype in (torch.float32, FP8_DTYPE))

    def _prefill_kernel_fits(self, q: torch.Tensor, key_cache: torch.Tensor) -> bool:
        return (self.cpu_prefill_kernel is not None and key_cache.device.type == "cpu"
                and key_cache.dtype in (torch.float32, FP8_DTYPE) and q.dtype == torch.float32 and q.shape[2] % 4 == 0)

    @staticmethod
    def _attend(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, group: _Group,
                scale: float, out: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        num_seqs, max_q = group.rows.shape
        _, block_size, num_kv_heads, head_dim = key_cache.shape
        key_len = group.block_tables.shape[1] * block_size
        # Gather each sequence's blocks into a padded [B, Hkv, L, D] view (strided, no second copy).
        keys = key_cache[group.block_tables].view(num_seqs, key_len, num_kv_heads, head_dim).transpose(1, 2)
        values = value_cache[group.block_tables].view(num_seqs, key_len, num_kv_heads, head_dim).transpose(1, 2)
        if key_cache.dtype == FP8_DTYPE:  # dequantize the gathered blocks: stored value x scale
            keys, values = keys.to(q.dtype) * k_scale, values.to(q.dtype) * v_scale
        queries = q[group.rows].transpose(1, 2)  # [B, H, Lq, D]
        if group.causal_len is not None:  # fresh prompts of one length: the causal kernel skips masked blocks
            length = group.causal_len
            attn = F.scaled_dot_product_attention(queries, keys[:, :, :length], values[:, :, :length],
                                                  is_causal=True, scale=scale, enable_gqa=True)
        else:
            attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.mask, scale=scale,
                                                  enable_gqa=True)
        attn = attn.transpose(1, 2)  # [B, Lq, H, D]
        if group.valid is None:
            out[group.flat_rows] = attn.reshape(num_seqs * max_q, *attn.shape[2:])
        else:
            out[group.flat_rows] = attn[group.valid]
