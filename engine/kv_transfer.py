"""The KV transfer contract between workers: the wire layout, how a request's blocks are cut into messages, and
what a transport reports.

The payload of a message is one contiguous tensor in `KVLayout.order`: for each layer, K then V, the blocks in
request order, each [block_size, num_kv_heads, head_dim]. A transport moves those tensors (raw little-endian
bytes in a gRPC message, or a torch.distributed send/recv on a link); the engine side of it is `engine.kv_port`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.outputs import PositionLogprobs
from engine.sampling_params import SamplingParams

KV_ORDER = "layer,kv,block,token,head,dim"
# The KV cache's dtype as the layout header names it: the model dtype, or fp8 e4m3 (--kv-cache-dtype fp8), whose
# blocks travel as they are stored (per-tensor scales are the same on both sides: workers of one model and config).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float8_e4m3fn": torch.float8_e4m3fn}
DEFAULT_LEASE_S = 10.0  # the prefill side frees a finished request's blocks if no transfer takes them by then
GRPC_MAX_CHUNK_BYTES = (4 << 20) - (64 << 10)  # under gRPC's 4 MiB default message limit
LINK_MAX_CHUNK_BYTES = 512 << 20  # one torch.distributed message: a 4k-token Llama-8B prompt goes in one


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


def plan_slices(first_block: int, num_blocks: int, layout: KVLayout, max_bytes: int) -> Iterator[KVSlice]:
    """Split blocks into messages of at most `max_bytes` (whole blocks x all layers, or one block x fewer
    layers when a single block is larger than that)."""
    if layout.block_bytes <= max_bytes:
        step = max_bytes // layout.block_bytes
        for start in range(first_block, first_block + num_blocks, step):
            yield KVSlice(start, min(step, first_block + num_blocks - start), 0, layout.num_layers)
        return
    layers = max(1, max_bytes // layout.block_layer_bytes)
    for block in range(first_block, first_block + num_blocks):
        for layer in range(0, layout.num_layers, layers):
            yield KVSlice(block, 1, layer, min(layers, layout.num_layers - layer))


def check_slice(layout: KVLayout, part: KVSlice, num_bytes: int, total_blocks: int, skip_blocks: int) -> None:
    """A received slice must lie inside the blocks being transferred and carry exactly its layout's bytes."""
    if (part.num_blocks < 1 or part.first_block < skip_blocks or part.first_block + part.num_blocks > total_blocks
            or part.num_layers < 1 or part.first_layer + part.num_layers > layout.num_layers):
        raise KVTransferError("bad_stream", f"KV slice {part} is outside blocks [{skip_blocks}, {total_blocks}) "
                                            f"x {layout.num_layers} layers")
    expected = layout.payload_bytes(part.num_blocks, part.num_layers)
    if num_bytes != expected:
        raise KVTransferError("bad_payload", f"KV slice {part} has {num_bytes} bytes; expected {expected}")


def tensor_bytes(wire: torch.Tensor) -> bytes:
    """The raw bytes of a contiguous host wire tensor (one copy, straight into the bytes object)."""
    return wire.view(torch.uint8).numpy().tobytes()


@dataclass(frozen=True)
class PullJob:
    """What the decode side asks a prefill worker for."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # after generation-config defaults: the prefill side samples with these
    block_ids: list[int]  # local block table for the whole prompt
    skip_blocks: int  # leading blocks already cached locally: not sent
    extra_keys: tuple[str, ...]
    lease_s: float = DEFAULT_LEASE_S


@dataclass(frozen=True)
class PullResult:
    """A finished pull: every block is written on the device (the writes have completed, not just been queued)."""

    first_token_id: int
    first_token_logprobs: PositionLogprobs | None
    num_blocks_received: int
    num_bytes: int
    remote_cached_tokens: int
    seconds: float  # from the pull's start to the last block written (prefill compute included)
    wire_seconds: float  # the slices' own transfer time (receive posted -> written), summed
    backend: str  # "grpc" | "nccl" | "gloo"
    sampler_state: bytes = b""  # seeded requests: the prefill side's generator state after the first token
    remote_timings: object = None  # the prefill worker's own pb.Timings of this request, when it sent them
