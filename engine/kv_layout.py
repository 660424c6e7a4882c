"""The KV wire layout both ends of a transfer share, and how a received slice is checked.

The payload of a message is one contiguous tensor in `KVLayout.order`: for each layer, K then V, the blocks in
request order, each [block_size, num_kv_heads, head_dim]. `engine.kv_port` exports and imports such tensors;
the transports that move them live in `cluster.transfer`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_ORDER = "layer,kv,block,token,head,dim"
# The KV cache's dtype as the layout header names it: the model dtype, or fp8 e4m3 (--kv-cache-dtype fp8), whose
# blocks travel as they are stored (per-tensor scales are the same on both sides: workers of one model and config).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float8_e4m3fn": torch.float8_e4m3fn}


class KVTransferError(RuntimeError):
    """The transfer failed (peer gone, bad payload, layout mismatch); the decode side recomputes."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # short label for kvflow:disagg_fallback_total{reason}


@dataclass(frozen=True)
class KVLayout:
    dtype: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    order: str = KV_ORDER
    # fp8 cache: each layer's k_scale, v_scale (bytes mean nothing without them, so they are part of the
    # layout both sides must share); empty for other dtypes
    kv_scales: tuple[float, ...] = ()

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def block_layer_bytes(self) -> int:
        """Bytes of one block in one layer, K and V together."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.torch_dtype.itemsize

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.block_layer_bytes

    def payload_bytes(self, num_blocks: int, num_layers: int) -> int:
        return num_blocks * num_layers * self.block_layer_bytes

    def wire_shape(self, part: KVSlice) -> tuple[int, ...]:
        return (part.num_layers, 2, part.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


@dataclass(frozen=True)
class KVSlice:
    """Blocks [first_block, first_block + num_blocks) of a request (block-table indices), layers
    [first_layer, first_layer + num_layers)."""

    first_block: int
    num_blocks: int
    first_layer: int
    num_layers: int


def check_slice(layout: KVLayout, part: KVSlice, num_bytes: int, total_blocks: int, skip_blocks: int) -> None:
    """A received slice must lie inside the blocks being transferred and carry exactly its layout's bytes."""
    if (part.num_blocks < 1 or part.first_block < skip_blocks or part.first_block + part.num_blocks > total_blocks
            or part.num_layers < 1 or part.first_layer + part.num_layers > layout.num_layers):
        raise KVTransferError("bad_stream", f"KV slice {part} is outside blocks [{skip_blocks}, {total_blocks}) "
                                            f"x {layout.num_layers} layers")
    expected = layout.payload_bytes(part.num_blocks, part.num_layers)
    if num_bytes != expected:
        raise KVTransferError("bad_payload", f"KV slice {part} has {num_bytes} bytes; expected {expected}")
