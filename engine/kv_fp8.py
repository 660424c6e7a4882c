"""fp8 (e4m3) KV cache (`--kv-cache-dtype fp8`, alias `fp8_e4m3`): what is stored and how it is scaled.

Each K and V value is stored as e4m3(value / scale) and read back as stored x scale (kernels/fp8_kv.py). The scales
are per tensor, one for K and one for V, shared by every layer: 1.0, as vLLM uses when a checkpoint carries no
calibrated scales. Why 1.0 is enough here: e4m3 covers +-448 with 3 mantissa bits at every magnitude from 2**-6
up, so what matters is that no value saturates; SmolLM2's K/V on the bench text peak far below 448
(bench/quant_cpu.py records the per-layer absolute maxima). A model whose K exceeds 448 needs a smaller scale.

Blocks hold the same token ids either way, so prefix-cache hashes (engine/block_hash.py) do not change; P/D
transfer carries the e4m3 bytes as they are (the layout header says `float8_e4m3fn`; a worker whose KV dtype
differs is refused as a layout mismatch).
"""

from __future__ import annotations

DEFAULT_KV_SCALES: tuple[float, float] = (1.0, 1.0)  # (k_scale, v_scale)
