"""Per-request KV block bookkeeping on top of the block pool: prefix hits, slot allocation, freeing.

The allocator never decides policy: `allocate_slots` returns None when the pool cannot serve the request, and
the scheduler chooses whom to preempt.

With a host tier, a prefix lookup takes each block from the device cache, else from the host tier (a `HostHit`);
`allocate_slots` gives every host hit a fresh device block, registers it in the device cache at once and queues
its copy back (after any copy out that the allocation itself queued), so the whole prefix is in place before the
step's forward reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.core.block_hash import BlockHasher
from engine.core.block_pool import BlockPool, KVCacheBlock
from engine.core.host_tier import HostHit, HostKVTier
from engine.core.request import Request
from engine.outputs import TierCopy

PrefixBlock = KVCacheBlock | HostHit


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found in the device cache
    host_queries: int = 0  # prompt tokens looked up while a host tier is on (vLLM's external prefix cache)
    host_hits: int = 0  # tokens loaded back from the host tier (counted per load, not per lookup)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, hasher: BlockHasher, enable_caching: bool,
                 enable_events: bool = False, host_tier: HostKVTier | None = None) -> None:
        if host_tier is not None and not enable_caching:
            raise ValueError("the host KV tier (kv_offloading_size) needs prefix caching")
        self.block_size = block_size
        self.hasher = hasher
        self.enable_caching = enable_caching
        self.host_tier = host_tier
        self.pool = BlockPool(num_blocks, enable_caching, enable_events, host_tier)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        # Blocks of finished requests kept for a KV transfer: request id -> (blocks, monotonic deadline).
        self.held: dict[str, tuple[list[KVCacheBlock], float]] = {}
        self.stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_block_hashes(self, request: Request) -> None:
        """Extend the request's chained hashes to every full block of its known tokens."""
        num_full = request.num_tokens // self.block_size
        known = len(request.block_hashes)
        if num_full <= known:
            return
        parent = request.block_hashes[-1] if known else None
        start = known * self.block_size
        request.block_hashes.extend(
            self.hasher.hash_blocks(request.all_token_ids[start : num_full * self.block_size], parent,
                                    request.extra_keys)
        )

    def get_computed_blocks(self, request: Request) -> tuple[list[PrefixBlock], int]:
        """Longest cached prefix of the request, in blocks (device blocks, or host hits to load back); never the
        whole prompt (the last token is recomputed to produce logits)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self.update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[PrefixBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            hit = self._lookup(block_hash)
            if hit is None:
                break
            hits.append(hit)
        num_host = sum(1 for hit in hits if isinstance(hit, HostHit))
        self.stats.queries += request.num_tokens
        self.stats.hits += (len(hits) - num_host) * self.block_size
        if self.host_tier is not None:  # host hits are counted when loaded (once per admission, not per lookup)
            self.stats.host_queries += request.num_tokens
        return hits, len(hits) * self.block_size

    def reserve_prefix(self, request: Request) -> None:
        """A request joining the waiting queue: keep the host-tier blocks of its cached prefix (the leading blocks
        on the device or in the tier) from being dropped until it is admitted or ends (engine/core/host_tier.py).
        No stats: this is not the admission's lookup."""
        if self.host_tier is None or request.sampling_params.prompt_logprobs is not None:
            return
        self.update_block_hashes(request)
        held = []
        for block_hash in request.block_hashes[: (request.num_tokens - 1) // self.block_size]:
            if block_hash in self.host_tier:
                held.append(block_hash)
            elif self.pool.get_cached_block(block_hash) is None:
                break
        request.host_reserved = self.host_tier.reserve(held)

    def release_prefix(self, request: Request) -> None:
        """End `reserve_prefix`'s reservation (admitted, or finished while waiting); a no-op after the first."""
        if self.host_tier is not None and request.host_reserved:
            self.host_tier.release(request.host_reserved)
        request.host_reserved = []

    def _lookup(self, block_hash: bytes) -> PrefixBlock | None:
        block = self.pool.get_cached_block(block_hash)
        if block is not None or self.host_tier is None:
            return block
        slot = self.host_tier.lookup(block_hash)
        return HostHit(block_hash, slot) if slot is not None else None

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[PrefixBlock] | None = None) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones; None if the pool is too full."""
        prefix = list(new_computed_blocks or [])
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(prefix) * self.block_size
        needed = self.blocks_needed(num_computed + num_new_tokens) - len(blocks) - len(prefix)
        # Hit blocks sitting in the free queue stop being free once touched; host hits take a free block each.
        evictable_hits = sum(1 for b in prefix if isinstance(b, HostHit) or b.ref_cnt == 0)
        if needed > self.pool.num_free_blocks - evictable_hits:
            return None
        if prefix:
            blocks = blocks + self._take_prefix(request, len(blocks), prefix)
            self.num_cached_blocks[request.request_id] = len(blocks)
        new_blocks = self.pool.get_new_blocks(max(needed, 0)) if needed > 0 else []
        assert new_blocks is not None  # checked above
        blocks = blocks + new_blocks
        self.req_to_blocks[request.request_id] = blocks
        return new_blocks

    def _take_prefix(self, request: Request, start: int, prefix: list[PrefixBlock]) -> list[KVCacheBlock]:
        """Reference the device hits and load the host hits back into fresh blocks, in prefix order."""
        device = [b for b in prefix if isinstance(b, KVCacheBlock)]
        self.pool.touch(device)  # before any allocation below, which could otherwise evict them
        hosts = [b for b in prefix if isinstance(b, HostHit)]
        if not hosts:
            return device
        assert self.host_tier is not None  # only a host tier produces host hits
        self.host_tier.protect(hit.slot for hit in hosts)  # the allocation's own copies out must not reuse them
        try:
            allocated = self.pool.get_new_blocks(len(hosts))
        finally:
            self.host_tier.unprotect()
        assert allocated is not None  # allocate_slots checked the room
        self.stats.host_hits += len(hosts) * self.block_size
        fresh = iter(allocated)
        taken: list[KVCacheBlock] = []
        for i, hit in enumerate(prefix, start):
            if isinstance(hit, KVCacheBlock):
                taken.append(hit)
                continue
            block = next(fresh)
            self.pool.tier_copies.append((False, hit.slot, block.block_id))
            self.pool.cache_full_block(block, hit.block_hash, request.block_hashes[i - 1] if i else None)
            taken.append(block)
        return taken

    def take_tier_copies(self) -> list[TierCopy]:
        """The host-tier copies queued since the last call, in the order they must run."""
        return self.pool.take_tier_copies()

    def trim(self, request: Request, num_tokens: int) -> int:
        """Free the tail blocks beyond those `num_tokens` tokens need (rejected draft tokens' slots); returns how
        many were freed. Never touches cached blocks: those hold computed tokens only."""
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return 0
        keep = max(self.blocks_needed(num_tokens), self.num_cached_blocks.get(request.request_id, 0))
        if len(blocks) <= keep:
            return 0
        extra = blocks[keep:]
        del blocks[keep:]
        self.pool.free_blocks(reversed(extra))
        return len(extra)

    def allocate_for_swap_in(self, request: Request, num_tokens: int) -> list[KVCacheBlock] | None:
        """Fresh blocks to hold `num_tokens` tokens of KV copied back from swap space."""
        blocks = self.pool.get_new_blocks(self.blocks_needed(num_tokens))
        if blocks is not None:
            self.req_to_blocks[request.request_id] = blocks
        return blocks

    def cache_blocks(self, request: Request) -> None:
        """Register the request's newly completed full blocks (prompt and generated tokens alike)."""
        if not self.enable_caching:
            return
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        done = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= done:
            return
        self.update_block_hashes(request)
        num_full = min(num_full, len(request.block_hashes))
        for i in range(done, num_full):
            parent = request.block_hashes[i - 1] if i else None
            self.pool.cache_full_block(blocks[i], request.block_hashes[i], parent)
        self.num_cached_blocks[request.request_id] = num_full

    def block_ids(self, request_id: str) -> list[int]:
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None and request_id in self.held:
            blocks = self.held[request_id][0]
        return [b.block_id for b in blocks or []]

    def hold(self, request: Request, deadline: float) -> None:
        """Keep a finished request's blocks referenced until `release_held` or the deadline (a transfer lease)."""
        self.num_cached_blocks.pop(request.request_id, None)
        self.held[request.request_id] = (self.req_to_blocks.pop(request.request_id, []), deadline)

    def release_held(self, request_id: str) -> int:
        """Free a held request's blocks; returns how many were held (0 if none)."""
        blocks, _ = self.held.pop(request_id, ([], 0.0))
        self.pool.free_blocks(reversed(blocks))
        return len(blocks)

    def release_expired(self, now: float) -> int:
        """Free holds whose lease ran out (the transfer never finished); returns the number of blocks freed."""
        expired = [rid for rid, (_, deadline) in self.held.items() if deadline <= now]
        return sum(self.release_held(rid) for rid in expired)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first: the tail holds the least reusable prefix."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))
