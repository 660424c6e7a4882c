"""Prefix-cache events and load, streamed to routers (`StreamKVEvents`).

Every block is advertised in the tier the engine would serve it from (engine/core/block_pool.py): stored on the
device, moved to the host tier, or removed once no tier holds it; snapshots carry each block's tier too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from cluster.transfer.contract import TransferPace
from engine.core.block_pool import BlockRemoved, BlockStored, KVEvent, KVTier
from engine.llm_engine import EngineLoad
from protos.kvflow.v1 import kvflow_pb2 as pb

HEARTBEAT_S = 0.5
_WIRE_TIER = {KVTier.DEVICE: pb.KV_TIER_DEVICE, KVTier.HOST: pb.KV_TIER_HOST}


class KVEventHub:
    """Fans the engine's prefix-cache events out to any number of `StreamKVEvents` subscribers.

    It mirrors the cached set (hash -> parent, tier) from the event stream itself, so a new subscriber's snapshot
    is exactly consistent with the events that follow it. Sequence numbers count batches per subscription.
    """

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.epoch = time.time_ns()  # new on every process start
        self.cached: dict[bytes, tuple[bytes | None, KVTier]] = {}
        self.load: EngineLoad | None = None
        self.transfer_pace = TransferPace()  # fed by the decode side's pulls; published with the load
        self._subscribers: set[asyncio.Queue[list[pb.KVEvent]]] = set()

    def publish(self, events: list[KVEvent], load: EngineLoad) -> None:
        """Called on the event loop with each batch drained from the engine."""
        self.load = load
        if not events:
            return
        wire = []
        for event in events:
            if isinstance(event, BlockStored):
                self._mirror_stored(event)
                wire.append(pb.KVEvent(stored=pb.BlockStoredEvent(block_hashes=event.block_hashes,
                                                                  parent_hash=event.parent_hash or b"",
                                                                  tier=_WIRE_TIER[event.tier])))
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    self.cached.pop(block_hash, None)
                wire.append(pb.KVEvent(removed=pb.BlockRemovedEvent(block_hashes=event.block_hashes)))
        for subscriber in self._subscribers:
            subscriber.put_nowait(wire)

    def _mirror_stored(self, event: BlockStored) -> None:
        if event.tier is KVTier.HOST:  # a move: the parent stays what the device store said
            for block_hash in event.block_hashes:
                parent = self.cached.get(block_hash, (None, event.tier))[0]
                self.cached[block_hash] = (parent, event.tier)
            return
        parent = event.parent_hash
        for block_hash in event.block_hashes:
            self.cached[block_hash] = (parent, event.tier)
            parent = block_hash

    def _load_proto(self) -> pb.WorkerLoad:
        load = self.load
        if load is None:
            return pb.WorkerLoad(kv_receive_s_per_token=self.transfer_pace.seconds_per_token)
        return pb.WorkerLoad(num_running=load.num_running, num_waiting=load.num_waiting,
                             queued_prefill_tokens=load.queued_prefill_tokens, kv_cache_usage=load.kv_cache_usage,
                             num_kv_blocks=load.num_kv_blocks, num_preemptions=load.num_preemptions,
                             busy_fraction=load.busy_fraction, prefill_tokens_per_s=load.prefill_tokens_per_s,
                             host_reload_cost=load.host_reload_cost,
                             external_prefix_cache_hits=load.external_prefix_cache_hits,
                             kv_receive_s_per_token=self.transfer_pace.seconds_per_token,
                             host_dropped_blocks=load.host_dropped_blocks)

    def _batch(self, sequence: int, events: list[pb.KVEvent]) -> pb.KVEventBatch:
        return pb.KVEventBatch(worker_id=self.worker_id, epoch=self.epoch, sequence=sequence, events=events,
                               load=self._load_proto(), sent_unix_s=time.time())

    async def subscribe(self) -> AsyncIterator[pb.KVEventBatch]:
        """Snapshot first (cleared + every cached block), then event batches, heartbeats at least every 500 ms."""
        inbox: asyncio.Queue[list[pb.KVEvent]] = asyncio.Queue()
        snapshot = [pb.KVEvent(cleared=pb.AllBlocksClearedEvent())]
        snapshot += [pb.KVEvent(stored=pb.BlockStoredEvent(block_hashes=[h], parent_hash=p or b"",
                                                           tier=_WIRE_TIER[tier]))
                     for h, (p, tier) in self.cached.items()]
        self._subscribers.add(inbox)
        try:
            sequence = 0
            yield self._batch(sequence, snapshot)
            while True:
                try:
                    events = await asyncio.wait_for(inbox.get(), HEARTBEAT_S)
                except asyncio.TimeoutError:
                    events = []
                while not inbox.empty():
                    events = events + inbox.get_nowait()
                sequence += 1
                yield self._batch(sequence, events)
        finally:
            self._subscribers.discard(inbox)
