"""The GPU's 4-bit weight layout ("kn"): the canonical int4 weight of engine/quant/group_quant.py transposed so
that the output dim is contiguous, which is what a fast Triton GEMV needs.

- `qweight` int32 [K/8, N]: word [r, n] holds the codes of elements 8 r .. 8 r + 7 of output row n, element
  8 r + j at bits 4 j.
- `scales` (and `mins`) int16 float16-bits [K/G, N]; `zeros` uint8 [K/G, N]. Same values as the canonical form.

Why: in the canonical [N, K/2] layout each GPU thread walks along K of one row, so the activation x is loaded once
per code and never reused in a thread, and the per-group scales land in another register layout than the
accumulator. With N contiguous each thread owns whole columns, x is a warp-wide broadcast, and scales load where
they are used. H100, Llama-8B decode step at batch 1: 2.57 ms against 3.73 for the canonical GEMV and 5.18 for
bf16 (bench/results/int4_gemv_layout_h100.json).

Conversions are exact both ways (a repacking, no arithmetic). CUDA 4-bit QuantLinears hold this layout instead of
the canonical one (not both); `from_kn` rebuilds the canonical weight for the torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.quant.group_quant import SUB_BLOCK, Kind, QuantWeight, pack_int4, unpack_int4

CODES_PER_WORD = 8


def kn_codes(qweight_kn: torch.Tensor) -> torch.Tensor:
    """int32 [K/8, N] -> uint8 codes [N, K]."""
    rows, n = qweight_kn.shape
    shifts = torch.arange(0, 4 * CODES_PER_WORD, 4, dtype=torch.int32, device=qweight_kn.device)
    codes = (qweight_kn[:, :, None] >> shifts) & 0xF  # [K/8, N, 8]
    return codes.permute(1, 0, 2).reshape(n, rows * CODES_PER_WORD).to(torch.uint8)


def pack_kn(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] in 0..15 -> int32 [K/8, N]."""
    n, k = codes.shape
    if k % CODES_PER_WORD:
        raise ValueError(f"int4 rows need a multiple of {CODES_PER_WORD} elements, got {k}")
    shifts = torch.arange(0, 4 * CODES_PER_WORD, 4, dtype=torch.int32, device=codes.device)
    words = (codes.to(torch.int32).view(n, k // CODES_PER_WORD, CODES_PER_WORD) << shifts).sum(dim=2,
                                                                                             dtype=torch.int32)
    return words.t().contiguous()


@dataclass(frozen=True)
class KNWeight:
    """One 4-bit matrix [N, K] in the kn layout (tensors on one device)."""

    kind: Kind
    group_size: int
    out_features: int
    in_features: int
    qweight: torch.Tensor  # int32 [K/8, N]
    scales: torch.Tensor  # int16 (float16 bits) [K/G, N]
    mins: torch.Tensor | None = None  # int16 (float16 bits) [K/G, N], kind "min"
    zeros: torch.Tensor | None = None  # uint8 [K/G, N], kind "zero"

    def __post_init__(self) -> None:
        n, k, g = self.out_features, self.in_features, self.group_size
        if g % SUB_BLOCK or k % g:
            raise ValueError(f"group_size {g} must be a multiple of {SUB_BLOCK} dividing in_features {k}")
        if self.qweight.dtype != torch.int32 or tuple(self.qweight.shape) != (k // CODES_PER_WORD, n):
            raise ValueError(f"kn qweight must be int32 [{k // CODES_PER_WORD}, {n}], got {self.qweight.dtype} "
                             f"{tuple(self.qweight.shape)}")
        if tuple(self.scales.shape) != (k // g, n):
            raise ValueError(f"kn scales must be [{k // g}, {n}], got {tuple(self.scales.shape)}")
        if (self.kind == "min") != (self.mins is not None) or (self.kind == "zero") != (self.zeros is not None):
            raise ValueError(f"kind {self.kind!r} needs {'mins' if self.kind == 'min' else 'zeros'}")

    @property
    def offsets(self) -> torch.Tensor:
        return kernel_offsets(self.scales, self.mins, self.zeros)


def kernel_offsets(scales: torch.Tensor, mins: torch.Tensor | None, zeros: torch.Tensor | None) -> torch.Tensor:
    """The kernels' offsets argument: the per-group mins or zeros (the scales again for the symmetric kind, where
    nothing reads them)."""
    return mins if mins is not None else (zeros if zeros is not None else scales)


def to_kn(w: QuantWeight) -> KNWeight:
    """The canonical 4-bit weight -> the kn layout."""
    if w.bits != 4:
        raise ValueError(f"the kn layout is for 4-bit weights, got {w.bits}-bit")
    t = lambda x: None if x is None else x.t().contiguous()  # noqa: E731
    return KNWeight(w.kind, w.group_size, w.out_features, w.in_features, pack_kn(unpack_int4(w.qweight)),
                    w.scales.t().contiguous(), t(w.mins), t(w.zeros))


def from_kn(kn: KNWeight) -> QuantWeight:
    """The inverse of `to_kn`."""
    t = lambda x: None if x is None else x.t().contiguous()  # noqa: E731
    return QuantWeight(4, kn.kind, kn.group_size, kn.out_features, kn.in_features, pack_int4(kn_codes(kn.qweight)),
                       kn.scales.t().contiguous(), t(kn.mins), t(kn.zeros))
