"""Random 4-bit group-quantized weights for the int4 kernels' tests."""

from __future__ import annotations

import torch

from engine.quant.group_quant import QuantWeight, fp16_bits, pack_int4


def random_int4_weight(kind: str, n: int, k: int, group: int, g: torch.Generator,
                       min_scale: float = 0.0) -> QuantWeight:
    """n x k codes uniform in 0..15 with scales in [min_scale, min_scale + 0.1): mins in (-1, 0] ("min"), zero
    points in 0..15 ("zero"), or neither ("sym")."""
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = fp16_bits(torch.rand(n, k // group, generator=g) * 0.1 + min_scale)
    if kind == "min":
        return QuantWeight(4, kind, group, n, k, pack_int4(q), scales,
                           mins=fp16_bits(-torch.rand(n, k // group, generator=g)))
    if kind == "zero":
        return QuantWeight(4, kind, group, n, k, pack_int4(q), scales,
                           zeros=torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.uint8))
    return QuantWeight(4, kind, group, n, k, pack_int4(q), scales)
