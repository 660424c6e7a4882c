"""The two ends of a KV transfer, as the roles hold them.

- `KVSender`: the prefill side of one `Prefill` request. The prefill servicer decides which blocks are ready (a
  step hook on the engine thread) and hands them to its sender in block order; the sender exports them through the
  engine's `KVPort` and starts them toward the decode worker.
- `KVReceiver`: the decode side. One per worker; each pull brings one request's prompt KV into the blocks the
  decode engine reserved for it, and returns only once every write has completed on the device.

Which implementation a worker gets is decided in one place, cluster/transfer/registry.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

from cluster.transfer.contract import PullJob, PullResult
from engine.outputs import PositionLogprobs
from protos.kvflow.v1 import kvflow_pb2 as pb

# Called with the prefill worker's first token (id, logprobs, sampler state) as soon as it arrives, when that is
# before the KV has landed (link transfers), so that the token can stream while the transfer finishes.
FirstTokenCallback = Callable[[int, PositionLogprobs | None, bytes], Awaitable[None]]


class KVSender(Protocol):
    """The prefill side of one request's transfer."""

    backend: str  # "grpc" | "nccl" | "gloo": the Prefill header announces it; transfer metrics are labelled by it
    num_bytes: int  # exported so far (engine thread; read once the request finished)

    def send(self, block_ids: list[int], first_block: int, end_block: int) -> AsyncIterator[pb.KVChunk] | None:
        """Engine thread, in block order: export blocks [first_block, end_block) of the request (`block_ids`: its
        whole block table) and start them toward the decode worker. Returns the KV messages the Prefill stream
        itself must carry (gRPC backend), or None when the blocks travel on their own (a link)."""
        ...


class KVReceiver(Protocol):
    """The decode side: pulls prompt KV from prefill workers into reserved blocks."""

    async def pull(self, address: str, job: PullJob, on_first_token: FirstTokenCallback | None = None
                   ) -> PullResult:
        """Ask the prefill worker at `address` for `job`'s KV and write it into `job.block_ids`. Any failure is a
        `KVTransferError` with a short reason (the caller recomputes); no write into the blocks outlives the
        pull, even a cancelled one."""
        ...

    async def close(self) -> None:
        """Worker shutdown: end what this receiver holds open (links, their threads)."""
        ...
