"""gRPC settings every worker shares, and the channels a worker opens to its peers.

A worker's server and its channels use the same options (message size, keepalive), so a message one side may send
the other may receive. Each channel presents this worker's cluster credential (cluster/auth.py).
"""

from __future__ import annotations

import grpc

from cluster.auth import ClusterAuth
from cluster.wire import MAX_MESSAGE_BYTES

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


class ChannelPool:
    """One gRPC channel per peer address, opened on first use and reused (no per-request setup); each presents
    this worker's cluster credential."""

    def __init__(self, auth: ClusterAuth | None = None) -> None:
        self._auth = auth or ClusterAuth()
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._auth.aio_channel(address, GRPC_OPTIONS)
            self._channels[address] = channel
        return channel

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
