"""Rotary embedding + KV-cache write for the CPU fp32 path, compiled once from kernels/cpu/rotary_kv_write.cpp
(like the CPU decode-attention kernel). Bit-identical to the torch ops it replaces (`RotaryEmbedding.rotate`,
then `index_copy_` of k and v into the cache): tests/test_cpu_kernel.py checks it with `torch.equal`."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

from kernels.cpu_decode_attention import DISABLE_ENV, _build_dir

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "cpu" / "rotary_kv_write.cpp"


@functools.cache
def load_rotary_extension() -> Any | None:
    """The compiled module, or None (logged once) when it cannot be built here: the torch path runs then."""
    if os.environ.get(DISABLE_ENV) == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        # No -ffast-math and no contraction: every product is rounded before the sum, as torch's ops round it.
        build = _build_dir() / "rotary_kv_write"  # its own directory: one build.ninja per extension
        build.mkdir(exist_ok=True)
        return load(name="kvflow_cpu_rotary_kv_write", sources=[str(SOURCE)], build_directory=str(build),
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler / headers
        logger.warning("CPU rotary + KV-write kernel unavailable (%s); using the torch path", exc)
        return None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print("built" if load_rotary_extension() is not None else "not built")
