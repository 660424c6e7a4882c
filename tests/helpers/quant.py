"""Random 4-bit group-quantized weights for the int4 kernels' tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.quant.group_quant import KINDS, QuantWeight, fp16_bits, pack_int4
from engine.quant.kn_layout import to_kn


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


def run_kn(kernel: Callable[..., torch.Tensor], w: QuantWeight, x: torch.Tensor, **kw: object) -> torch.Tensor:
    """An int4 kernel of the kn layout's signature on w (repacked) and x."""
    kn = to_kn(w)
    return kernel(x, kn.qweight, kn.scales, kn.offsets, KINDS.index(w.kind), w.group_size, w.out_features, **kw)


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref|| / ||ref|| in fp32 (ref: an fp32 reference)."""
    return float((y.float() - ref).norm() / ref.norm())


def assert_hopper_kn_refusals(kernel: Callable[..., torch.Tensor], bad_tiles: list[object]) -> None:
    """`kernel` (a Hopper-only int4 kernel of the kn layout's signature) raises ValueError naming what it does not
    take: a CPU device, fp32 x, groups of 64, an unknown kind, a short qweight, and each of `bad_tiles`."""
    kn = to_kn(random_int4_weight("zero", 32, 256, 128, torch.Generator().manual_seed(1)))
    cases = [({}, "capability 9"), ({"x": torch.randn(4, 256)}, "bf16 / fp16"), ({"group_size": 64}, "group_size"),
             ({"kind": 5}, "kind"), ({"qweight": kn.qweight[:16]}, "qweight")]
    for bad, match in cases + [({"tiles": tiles}, "tiles") for tiles in bad_tiles]:
        kw = {"x": torch.randn(4, 256, dtype=torch.bfloat16), "qweight": kn.qweight, "scales": kn.scales,
              "offsets": kn.offsets, "kind": 1, "group_size": 128, "out_features": 32} | bad
        with pytest.raises(ValueError, match=match):
            kernel(**kw)


def on_cuda(w: QuantWeight) -> QuantWeight:
    """The same weight with its tensors on the GPU (the Hopper kernels' tests)."""
    return QuantWeight(**{f: (v.cuda() if isinstance(v, torch.Tensor) else v) for f, v in vars(w).items()})
