"""Paged attention on the GPU through the Triton kernels in kernels/ (the CUDA path's `AttentionBackend`).

One step's batch is split at the first sequence with more than one query token: the leading run of q_len == 1
rows (decode) goes to the split-KV decode kernel, which reads each K/V tile once per GQA group; everything after
it goes to the varlen prefill kernel, which is correct for any q_len (so a batch not ordered decode-first is
still right, only slower; the runner orders chunks decode-first). New K/V are scattered into the cache first.

Metadata is built once per step on the host and sent in two copies (int64 slots, and every int32 table in one
buffer); layers only slice it. The decode CUDA graphs build the same metadata over their static buffers.

Every slice of the int32 buffer starts on 16 bytes and block tables are padded to a multiple of 16 columns:
Triton specializes a kernel on its pointer arguments' 16-byte alignment and on integer arguments (a table's row
stride) being 1 or a multiple of 16, so a layout that moved with the batch's make-up compiled new kernel variants
in the middle of serving. With it fixed, the start-up warm-up (engine/runner/warmup.py) covers them all.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.quant.kv_fp8 import DEFAULT_KV_SCALES, KVScales
from engine.runner.attention import AttentionBatch, KVCache
from kernels.kv_cache_write import write_kv_cache
from kernels.paged_decode_attention import paged_decode_attention
from kernels.paged_prefill_attention import paged_prefill_attention
from kernels.rotary_kv_write import rotary_and_write_kv

ALIGN_INTS = 4  # int32 slices start on 16 bytes
TABLE_COLUMNS = 16  # block tables are padded to a multiple of this many columns
TICKETS = 1 << 16  # int32 split tickets of the single-pass decode kernel: batch x kv heads up to this
# The single-pass decode kernel (last split combines) measured slower than split + combine kernel on an H200
# (Llama-8B shapes, batch 1: 9.0 vs 5.8 us per layer; Qwen-0.5B: 9.6 vs 5.2 us; bench/GPU_NOTES.md): off.
SINGLE_PASS_DECODE = False


@dataclass(frozen=True)
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [T]; a negative slot skips the write (graph padding rows)
    num_decode_tokens: int  # rows [0, n) have one query each and use the decode kernel
    decode_block_tables: torch.Tensor | None  # int32 [n, W]
    decode_seq_lens: torch.Tensor | None  # int32 [n]; 0 for padding rows (their output is zeros)
    decode_max_seq_len: int  # host bound on decode_seq_lens: picks the split count without a sync
    prefill_block_tables: torch.Tensor | None  # int32 [P, W] for the rows after the decode run
    prefill_cu_seqlens_q: torch.Tensor | None  # int32 [P + 1], starting at 0 (relative to row n)
    prefill_seq_lens: torch.Tensor | None  # int32 [P]
    prefill_max_q_len: int


def num_leading_decodes(query_lens: list[int]) -> int:
    n = 0
    for q_len in query_lens:
        if q_len != 1:
            break
        n += 1
    return n


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type == "cuda":  # pinned + async: no stream sync, the host goes on queueing the forward
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _fill_tables(out: np.ndarray, tables: list[list[int]], seq_lens: list[int], block_size: int) -> None:
    for row, (table, seq_len) in enumerate(zip(tables, seq_lens, strict=True)):
        used = -(-seq_len // block_size)  # the blocks holding the context; a table may hold more
        out[row, :used] = table[:used]


class TritonPagedAttention:
    """KV write (with rotary: `forward_rotary`) + decode kernel for the leading q_len == 1 rows + prefill kernel
    for the rest."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # Allocated once and never replaced: captured decode graphs keep its address.
        self._tickets: torch.Tensor | None = None

    def _tickets_for(self, device: torch.device, needed: int) -> torch.Tensor | None:
        if self._tickets is None or self._tickets.device != device:
            self._tickets = torch.zeros(TICKETS, dtype=torch.int32, device=device)
        return self._tickets if needed <= TICKETS else None  # None: the kernel zeroes its own

    def build_metadata(self, batch: AttentionBatch, device: torch.device) -> TritonAttentionMetadata:
        bs = self.block_size
        nd = num_leading_decodes(batch.query_lens)
        num_seqs = len(batch.query_lens)
        num_prefill = num_seqs - nd
        width = _round_up(max(-(-s // bs) for s in batch.seq_lens), TABLE_COLUMNS)
        # One int32 buffer, each slice 16-byte aligned: decode seq_lens | prefill cu_seqlens | prefill seq_lens |
        # all block tables.
        cu_at = _round_up(nd, ALIGN_INTS)
        lens_at = _round_up(cu_at + num_prefill + 1, ALIGN_INTS) if num_prefill else cu_at
        head = _round_up(lens_at + num_prefill, ALIGN_INTS)
        buf = np.zeros(head + num_seqs * width, dtype=np.int32)
        buf[:nd] = batch.seq_lens[:nd]
        if num_prefill:
            cu = buf[cu_at : cu_at + num_prefill + 1]
            np.cumsum(batch.query_lens[nd:], out=cu[1:])
            buf[lens_at : lens_at + num_prefill] = batch.seq_lens[nd:]
        tables = buf[head:].reshape(num_seqs, width)
        _fill_tables(tables, batch.block_tables, batch.seq_lens, bs)
        ints = _to_device(buf, device)
        slots = _to_device(np.asarray(batch.slot_mapping, dtype=np.int64), device)
        dev_tables = ints[head:].view(num_seqs, width)
        return TritonAttentionMetadata(
            slot_mapping=slots,
            num_decode_tokens=nd,
            decode_block_tables=dev_tables[:nd] if nd else None,
            decode_seq_lens=ints[:nd] if nd else None,
            decode_max_seq_len=max(batch.seq_lens[:nd], default=0),
            prefill_block_tables=dev_tables[nd:] if num_prefill else None,
            prefill_cu_seqlens_q=ints[cu_at : cu_at + num_prefill + 1] if num_prefill else None,
            prefill_seq_lens=ints[lens_at : lens_at + num_prefill] if num_prefill else None,
            prefill_max_q_len=max(batch.query_lens[nd:], default=0),
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                meta: TritonAttentionMetadata, scale: float, kv_scales: KVScales = DEFAULT_KV_SCALES) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        write_kv_cache(k, v, key_cache, value_cache, meta.slot_mapping, *kv_scales)
        return self._attend(q, kv_cache, meta, scale, kv_scales)

    def forward_rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       kv_cache: KVCache, meta: TritonAttentionMetadata, scale: float,
                       cos_sin_cache: torch.Tensor, kv_scales: KVScales = DEFAULT_KV_SCALES) -> torch.Tensor:
        """`forward` with the rotary embedding folded into the KV write: one kernel rotates q and k in place
        and stores k/v, saving a launch per layer."""
        key_cache, value_cache = kv_cache
        rotary_and_write_kv(positions, q, k, v, cos_sin_cache, key_cache, value_cache, meta.slot_mapping,
                            *kv_scales)
        return self._attend(q, kv_cache, meta, scale, kv_scales)

    def _attend(self, q: torch.Tensor, kv_cache: KVCache, meta: TritonAttentionMetadata,
                scale: float, kv_scales: KVScales) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decode_tokens
        if meta.decode_block_tables is not None and meta.decode_seq_lens is not None:
            tickets = self._tickets_for(q.device, nd * key_cache.shape[2]) if SINGLE_PASS_DECODE else None
            paged_decode_attention(q[:nd], key_cache, value_cache, meta.decode_block_tables, meta.decode_seq_lens,
                                   scale, out=out[:nd], max_seq_len=meta.decode_max_seq_len, tickets=tickets,
                                   single_pass=SINGLE_PASS_DECODE, k_scale=kv_scales[0], v_scale=kv_scales[1])
        tables, cu_seqlens, seq_lens = meta.prefill_block_tables, meta.prefill_cu_seqlens_q, meta.prefill_seq_lens
        if tables is not None and cu_seqlens is not None and seq_lens is not None:
            paged_prefill_attention(q[nd:], key_cache, value_cache, tables, cu_seqlens, seq_lens, scale,
                                    out=out[nd:], max_q_len=meta.prefill_max_q_len, k_scale=kv_scales[0],
                                    v_scale=kv_scales[1])
        return out
