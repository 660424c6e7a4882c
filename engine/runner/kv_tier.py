"""The host KV tier's memory and copies (`--kv-offloading-size`): a second pool of blocks in host memory, and the
step's copies between it and the device cache, run in the order the scheduler queued them.

Invariants:
- The host pool is one slot-major tensor [slots, 2 x layers, block elements] (a slot holds one block: every
  layer's K then V, in the device cache's geometry and dtype, engine/runner/kv_cache.py), so a block moves as one
  contiguous transfer. Pinned when the cache is on a GPU; on a CPU engine a second, separate allocation, so CI
  runs the same bookkeeping. `host_caches` gives per-layer (K, V) views of it.
- A step's copies run before its forward and in queue order: a copy out of a device block always reads it before
  anything of this step overwrites it, and a copy back always follows the copy that filled its host slot.
- On CUDA they run on a stream of their own: it waits for the work queued so far (the blocks' last writes), and the
  compute stream waits for it (an event) before the forward, so the host keeps preparing the step meanwhile. Blocks
  pass through a device staging buffer of up to STAGE_BYTES: out, a gather kernel per layer and K/V into it, then
  one transfer per run of consecutive host slots; back, the transfers into it, then a scatter per layer and K/V.
  (One copy per block, layer and K/V was 64 calls per Llama-8B block: ~60 ms of host issue time on an admission
  step that reloads ~90 blocks, against ~4 ms of PCIe, measured slower than recomputing on two H200s.)
- The measured copy time per block (CUDA events, read once they completed; the wall clock on CPU) is what the
  router weighs a host hit with.
"""

from __future__ import annotations

import time

import torch

from engine.outputs import TierCopy as Copy
from engine.runner.attention import KVCache


def _runs(copies: list[Copy]) -> list[list[Copy]]:
    """Consecutive copies of one direction with distinct destinations: each run may be one batched copy."""
    runs: list[list[Copy]] = []
    seen: set[int] = set()
    for copy in copies:
        if not runs or runs[-1][0][0] != copy[0] or copy[2] in seen:
            runs.append([])
            seen = set()
        runs[-1].append(copy)
        seen.add(copy[2])
    return runs


def _slot_spans(slots: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive host slots, in order, as (first slot, count, position in the list): one transfer each."""
    spans: list[tuple[int, int, int]] = []
    for position, slot in enumerate(slots):
        if spans and slot == spans[-1][0] + spans[-1][1]:
            first, count, start = spans[-1]
            spans[-1] = (first, count + 1, start)
        else:
            spans.append((slot, 1, position))
    return spans


STAGE_BYTES = 64 << 20  # the CUDA path's staging buffer: 32 Llama-8B blocks of 2 MiB


def stage_blocks_for(block_bytes: int, host_blocks: int) -> int:
    """The CUDA staging buffer's blocks: what STAGE_BYTES holds, at least 1, at most the pool's slots. The KV
    budget leaves room for it (ModelRunner.determine_num_blocks)."""
    return max(1, min(host_blocks, STAGE_BYTES // block_bytes))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # CPU float8 has no index_copy_


def _layers(caches: list[KVCache]) -> list[torch.Tensor]:
    """Every layer's K then V as [blocks, block elements] byte-compatible views, in the pool's slot order."""
    return [_as_bytes(t).view(t.shape[0], -1) for kv in caches for t in kv]


class KVTierCopier:
    """Owns the host pool (and, on CUDA, the staging buffer) and runs each step's copies."""

    def __init__(self, pool: torch.Tensor, block_shape: tuple[int, ...], device: torch.device,
                 stage_blocks: int | None = None) -> None:
        """`pool` [slots, 2 x layers, block elements]; `block_shape` one layer's block (block size, KV heads,
        head dim); `stage_blocks` the staging buffer's blocks (default: what STAGE_BYTES holds, at least 1)."""
        self.pool = pool
        self.block_shape = block_shape
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        blocks = stage_blocks or stage_blocks_for(pool[0].numel() * pool.element_size(), pool.shape[0])
        staged = device.type == "cuda" or stage_blocks is not None  # a CPU engine copies without one
        self.stage = torch.empty((blocks, *pool.shape[1:]), dtype=pool.dtype, device=device) if staged else None
        self.copy_seconds_per_block = 0.0  # 0: not measured yet
        self._timing: tuple[torch.cuda.Event, torch.cuda.Event, int] | None = None

    @property
    def host_caches(self) -> list[KVCache]:
        """Per-layer (K, V) views of the pool, [slots, block size, KV heads, head dim] each."""
        views = [self.pool[:, i].view(self.pool.shape[0], *self.block_shape) for i in range(self.pool.shape[1])]
        return [(views[i], views[i + 1]) for i in range(0, len(views), 2)]

    def run(self, copies: list[Copy], device_caches: list[KVCache]) -> torch.cuda.Event | None:
        """Queue `copies`, ordered after the work queued so far and before what the compute stream queues next;
        on CUDA the event that marks their end (another stream must wait for it before touching those blocks),
        None once they are done (CPU) or when there were none."""
        self._read_timing()
        if not copies:
            return None
        layers = _layers(device_caches)
        if self.stream is None:
            started = time.perf_counter()
            for run in _runs(copies):
                self._copy_run_cpu(run, layers)
            self._observe((time.perf_counter() - started) / len(copies))
            return None
        compute = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(compute)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record()
            for run in _runs(copies):
                self._copy_run_staged(run, layers)
            end.record()
        compute.wait_event(end)
        if self._timing is None:
            self._timing = (start, end, len(copies))
        return end

    def _copy_run_cpu(self, run: list[Copy], layers: list[torch.Tensor]) -> None:
        """One gather and one scatter per layer and K/V for the whole run (host memory on both sides)."""
        to_host = run[0][0]
        src = torch.as_tensor([c[1] for c in run], dtype=torch.int64)
        dst = torch.as_tensor([c[2] for c in run], dtype=torch.int64)
        pool = _as_bytes(self.pool)
        for i, layer in enumerate(layers):
            if to_host:
                pool[:, i].index_copy_(0, dst, layer.index_select(0, src))
            else:
                layer.index_copy_(0, dst, pool[:, i].index_select(0, src))

    def _copy_run_staged(self, run: list[Copy], layers: list[torch.Tensor]) -> None:
        """The CUDA path (any device: the tests run it on CPU tensors), the run in chunks of the staging buffer:
        no host-side gather, which would read host slots that earlier copies may still be writing."""
        if self.stage is None:
            raise RuntimeError("the staged copies need a staging buffer: a CUDA copier, or stage_blocks")
        to_host = run[0][0]
        pool, stage = _as_bytes(self.pool), _as_bytes(self.stage)
        for first in range(0, len(run), stage.shape[0]):
            chunk = run[first : first + stage.shape[0]]
            blocks = torch.tensor([c[1] if to_host else c[2] for c in chunk], dtype=torch.int64,
                                  device=stage.device)
            spans = _slot_spans([c[2] if to_host else c[1] for c in chunk])
            staged = stage[: len(chunk)]
            if to_host:
                torch.stack([layer.index_select(0, blocks) for layer in layers], dim=1, out=staged)
                for slot, count, at in spans:
                    pool[slot : slot + count].copy_(staged[at : at + count], non_blocking=True)
            else:
                for slot, count, at in spans:
                    staged[at : at + count].copy_(pool[slot : slot + count], non_blocking=True)
                for i, layer in enumerate(layers):
                    layer.index_copy_(0, blocks, staged[:, i])

    def _read_timing(self) -> None:
        if self._timing is None or not self._timing[1].query():
            return
        start, end, count = self._timing
        self._timing = None
        self._observe(start.elapsed_time(end) / 1000 / count)

    def _observe(self, seconds: float) -> None:
        previous = self.copy_seconds_per_block
        self.copy_seconds_per_block = seconds if not previous else 0.8 * previous + 0.2 * seconds
