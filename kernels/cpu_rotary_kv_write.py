"""Rotary embedding + KV-cache write for the CPU fp32 path, compiled once from kernels/cpu/rotary_kv_write.cpp
(like the CPU decode-attention kernel). Bit-identical to the torch ops it replaces (`RotaryEmbedding.rotate`,
then `index_copy_` of k and v into the cache): tests/kernels/test_cpu_kernel.py checks it with `torch.equal`."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from kernels.cpu_decode_attention import load_exact_extension

SOURCE = Path(__file__).parent / "cpu" / "rotary_kv_write.cpp"


@functools.cache
def load_rotary_extension() -> Any | None:
    """The compiled module, or None (logged once) when it cannot be built here: the torch path runs then."""
    return load_exact_extension("kvflow_cpu_rotary_kv_write", SOURCE, "rotary + KV-write")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print("built" if load_rotary_extension() is not None else "not built")
