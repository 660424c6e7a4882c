"""Moving a prompt's KV blocks between workers: the layout contract, block (de)serialization, and the transport
interface.

The payload is raw little-endian tensor bytes (never pickle) in `KVLayout.order`: for each layer, K then V, the
blocks in request order, each [block_size, num_kv_heads, head_dim]. A transport moves those bytes; gRPC is one
implementation (prefill_worker/ and decode_worker/), NCCL would be another behind the same `KVTransport` protocol.
"""

from __future__ import annotations

import warnings
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.outputs import PositionLogprobs

KV_ORDER = "layer,kv,block,token,head,dim"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_CHUNK_BYTES = (4 << 20) - (64 << 10)  # under gRPC's 4 MiB default message limit


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

    @classmethod
    def of_caches(cls, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], dtype: str) -> KVLayout:
        _, block_size, heads, head_dim = kv_caches[0][0].shape
        return cls(dtype, len(kv_caches), block_size, heads, head_dim)

    @property
    def block_layer_bytes(self) -> int:
        """Bytes of one block in one layer, K and V together."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * DTYPES[self.dtype].itemsize

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.block_layer_bytes

    def payload_bytes(self, num_blocks: int, num_layers: int) -> int:
        return num_blocks * num_layers * self.block_layer_bytes


@dataclass(frozen=True)
class KVSlice:
    """Blocks [first_block, first_block + num_blocks) of a request (block-table indices), layers
    [first_layer, first_layer + num_layers)."""

    first_block: int
    num_blocks: int
    first_layer: int
    num_layers: int


def gather_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int],
                  first_layer: int = 0, num_layers: int | None = None) -> torch.Tensor:
    """Copy blocks out of the cache as one contiguous [layers, 2, blocks, block_size, heads, dim] tensor, i.e.
    exactly the wire layout of that slice.

    Runs on the engine thread: afterwards the blocks may be freed while the copy is serialized and sent.
    """
    layers = kv_caches[first_layer : first_layer + num_layers if num_layers is not None else None]
    key = kv_caches[0][0]
    index = torch.as_tensor(block_ids, dtype=torch.int64, device=key.device)
    out = torch.empty((len(layers), 2, len(block_ids), *key.shape[1:]), dtype=key.dtype, device=key.device)
    for layer, (k, v) in enumerate(layers):
        torch.index_select(k, 0, index, out=out[layer, 0])
        torch.index_select(v, 0, index, out=out[layer, 1])
    return out


def gather_slices(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int], first_block: int,
                  layout: KVLayout, max_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> list[tuple[KVSlice, torch.Tensor]]:
    """Copy request blocks [first_block, first_block + len(block_ids)) out as message-sized wire tensors."""
    out = []
    for part in plan_slices(first_block, len(block_ids), layout, max_bytes):
        ids = block_ids[part.first_block - first_block : part.first_block - first_block + part.num_blocks]
        out.append((part, gather_blocks(kv_caches, ids, part.first_layer, part.num_layers)))
    return out


def tensor_bytes(wire: torch.Tensor) -> bytes:
    """The raw bytes of a contiguous wire tensor (one copy, straight into the bytes object)."""
    return wire.view(torch.uint8).cpu().numpy().tobytes()


def plan_slices(first_block: int, num_blocks: int, layout: KVLayout,
                max_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> Iterator[KVSlice]:
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


def write_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], layout: KVLayout, block_ids: list[int],
                 part: KVSlice, data: bytes) -> None:
    """Write a received slice into the local cache blocks `block_ids` (the slice's blocks, in order).

    Callers write only into blocks that no scheduled step touches (a request waiting for its remote KV).
    """
    expected = layout.payload_bytes(part.num_blocks, part.num_layers)
    if len(data) != expected or len(block_ids) != part.num_blocks:
        raise KVTransferError("bad_payload", f"KV chunk has {len(data)} bytes for {part.num_blocks} blocks x "
                                             f"{part.num_layers} layers; expected {expected}")
    if part.first_layer + part.num_layers > len(kv_caches):
        raise KVTransferError("bad_payload", "KV chunk layers exceed the model's layer count")
    key = kv_caches[0][0]
    with warnings.catch_warnings():  # read-only source: it is only copied from, never written
        warnings.simplefilter("ignore", UserWarning)
        src = torch.frombuffer(data, dtype=torch.uint8)
    src = src.view(key.dtype).view(part.num_layers, 2, part.num_blocks, *key.shape[1:]).to(key.device)
    index = torch.as_tensor(block_ids, dtype=torch.int64, device=key.device)
    for offset in range(part.num_layers):
        k, v = kv_caches[part.first_layer + offset]
        k.index_copy_(0, index, src[offset, 0])
        v.index_copy_(0, index, src[offset, 1])


@dataclass(frozen=True)
class PullJob:
    """What the decode side asks a prefill worker for."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: object  # engine SamplingParams; the transport converts it for the wire
    block_ids: list[int]  # local block table for the whole prompt
    skip_blocks: int  # leading blocks already cached locally: not sent
    extra_keys: tuple[str, ...]
    lease_s: float


@dataclass(frozen=True)
class PullResult:
    first_token_id: int
    first_token_logprobs: PositionLogprobs | None
    num_blocks_received: int
    num_bytes: int
    remote_cached_tokens: int
    seconds: float
    sampler_state: bytes = b""  # seeded requests: the prefill side's generator state after the first token


# Called for each received slice with its local block ids and bytes; it writes them into the cache.
KVSink = Callable[[list[int], KVSlice, bytes], None]


class KVTransport(Protocol):
    """Decode side: get the prompt's KV from a prefill worker into local blocks, and the first token."""

    def pull(self, address: str, job: PullJob, sink: KVSink) -> Awaitable[PullResult]: ...

    async def close(self) -> None: ...
