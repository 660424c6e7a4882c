"""Typed KV-event batches as the index sees them (transports convert their wire messages into these).

A worker advertises each cached block in one tier, the one it would serve it from: `BlocksStored` on the device,
`BlocksStored(tier=HOST)` once it moved to the host tier, `BlocksRemoved` when no tier holds it any more.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Tier(Enum):
    DEVICE = "device"
    HOST = "host"  # served after a load back to the device: worth less than a device hit, more than a miss


@dataclass(frozen=True, slots=True)
class BlocksStored:
    block_hashes: tuple[bytes, ...]
    tier: Tier = Tier.DEVICE


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


IndexEvent = BlocksStored | BlocksRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    num_running: int = 0
    num_waiting: int = 0
    queued_prefill_tokens: int = 0
    kv_cache_usage: float = 0.0  # 0..1 of blocks referenced by requests
    num_kv_blocks: int = 0
    num_preemptions: int = 0  # cumulative
    busy_fraction: float = 0.0  # share of recent time spent in steps
    prefill_tokens_per_s: float = 0.0  # a new prompt's prefill rate there now; 0: not known
    host_reload_cost: float = 0.0  # a host-tier block's load time over its recompute time; 0: not measured
    external_prefix_cache_hits: int = 0  # prompt tokens loaded back from the host tier (cumulative)
    kv_receive_s_per_token: float = 0.0  # its pulls' wire seconds per received prompt token; 0: not measured
    host_dropped_blocks: int = 0  # blocks its full host tier let go (cumulative)


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One batch from a worker: `sequence` grows by one per batch within an `epoch` (new on every worker start)."""

    worker_id: str
    epoch: int
    sequence: int
    events: tuple[IndexEvent, ...] = ()
    load: WorkerLoad | None = None
    sent_unix_s: float = 0.0

    @property
    def is_snapshot(self) -> bool:
        return bool(self.events) and isinstance(self.events[0], AllBlocksCleared)


class BatchVerdict(Enum):
    APPLY = "apply"
    STALE = "stale"  # from an older epoch of this worker: drop it
    GAP = "gap"  # a batch went missing: resubscribe for a fresh snapshot


class BatchOrder:
    """Checks one subscription's batches arrive in order: a snapshot starts a run, then sequence + 1 each."""

    def __init__(self) -> None:
        self.epoch: int | None = None
        self.sequence = 0

    def check(self, batch: EventBatch) -> BatchVerdict:
        if batch.is_snapshot:
            if self.epoch is not None and batch.epoch < self.epoch:
                return BatchVerdict.STALE
            self.epoch, self.sequence = batch.epoch, batch.sequence
            return BatchVerdict.APPLY
        if self.epoch is None or batch.epoch != self.epoch:
            return BatchVerdict.STALE if self.epoch is not None and batch.epoch < self.epoch else BatchVerdict.GAP
        if batch.sequence != self.sequence + 1:
            return BatchVerdict.STALE if batch.sequence <= self.sequence else BatchVerdict.GAP
        self.sequence = batch.sequence
        return BatchVerdict.APPLY
