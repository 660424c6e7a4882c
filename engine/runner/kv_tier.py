"""The host KV tier's memory and copies (`--kv-offloading-size`): a second pool of blocks in host memory, and the
step's copies between it and the device cache, run in the order the scheduler queued them.

Invariants:
- The host pool has the device cache's geometry and dtype (engine/runner/kv_cache.py), pinned when the cache is
  on a GPU; on a CPU engine it is a second, separate allocation, so CI runs the same copies.
- A step's copies run before its forward and in queue order: a copy out of a device block always reads it before
  anything of this step overwrites it, and a copy back always follows the copy that filled its host slot.
- On CUDA they run on a stream of their own: it waits for the work queued so far (the blocks' last writes), and the
  compute stream waits for it (an event) before the forward, so the host keeps preparing the step meanwhile.
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


def _spans(copies: list[Copy]) -> list[tuple[bool, int, int, int]]:
    """Consecutive copies of one direction whose source and destination ids both step by one, as (to_host,
    first source, first destination, count): one slice copy each. Order is kept: spans only join neighbours."""
    spans: list[tuple[bool, int, int, int]] = []
    for to_host, src, dst in copies:
        if spans:
            last_to_host, last_src, last_dst, n = spans[-1]
            if last_to_host == to_host and src == last_src + n and dst == last_dst + n:
                spans[-1] = (to_host, last_src, last_dst, n + 1)
                continue
        spans.append((to_host, src, dst, 1))
    return spans


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # CPU float8 has no index_copy_


class KVTierCopier:
    """Owns the host pool and runs each step's copies."""

    def __init__(self, host_caches: list[KVCache], device: torch.device) -> None:
        self.host_caches = host_caches
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.copy_seconds_per_block = 0.0  # 0: not measured yet
        self._timing: tuple[torch.cuda.Event, torch.cuda.Event, int] | None = None

    def run(self, copies: list[Copy], device_caches: list[KVCache]) -> None:
        self._read_timing()
        if not copies:
            return
        if self.stream is None:
            started = time.perf_counter()
            for run in _runs(copies):
                self._copy_run_cpu(run, device_caches)
            self._observe((time.perf_counter() - started) / len(copies))
            return
        compute = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(compute)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record()
            for span in _spans(copies):
                self._copy_span_cuda(span, device_caches)
            end.record()
        compute.wait_event(end)
        if self._timing is None:
            self._timing = (start, end, len(copies))

    def wait(self) -> None:
        """Block until every queued copy is done (other streams, a KV transport's, are not ordered after them)."""
        if self.stream is not None:
            self.stream.synchronize()

    def _copy_run_cpu(self, run: list[Copy], device_caches: list[KVCache]) -> None:
        to_host = run[0][0]
        src = torch.as_tensor([c[1] for c in run], dtype=torch.int64)
        dst = torch.as_tensor([c[2] for c in run], dtype=torch.int64)
        for dev_kv, host_kv in zip(device_caches, self.host_caches, strict=True):
            for dev, host in zip(dev_kv, host_kv, strict=True):
                source, target = (dev, host) if to_host else (host, dev)
                _as_bytes(target).index_copy_(0, dst, _as_bytes(source).index_select(0, src))

    def _copy_span_cuda(self, span: tuple[bool, int, int, int], device_caches: list[KVCache]) -> None:
        """A span of blocks, every layer, K and V: asynchronous copies between pinned host and device memory (no
        host-side gather, which would read host slots that earlier copies may still be writing)."""
        to_host, src, dst, n = span
        for dev_kv, host_kv in zip(device_caches, self.host_caches, strict=True):
            for dev, host in zip(dev_kv, host_kv, strict=True):
                if to_host:
                    host[dst : dst + n].copy_(dev[src : src + n], non_blocking=True)
                else:
                    dev[dst : dst + n].copy_(host[src : src + n], non_blocking=True)

    def _read_timing(self) -> None:
        if self._timing is None or not self._timing[1].query():
            return
        start, end, count = self._timing
        self._timing = None
        self._observe(start.elapsed_time(end) / 1000 / count)

    def _observe(self, seconds: float) -> None:
        previous = self.copy_seconds_per_block
        self.copy_seconds_per_block = seconds if not previous else 0.8 * previous + 0.2 * seconds
