"""Timers. GPU work is timed with CUDA events around the work itself (optionally replayed from a CUDA graph, as the
engine runs its decode steps), host work with the wall clock; every timer warms up before it measures and returns
seconds per call.

Invariants: a timer calls `fn` exactly `warmup + reps` times (times `calls` inside a graph), and no timer keeps
state between calls."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch


def cuda_event_seconds(fn: Callable[[], Any], reps: int, warmup: int = 2) -> float:
    """Median seconds of fn over `reps` calls, each between two CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def cuda_event_mean_seconds(fn: Callable[[], Any], reps: int, warmup: int) -> float:
    """Mean seconds of fn over `reps` back-to-back calls between one pair of CUDA events (no gap between calls)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def capture_graph(fn: Callable[[], Any], calls: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` back-to-back calls of fn, after one eager call on a side stream (compilation and lazy
    allocations happen outside the capture, as torch's graph docs ask)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def graph_seconds(fn: Callable[[], Any], reps: int = 20, calls: int = 1, warmup: int = 1) -> float:
    """Seconds per call of fn, replayed from a CUDA graph of `calls` calls: GPU time without launch cost."""
    return cuda_event_seconds(capture_graph(fn, calls).replay, reps, warmup) / calls


def wall_seconds(fn: Callable[[], Any], iters: int, cuda: bool) -> float:
    """Median (the upper one for an even count) wall-clock seconds of fn after one warm-up call; `cuda`:
    synchronized around each call."""
    fn()
    samples = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median_high(samples)


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1) by nearest rank: an observed value, never an interpolation."""
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]
