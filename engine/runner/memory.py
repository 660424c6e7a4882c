"""GPU memory: the start-up check of this worker's share, and the memory profile that sizes the KV cache
(vLLM's rule).

Invariants:
- `gpu_memory_utilization` is this worker's share of the GPU's *total* memory. Other processes on the GPU have
  their own shares (checked at start, `GpuMemory.check_share`) and are never counted against this one.
- KV budget = share - resident weights - memory this process took outside torch's allocator since it started -
  peak activations of the largest step - the decode graphs' pool; never negative.
- The largest steps the scheduler can send (`ProfileShape`) are run on the real model, over fresh dummy sequences
  in a trial cache just large enough for them; the trial cache and every tensor of the steps are freed before
  what is left is measured.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.runner.attention import AttentionBackend, AttentionBatch, KVCache
from engine.runner.cuda_graphs import DecodeModel
from engine.runner.kv_cache import KVCacheSpec
from engine.runner.sampler import Sampler, SamplingRow
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuMemory:
    """The current device's memory as this process sees it: free and total (all processes), torch's reserve."""

    free: int
    total: int
    reserved: int

    @classmethod
    def now(cls) -> GpuMemory:
        free, total = torch.cuda.mem_get_info()
        return cls(free, total, torch.cuda.memory_reserved())

    @property
    def used_by_others(self) -> int:
        """At start (before this process allocated anything): memory other processes and this CUDA context hold."""
        return self.total - self.free - self.reserved

    def check_share(self, utilization: float, device: torch.device) -> None:
        """vLLM's start-up check: this worker's share must be free now, or it fails saying what is in use."""
        share = self.total * utilization
        if self.free < share:
            raise ValueError(
                f"Free memory on {device} at startup ({self.free / 2**30:.2f} of {self.total / 2**30:.2f} GiB) is "
                f"less than this worker's share, gpu_memory_utilization={utilization} ({share / 2**30:.2f} GiB): "
                f"{self.used_by_others / 2**30:.2f} GiB are in use by other processes (e.g. another worker on "
                "this GPU) and this CUDA context. --gpu-memory-utilization is each worker's share of the GPU's "
                "total memory, as in vLLM: lower it so the shares of all processes on the GPU add up to at most "
                "about 0.9, or free the GPU.")


@dataclass(frozen=True)
class ProfileShape:
    """The largest steps the scheduler can send: a `max_num_batched_tokens` prefill (sequences of at most
    `max_model_len`) whose logits and sampler's sort cover `max_num_seqs` rows, and a decode step at the largest
    CUDA-graph batch (0: no graphs)."""

    prefill_lens: tuple[int, ...]
    num_sample_rows: int
    graph_batch: int

    @classmethod
    def largest(cls, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                graph_batch: int) -> ProfileShape:
        tokens = max_num_batched_tokens
        per_seq = min(tokens, max_model_len)
        lens = [per_seq] * (tokens // per_seq) + ([tokens % per_seq] if tokens % per_seq else [])
        return cls(tuple(lens), min(max_num_seqs, tokens), graph_batch)

    def trial_blocks(self, block_size: int) -> int:
        """Blocks of a cache that holds either step's sequences on blocks 1, 2, ... (`fresh_sequences`)."""
        per_seq_blocks = -(-max(self.prefill_lens) // block_size)
        return 1 + max(len(self.prefill_lens) * per_seq_blocks, self.graph_batch)


def fresh_sequences(seq_lens: list[int], block_size: int) -> tuple[AttentionBatch, list[int]]:
    """New sequences of these lengths (one whole prefill each) laid out on blocks 1, 2, ... in order: the
    attention batch and every token's position."""
    tables, slots, positions, next_block = [], [], [], 1
    for n in seq_lens:
        used = -(-n // block_size)
        table = list(range(next_block, next_block + used))
        next_block += used
        tables.append(table)
        positions.extend(range(n))
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(n))
    return AttentionBatch(list(seq_lens), list(seq_lens), tables, slots), positions


class PeakMeter:
    """Peak bytes torch allocates while a step runs, above what was allocated when the meter was made (weights,
    the trial cache)."""

    def __init__(self) -> None:
        torch.cuda.synchronize()
        self.base = torch.cuda.memory_allocated()

    def peak_of(self, step: Callable[..., object], *args: object) -> int:
        torch.cuda.reset_peak_memory_stats()
        step(*args)  # what it returns is dropped before the peak is read
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - self.base


class MemoryProfiler:
    """Runs the profiled steps on one rank's model and turns their peaks into its KV budget."""

    def __init__(self, model: DecodeModel, attn_backend: AttentionBackend, sampler: Sampler,
                 device: torch.device, computes_logits: bool = True) -> None:
        self.model = model
        self.computes_logits = computes_logits  # False: a pipeline stage before the last (no head, no sampler)
        self.attn_backend = attn_backend
        self.sampler = sampler
        self.device = device

    def kv_budget(self, spec: KVCacheSpec, shape: ProfileShape, at_start: GpuMemory, utilization: float) -> int:
        """Bytes left for KV: this worker's share less the weights, the memory taken outside torch since start,
        the largest step's peak activations and the decode graphs' pool."""
        kv_caches = spec.allocate(shape.trial_blocks(spec.block_size), self.device)
        with torch.inference_mode():
            meter = PeakMeter()
            activations = meter.peak_of(self._largest_step, kv_caches, shape, spec.block_size)
            graph_pool = meter.peak_of(self._graph_step, kv_caches, shape.graph_batch, spec.block_size) \
                if shape.graph_batch else 0
        del kv_caches
        return _budget_left(at_start, utilization, activations, graph_pool)

    def _largest_step(self, kv_caches: list[KVCache], shape: ProfileShape, block_size: int) -> None:
        """A max_num_batched_tokens prefill, then the logits and the sampler's sort for max_num_seqs rows."""
        hidden = self._forward(kv_caches, list(shape.prefill_lens), block_size)
        if not self.computes_logits:
            return
        num_rows = shape.num_sample_rows
        logits = self.model.compute_logits(hidden[torch.arange(num_rows, device=self.device) % len(hidden)])
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.1)
        self.sampler.sample(logits, [SamplingRow(params, [0], [0], None)] * num_rows)

    def _graph_step(self, kv_caches: list[KVCache], batch: int, block_size: int) -> None:
        """About what the decode graphs' pool holds: one eager decode step, logits and argmax at that batch."""
        self.model.compute_logits(self._forward(kv_caches, [1] * batch, block_size)).argmax(dim=-1)

    def _forward(self, kv_caches: list[KVCache], seq_lens: list[int], block_size: int) -> torch.Tensor:
        batch, positions = fresh_sequences(seq_lens, block_size)
        meta = self.attn_backend.build_metadata(batch, self.device)
        ids = torch.zeros(len(positions), dtype=torch.int64, device=self.device)
        return self.model(ids, torch.as_tensor(positions, device=self.device), kv_caches, meta)


def _budget_left(at_start: GpuMemory, utilization: float, activations: int, graph_pool: int) -> int:
    torch.cuda.empty_cache()
    now = GpuMemory.now()
    weights = torch.cuda.memory_allocated()  # resident weights (+ the offload staging buffers), nothing offloaded
    # Device memory this process took outside torch's allocator since it started (may include another
    # process's growth if one starts beside it at the same moment: the launcher starts those one by one).
    non_torch = max(0, (at_start.free - now.free) - (now.reserved - at_start.reserved))
    share = now.total * utilization
    budget = share - weights - non_torch - activations - graph_pool
    logger.info("memory profile: share %.2f GiB (%.2f x %.2f GiB), weights %.2f GiB, non-torch %.2f GiB, peak "
                "activations %.2f GiB, decode graph pool %.2f GiB -> KV budget %.2f GiB (other processes use "
                "%.2f GiB of the GPU)", share / 2**30, utilization, now.total / 2**30,
                weights / 2**30, non_torch / 2**30, activations / 2**30, graph_pool / 2**30, budget / 2**30,
                at_start.used_by_others / 2**30)
    return int(max(budget, 0))
