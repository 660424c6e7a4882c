"""Causal prefill attention over the paged KV cache for the CPU fp32 path, compiled once from
kernels/cpu/prefill_attention.cpp (like the CPU decode-attention and rotary kernels, through the same loader).

Each task takes one kv head's whole query group for a block of queries, so K/V are read once per group rather than
once per query head, and reads the cache blocks in place (no padded gather). Fresh prompts and prompts that
continue a cached prefix (chunked prefill, prefix-cache hits) both go through it. It is not bit-identical to torch's
SDPA (another summation order; ~1e-7 relative, tests/kernels/test_cpu_prefill_attention.py), but it is built with the same
flags as the bit-exact kernels: no -ffast-math, no FMA contraction.

`KVFLOW_CPU_PREFILL_ATTENTION=0` keeps prefill attention on torch's SDPA path (for A/B runs); so does
`KVFLOW_DISABLE_CPU_KERNELS=1`, which turns off every compiled CPU kernel.
"""

from __future__ import annotations

import os
from typing import Any

from kernels.cpu_build import PREFILL_ATTENTION, kernel_loader, print_build_outcome

SWITCH_ENV = "KVFLOW_CPU_PREFILL_ATTENTION"
# The compiled module, or None (logged once) when it cannot be built here: the torch path runs then.
load_prefill_extension = kernel_loader(PREFILL_ATTENTION)


def prefill_attention_kernel() -> Any | None:
    """The module the engine should use: None when switched off by KVFLOW_CPU_PREFILL_ATTENTION=0 (read at each
    call, so one process can build backends both ways) or when it cannot be built."""
    switch = os.environ.get(SWITCH_ENV, "1")
    if switch not in ("0", "1"):
        raise ValueError(f"{SWITCH_ENV} must be 0 (torch's SDPA path) or 1 (the compiled kernel), not {switch!r}")
    return load_prefill_extension() if switch == "1" else None


if __name__ == "__main__":
    print_build_outcome(load_prefill_extension)
