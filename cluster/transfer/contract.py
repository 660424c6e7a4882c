"""The KV transfer contract between workers: what the decode side asks for (`PullJob`), what a transport
reports (`PullResult`), how a request's blocks are cut into messages (and exported), and the prefill side's lease.

The wire layout itself is `engine.kv_layout`; the engine side of a transfer is `engine.kv_port`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.kv_layout import KVLayout, KVSlice
from engine.kv_port import KVExport, KVPort
from engine.outputs import PositionLogprobs
from engine.sampling_params import SamplingParams

DEFAULT_LEASE_S = 10.0  # the prefill side frees a finished request's blocks if no transfer takes them by then
GRPC_MAX_CHUNK_BYTES = (4 << 20) - (64 << 10)  # under gRPC's 4 MiB default message limit
LINK_MAX_CHUNK_BYTES = 512 << 20  # one torch.distributed message: a 4k-token Llama-8B prompt goes in one


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


def export_slices(port: KVPort, block_ids: list[int], first_block: int, end_block: int, max_bytes: int
                  ) -> Iterator[KVExport]:
    """Export blocks [first_block, end_block) of a request (`block_ids`: its whole block table), one slice of at
    most `max_bytes` per message, each as it is planned (a link stages it before the next one is exported)."""
    for part in plan_slices(first_block, end_block - first_block, port.layout, max_bytes):
        yield port.export(block_ids[part.first_block : part.first_block + part.num_blocks], part)


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


class TransferPace:
    """How long this worker's pulls spend moving a prompt token's KV (wire seconds per token, an exponential
    average over pulls that moved blocks): reported in its load, so the router weighs a fetch's transfer by this
    link's measured cost rather than a guessed share of the recompute."""

    def __init__(self, weight: float = 0.2) -> None:
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.weight = weight
        self.seconds_per_token = 0.0  # 0: no pull measured yet

    def observe(self, num_tokens: int, wire_seconds: float) -> None:
        if num_tokens <= 0 or wire_seconds <= 0:
            return
        sample = wire_seconds / num_tokens
        previous = self.seconds_per_token
        self.seconds_per_token = sample if previous == 0 else previous + self.weight * (sample - previous)


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
