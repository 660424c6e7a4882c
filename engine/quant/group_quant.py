"""Group-wise weight-only quantized linear and embedding layers (int4 with scales + mins or zeros, int8 symmetric).

One canonical in-memory layout serves every source format (GGUF Q4_0 / Q4_1 / Q8_0, AWQ, GPTQ), so a single
torch reference and a single CPU kernel run them all:

- 4-bit: `qweight` uint8 [N, K/2]. The input dim is cut into sub-blocks of 32; sub-block b of row n is the 16
  bytes `qweight[n, 16b : 16b + 16]`, byte j holding element 32b + j in its low nibble and 32b + 16 + j in its
  high nibble (GGUF's own Q4 block order, so GGUF loads without a shuffle).
- 8-bit: `qweight` int8 [N, K].
- `scales` [N, K/G] and `mins` [N, K/G] hold raw float16 bits in int16 buffers: a module-wide dtype cast
  (`model.to(torch.float32)` on the CPU path) leaves integer buffers alone, so they stay 2 bytes each.
- `zeros` uint8 [N, K/G] (4-bit "zero" kind).

Dequantization, exactly as the source formats define it (every product is exact in fp32: a float16 scale times
a 4- or 8-bit integer needs at most 19 mantissa bits):
- kind "min"  (GGUF Q4_1):            w = d * q + m
- kind "zero" (GGUF Q4_0, AWQ, GPTQ): w = (q - z) * d      (Q4_0: z = 8)
- kind "sym"  (GGUF Q8_0, 8-bit):     w = q * d

This module is the layout and its torch reference only; the GPU's transposed 4-bit layout (engine/quant/kn_layout.py)
is derived from it, and the layers that run either (engine/quant/quant_layers.py) sit above both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Kind = Literal["min", "zero", "sym"]
KINDS: tuple[str, ...] = ("min", "zero", "sym")
SUB_BLOCK = 32
# Rows dequantized at a time on the torch path (and for the head): a [tile, K] fp32 temporary, not the whole matrix.
TILE_BYTES = 8 << 20


def fp16_bits(t: torch.Tensor) -> torch.Tensor:
    """float16 values as their int16 bit patterns (see the module docstring for why)."""
    return t.to(torch.float16).contiguous().view(torch.int16)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] in 0..15 (K a multiple of 32) -> the canonical packed [N, K/2]."""
    n, k = q.shape
    if k % SUB_BLOCK:
        raise ValueError(f"int4 rows need a multiple of {SUB_BLOCK} elements, got {k}")
    blocks = q.to(torch.uint8).view(n, k // SUB_BLOCK, 2, SUB_BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The canonical packed [N, K/2] -> uint8 [N, K] in 0..15."""
    n, half = packed.shape
    blocks = packed.view(n, half // (SUB_BLOCK // 2), 1, SUB_BLOCK // 2)
    both = torch.cat([blocks & 0x0F, blocks >> 4], dim=2)
    return both.reshape(n, half * 2)


@dataclass(frozen=True)
class QuantWeight:
    """One quantized matrix [N, K] in the canonical layout (tensors on one device)."""

    bits: int
    kind: Kind
    group_size: int
    out_features: int
    in_features: int
    qweight: torch.Tensor
    scales: torch.Tensor  # int16 (float16 bits) [N, K/G]
    mins: torch.Tensor | None = None  # int16 (float16 bits) [N, K/G], kind "min"
    zeros: torch.Tensor | None = None  # uint8 [N, K/G], kind "zero"

    def __post_init__(self) -> None:
        n, k, g = self.out_features, self.in_features, self.group_size
        if self.bits not in (4, 8) or self.kind not in KINDS:
            raise ValueError(f"unsupported quantized weight: bits={self.bits}, kind={self.kind!r}")
        if g % SUB_BLOCK or k % g:
            raise ValueError(f"group_size {g} must be a multiple of {SUB_BLOCK} dividing in_features {k}")
        expect_q = (n, k // 2) if self.bits == 4 else (n, k)
        if tuple(self.qweight.shape) != expect_q or tuple(self.scales.shape) != (n, k // g):
            raise ValueError(f"quantized weight shapes {tuple(self.qweight.shape)} / {tuple(self.scales.shape)} "
                             f"do not fit [{n}, {k}] with group_size {g}")
        if (self.kind == "min") != (self.mins is not None) or (self.kind == "zero") != (self.zeros is not None):
            raise ValueError(f"kind {self.kind!r} needs {'mins' if self.kind == 'min' else 'zeros'}")
        if self.bits == 8 and self.kind != "sym":
            raise ValueError("8-bit weights are symmetric (kind 'sym')")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.mins, self.zeros)
                   if t is not None)

    def rows(self, index: torch.Tensor | slice) -> QuantWeight:
        """The same weight restricted to some output rows (a permutation, a slice, or gathered rows)."""
        pick = (lambda t: t[index].contiguous()) if isinstance(index, torch.Tensor) else (lambda t: t[index])
        q = pick(self.qweight)
        return QuantWeight(self.bits, self.kind, self.group_size, q.shape[0], self.in_features, q,
                           pick(self.scales), None if self.mins is None else pick(self.mins),
                           None if self.zeros is None else pick(self.zeros))

    def to(self, device: torch.device | str) -> QuantWeight:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QuantWeight(self.bits, self.kind, self.group_size, self.out_features, self.in_features,
                           self.qweight.to(device), self.scales.to(device), move(self.mins), move(self.zeros))

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight:
        """Stack weights along the output dim (q|k|v, gate|up): same K, bits, kind and group size."""
        first = parts[0]
        for p in parts[1:]:
            if (p.bits, p.kind, p.group_size, p.in_features) != (first.bits, first.kind, first.group_size,
                                                                  first.in_features):
                raise ValueError("cannot fuse quantized weights of different formats: "
                                 f"{(first.bits, first.kind, first.group_size)} vs {(p.bits, p.kind, p.group_size)}")

        def join(name: str) -> torch.Tensor | None:
            tensors = [getattr(p, name) for p in parts]
            return None if tensors[0] is None else torch.cat(tensors, dim=0)

        qweight = join("qweight")
        assert qweight is not None
        return QuantWeight(first.bits, first.kind, first.group_size, sum(p.out_features for p in parts),
                           first.in_features, qweight, join("scales"), join("mins"), join("zeros"))  # type: ignore[arg-type]


def dequantize(w: QuantWeight, start: int = 0, end: int | None = None) -> torch.Tensor:
    """Rows [start, end) of w as float32, by the formulas in the module docstring (the reference)."""
    end = w.out_features if end is None else end
    g = w.group_size
    q = w.qweight[start:end]
    n = q.shape[0]
    d = w.scales[start:end].view(torch.float16).float().repeat_interleave(g, dim=1)
    qf = unpack_int4(q).float() if w.bits == 4 else q.float()
    if w.kind == "min":
        assert w.mins is not None
        return d * qf + w.mins[start:end].view(torch.float16).float().repeat_interleave(g, dim=1)
    if w.kind == "zero":
        assert w.zeros is not None
        return (qf - w.zeros[start:end].float().repeat_interleave(g, dim=1)) * d
    return (qf * d).view(n, w.in_features)


def tile_rows(w: QuantWeight) -> int:
    """Rows dequantized at a time: a [tile, K] fp32 temporary of about TILE_BYTES."""
    return max(1, TILE_BYTES // (4 * w.in_features))


def quant_matmul_ref(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """x [M, K] (float) @ dequantize(w).T, a row tile at a time: the torch path."""
    out = torch.empty(x.shape[0], w.out_features, dtype=x.dtype, device=x.device)
    tile = tile_rows(w)
    for start in range(0, w.out_features, tile):
        end = min(start + tile, w.out_features)
        out[:, start:end] = x @ dequantize(w, start, end).to(x.dtype).t()
    return out
