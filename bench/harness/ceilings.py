"""The device ceilings a benchmark sets its figures against: copy bandwidth, matmul peak. Each takes the
timer of the scenario that asks (CUDA events, a graph replay), so a ceiling is measured the way
the figures beside it are.

Invariants: bandwidths count the bytes the operation must move (a copy reads and writes each byte: 2x its size),
and buffers are dropped on return (the caller empties torch's cache when it wants the memory back)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Timer = Callable[[Callable[[], Any]], float]  # fn -> seconds per call


def copy_bytes_per_s(src: torch.Tensor, timer: Timer) -> float:
    """Device-to-device copy of `src` into a twin: bytes read + written per second."""
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / timer(lambda: dst.copy_(src))


def matmul_flops_per_s(n: int, timer: Timer, dtype: torch.dtype = torch.bfloat16) -> float:
    """A dense n x n x n matmul: 2 n^3 FLOPs per call."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    return 2 * n**3 / timer(lambda: a @ b)

