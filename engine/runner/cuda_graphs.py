"""CUDA graphs for decode steps: capture the model forward, the lm_head and the greedy argmax once per batch size,
then replay them.

A decode step of a small model is dominated by kernel launch cost (hundreds of launches of a few microseconds
each); a replayed graph launches them all at once. As in vLLM: batch sizes 1, 2, 4, then every multiple of 8 up
to max_num_seqs (capped at 512), or `--cudagraph-capture-sizes`; a batch is padded up to the next captured size
(padding rows write no KV, read no context and are dropped); contexts longer than `--max-seq-len-to-capture` run
eager, since a graph's block tables and decode split count are fixed for that bound. All graphs share one memory
pool, captured largest first so the smaller ones reuse its blocks.

A replay leaves the float32 logits and their argmax in static buffers: an all-greedy batch needs no other kernel
(its tokens are the sampler's, which takes the same argmax), any other batch samples from the logits. Sampled ids
go to the host through a pinned buffer and an event (`tokens_to_host` / `host_tokens`), so the host can queue the
next replay (`run_ahead`, fed the argmax on the device) before it waits for this step's ids.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.runner.attention import KVCache
from engine.runner.attention_triton import TritonAttentionMetadata

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512


class DecodeModel(Protocol):
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                 meta: object) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor: ...

    def compute_logits_argmax(self, hidden: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class CapturedDecode:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # float32 [size, vocab]: a prefix of the buffer every graph writes (one replay at a time)
    tokens: torch.Tensor  # int64 [size]: argmax of logits


@dataclass(frozen=True)
class DecodeResult:
    logits: torch.Tensor  # [n, vocab] view of the graph's static buffer (valid until the next replay)
    tokens: torch.Tensor  # [n] greedy ids, same lifetime


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's schedule: 1, 2, 4, 8, 16, ... (steps of 8) up to min(max_num_seqs, 512); the cap itself is kept."""
    cap = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4) if s <= cap] + list(range(8, cap + 1, 8))
    if sizes[-1] != cap:
        sizes.append(cap)
    return sizes


def capture_sizes(max_num_seqs: int, override: tuple[int, ...] | None, enforce_eager: bool) -> list[int]:
    """Sorted batch sizes to capture; empty when graphs are off. Override sizes above max_num_seqs never occur."""
    if enforce_eager:
        return []
    if override is None:
        return default_capture_sizes(max_num_seqs)
    bad = [s for s in override if s < 1]
    if bad:
        raise ValueError(f"cudagraph_capture_sizes must be positive, got {bad}")
    return sorted({s for s in override if s <= max_num_seqs}) or [min(override)]


def padded_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= num_seqs, or None when the batch is larger than every graph."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    """Captured decode forwards over static input buffers; `run` copies a step's inputs in and replays.

    Inputs travel in two copies from persistent pinned staging buffers. The buffers are laid out per graph size
    s so that what a step needs is a prefix: int64 [ids (s) | positions (s) | slots (s)] and int32 [seq_lens (s) |
    block tables (s x width)], of which only the first n table rows are copied (padding rows have seq_len 0 and
    never read theirs).
    """

    def __init__(self, model: DecodeModel, kv_caches: list[KVCache], sizes: list[int], max_seq_len: int,
                 block_size: int, device: torch.device) -> None:
        self.sizes = sorted(sizes)
        self.max_seq_len = max_seq_len
        self.block_size = block_size
        self.device = device
        max_batch = self.sizes[-1]
        self.width = -(-max_seq_len // block_size)
        self.longs = torch.zeros(3 * max_batch, dtype=torch.int64, device=device)
        self.ints = torch.zeros(max_batch * (1 + self.width), dtype=torch.int32, device=device)
        self.host_longs = torch.zeros(3 * max_batch, dtype=torch.int64).pin_memory()
        self.host_ints = torch.zeros(max_batch * (1 + self.width), dtype=torch.int32).pin_memory()
        self.host_longs_np, self.host_ints_np = self.host_longs.numpy(), self.host_ints.numpy()
        self.copied = torch.cuda.Event()  # the last step's copies have read the staging buffers
        self.host_tokens_buf = torch.zeros(max_batch, dtype=torch.int64).pin_memory()
        self.tokens_ready = torch.cuda.Event()  # host_tokens_buf holds the last `tokens_to_host` ids
        self.graphs: dict[int, CapturedDecode] = {}
        # One logits buffer for all sizes (allocated at the largest): per-graph outputs would stay allocated side
        # by side (35 graphs of Llama-8B's 128k vocab held 2.1 GiB instead of 0.1).
        self.logits_buf: torch.Tensor | None = None
        self.pool = torch.cuda.graph_pool_handle()
        started = time.perf_counter()
        free_before = torch.cuda.mem_get_info(device)[0]
        for size in reversed(self.sizes):
            self._capture(model, kv_caches, size)
        torch.cuda.synchronize(device)
        self.memory_bytes = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info("captured %d decode CUDA graphs (batch sizes %s, contexts up to %d) in %.1fs, %.2f GiB",
                    len(self.sizes), self.sizes, max_seq_len, time.perf_counter() - started,
                    self.memory_bytes / 2**30)

    def _capture(self, model: DecodeModel, kv_caches: list[KVCache], size: int) -> None:
        # Padding everywhere while capturing: token 0 at position 0, slot -1 (no KV write), seq_len 0 (no read).
        self.longs[: 3 * size].zero_()
        self.longs[2 * size : 3 * size].fill_(-1)
        self.ints[:size].zero_()
        meta = TritonAttentionMetadata(
            slot_mapping=self.longs[2 * size : 3 * size], num_decode_tokens=size,
            decode_block_tables=self.ints[size : size * (1 + self.width)].view(size, self.width),
            decode_seq_lens=self.ints[:size], decode_max_seq_len=self.max_seq_len,
            prefill_block_tables=None, prefill_cu_seqlens_q=None, prefill_seq_lens=None, prefill_max_q_len=0,
        )
        args = (self.longs[:size], self.longs[size : 2 * size], kv_caches, meta)
        hidden = model(*args)  # warm-up outside: Triton compiles, cuBLAS picks its kernels
        if self.logits_buf is None:  # the largest size is captured first
            self.logits_buf = torch.empty_like(model.compute_logits(hidden))
        model.compute_logits_argmax(hidden, out=self.logits_buf[:size])
        del hidden
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits, tokens = model.compute_logits_argmax(model(*args), out=self.logits_buf[:size])
        self.graphs[size] = CapturedDecode(graph, logits, tokens)

    def can_run(self, num_seqs: int, max_seq_len: int) -> bool:
        return num_seqs <= self.sizes[-1] and max_seq_len <= self.max_seq_len

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
            block_tables: list[list[int]]) -> DecodeResult:
        """Logits and greedy ids of one decode token per sequence (views of the graph's static outputs)."""
        size = self._stage(input_ids, positions, slots, seq_lens, block_tables)
        return self._replay(size, len(positions))

    def run_ahead(self, input_ids: torch.Tensor, positions: list[int], slots: list[int], seq_lens: list[int],
                  block_tables: list[list[int]]) -> DecodeResult:
        """`run` with the token ids taken from a device tensor ([n] int64, e.g. the previous replay's argmax):
        nothing waits for that replay to finish, so the host can queue this one while the GPU is busy."""
        size = self._stage(None, positions, slots, seq_lens, block_tables)
        self.longs[: len(positions)].copy_(input_ids, non_blocking=True)  # stream-ordered after the staging copy
        return self._replay(size, len(positions))

    def tokens_to_host(self, tokens: torch.Tensor) -> None:
        """Queue the copy of a step's ids [n] into the pinned host buffer (read back by `host_tokens`)."""
        self.host_tokens_buf[: len(tokens)].copy_(tokens, non_blocking=True)
        self.tokens_ready.record()

    def host_tokens(self, n: int) -> list[int]:
        """Wait for the last `tokens_to_host` copy only (not for replays queued after it)."""
        self.tokens_ready.synchronize()
        return self.host_tokens_buf[:n].tolist()

    def _replay(self, size: int, n: int) -> DecodeResult:
        captured = self.graphs[size]
        captured.graph.replay()
        return DecodeResult(captured.logits[:n], captured.tokens[:n])

    def _stage(self, input_ids: list[int] | None, positions: list[int], slots: list[int], seq_lens: list[int],
               block_tables: list[list[int]]) -> int:
        """Fill the pinned staging buffers and queue their two copies; the padded graph size."""
        n = len(positions)
        size = padded_size(n, self.sizes)
        if size is None or max(seq_lens) > self.max_seq_len:
            raise ValueError(f"batch of {n} at context {max(seq_lens)} exceeds the captured graphs")
        self.copied.synchronize()
        longs, ints = self.host_longs_np, self.host_ints_np
        longs[: 3 * size] = 0
        if input_ids is not None:
            longs[:n] = input_ids
        longs[size : size + n], longs[2 * size : 2 * size + n] = positions, slots
        longs[2 * size + n : 3 * size] = -1
        ints[:n] = seq_lens
        ints[n:size] = 0
        tables = ints[size : size * (1 + self.width)].reshape(size, self.width)
        bs = self.block_size
        for row, (table, seq_len) in enumerate(zip(block_tables, seq_lens, strict=True)):
            used = -(-seq_len // bs)
            tables[row, :used] = table[:used]
        self.longs[: 3 * size].copy_(self.host_longs[: 3 * size], non_blocking=True)
        num_ints = size + n * self.width
        self.ints[:num_ints].copy_(self.host_ints[:num_ints], non_blocking=True)
        self.copied.record()
        return size
