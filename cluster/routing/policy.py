"""Routing policies: pick a prefill worker (by cached prefix and load), a decode worker (by load) and, without a
prefill pool, a replica that does both (`choose_replica`: the prefix policy keeps a prompt on the replica caching
it, SGLang-style, unless the replicas are out of balance).

The prefix policy's cost follows Dynamo's: per worker, the prefill work it would have queued if it took the
request, minus the blocks it already caches, plus the KV blocks its running requests hold:

    cost = prefill_load_scale * max(queued_tokens + prompt_tokens - overlap_credit * cached_tokens, 0) / block_size
           + used_kv_blocks

Cached tokens in a worker's host tier (--kv-offloading-size) are loaded back, not recomputed, at a cost: they count
(1 - reload_cost) each, where reload_cost is the worker's measured load time over recompute time
(`WorkerLoad.host_reload_cost`), or `CostWeights.host_reload_cost` until it has measured one. So a host hit scores
between a device hit (1) and a miss (0).

The lowest cost wins; ties are broken at random so routers do not herd onto the first worker.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cluster.routing.events import WorkerLoad

POLICY_NAMES = ("prefix", "round-robin", "least-load", "random")


def shares_compute(a: str, b: str) -> bool:
    """Whether two workers' compute domains overlap: a tensor-parallel worker names each rank's GPU, so a worker on
    GPUs 0-1 and one on GPUs 1-2 share GPU 1. An unknown domain ("") shares nothing."""
    return bool(a and b) and not set(a.split(",")).isdisjoint(b.split(","))


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What the router knows of one worker when it routes."""

    worker_id: str
    address: str
    load: WorkerLoad
    pending_prefill_tokens: int = 0  # prompt tokens this router sent whose first token has not come back yet
    pending_requests: int = 0  # this router's requests in flight there
    # The physical GPUs (comma-separated, one per rank) or the host it computes on ("" unknown); shares_compute
    compute_domain: str = ""

    @property
    def queued_prefill_tokens(self) -> int:
        # The reported queue is up to one heartbeat old; our own recent sends cover the gap.
        return max(self.load.queued_prefill_tokens, self.pending_prefill_tokens)

    @property
    def used_kv_blocks(self) -> float:
        return self.load.kv_cache_usage * self.load.num_kv_blocks


@dataclass(frozen=True)
class CostWeights:
    prefill_load_scale: float = 1.0
    overlap_credit: float = 1.0  # fraction of a cached token's prefill the credit takes off
    # A host-tier block's load over its recompute, until the worker reports a measured one: a GPU loads a block
    # over PCIe in a few percent of its prefill time.
    host_reload_cost: float = 0.1
    # Replicas (the prefix policy's `choose_replica`), SGLang's cache-aware rule: a prompt goes to the replica
    # caching the most of it when that is at least `cache_threshold` of the prompt, unless the replicas' request
    # counts are out of balance (apart by more than `balance_abs_threshold` and by more than
    # `balance_rel_threshold` times): then to the least loaded. SGLang's abs default is 64; 4 here, because a chat
    # template's fixed header can be 30 % of a short prompt: the first replica to cache it would take every request
    # until it ran 64 more than an idle peer, which then never caches the header (two replicas at moderate load).
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 4
    balance_rel_threshold: float = 1.5

    def __post_init__(self) -> None:
        if not 0.0 < self.host_reload_cost < 1.0:
            raise ValueError(f"host_reload_cost must be in (0, 1), got {self.host_reload_cost}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or not self.balance_rel_threshold >= 1.0:
            raise ValueError(f"balance thresholds must be abs >= 0 and rel >= 1, got {self.balance_abs_threshold} "
                             f"and {self.balance_rel_threshold}")


@dataclass(frozen=True, slots=True)
class PrefillChoice:
    worker: WorkerView
    matched_blocks: int  # leading prompt blocks it caches, in either tier
    cost: float
    host_blocks: int = 0  # of those, the ones in its host tier


def reload_cost(worker: WorkerView, weights: CostWeights) -> float:
    measured = worker.load.host_reload_cost
    return min(measured, 1.0) if measured > 0 else weights.host_reload_cost


def prefill_cost(worker: WorkerView, prompt_tokens: int, matched_blocks: int, block_size: int,
                 weights: CostWeights, host_blocks: int = 0) -> float:
    cached = min(matched_blocks * block_size, prompt_tokens)
    on_host = min(host_blocks * block_size, cached)
    credit = cached - on_host * reload_cost(worker, weights)
    adjusted = max(worker.queued_prefill_tokens + prompt_tokens - weights.overlap_credit * credit, 0.0)
    return weights.prefill_load_scale * adjusted / block_size + worker.used_kv_blocks


def unreported_blocks(worker: WorkerView, prompt_tokens: int, block_size: int) -> float:
    """KV blocks this router's requests on `worker` will hold that its last heartbeat does not count yet: requests
    in flight beyond those it reports, each taken at this prompt's size (Dynamo's router likewise tracks the blocks
    of the requests it routed itself)."""
    unseen = max(worker.pending_requests - worker.load.num_running - worker.load.num_waiting, 0)
    return unseen * -(-prompt_tokens // block_size)


def requests_on(worker: WorkerView) -> int:
    """Its requests: the reported running and waiting ones, or this router's in flight there if more."""
    return max(worker.load.num_running + worker.load.num_waiting, worker.pending_requests)


def decode_cost(worker: WorkerView) -> float:
    return requests_on(worker) + worker.load.kv_cache_usage


class RoutingPolicy:
    """Base: cost-based choice with random tie-breaking. Subclasses change what the cost sees, or replace the pick
    (`_pick_prefill` / `_pick_decode`); the public choices guard the empty pool once for all of them."""

    name = "least-load"
    uses_index = False

    def __init__(self, weights: CostWeights | None = None, seed: int | None = None) -> None:
        self.weights = weights or CostWeights()
        self._rng = random.Random(seed)

    def choose_prefill(self, workers: Sequence[WorkerView], matched: dict[str, int], prompt_tokens: int,
                       block_size: int, host_matched: Mapping[str, int] | None = None) -> PrefillChoice:
        """`matched`: each worker's leading cached blocks in any tier; `host_matched`: how many of those are in
        its host tier (none when absent)."""
        if not workers:
            raise ValueError("no prefill workers to choose from")
        return self._pick_prefill(workers, matched, prompt_tokens, block_size, host_matched or {})

    def choose_decode(self, workers: Sequence[WorkerView]) -> WorkerView:
        if not workers:
            raise ValueError("no decode workers to choose from")
        return self._pick_decode(workers)

    def choose_replica(self, workers: Sequence[WorkerView], matched: dict[str, int], prompt_tokens: int,
                       block_size: int, host_matched: Mapping[str, int] | None = None) -> PrefillChoice:
        """A worker that prefills the prompt and decodes it (no prefill pool: replicas). The prefix policy keeps a
        conversation on the replica caching it unless the replicas are out of balance (`CostWeights`); otherwise,
        and for the load-only policies, the cheapest by `prefill_cost` plus the KV its in-flight requests will hold
        that no heartbeat shows yet (`unreported_blocks`)."""
        if not workers:
            raise ValueError("no workers to choose from")
        return self._pick_replica(workers, matched, prompt_tokens, block_size, host_matched or {})

    def _cheapest(self, workers: Sequence[WorkerView], matched: dict[str, int], prompt_tokens: int, block_size: int,
                host_matched: Mapping[str, int], replica: bool = False) -> PrefillChoice:
        """The cheapest worker by `prefill_cost` (plus `unreported_blocks` for a replica), ties at random."""
        scored = []
        for w in workers:
            cached, on_host = matched.get(w.worker_id, 0), host_matched.get(w.worker_id, 0)
            credit = cached if self.uses_index else 0  # load-only policies ignore the cache
            cost = prefill_cost(w, prompt_tokens, credit, block_size, self.weights, on_host)
            cost += unreported_blocks(w, prompt_tokens, block_size) if replica else 0.0
            scored.append(PrefillChoice(w, cached, cost, on_host))
        best = min(c.cost for c in scored)
        return self._rng.choice([c for c in scored if c.cost <= best + 1e-9])

    def _pick_prefill(self, workers: Sequence[WorkerView], matched: dict[str, int], prompt_tokens: int,
                      block_size: int, host_matched: Mapping[str, int]) -> PrefillChoice:
        return self._cheapest(workers, matched, prompt_tokens, block_size, host_matched)

    def _pick_replica(self, workers: Sequence[WorkerView], matched: dict[str, int], prompt_tokens: int,
                      block_size: int, host_matched: Mapping[str, int]) -> PrefillChoice:
        return self._cheapest(workers, matched, prompt_tokens, block_size, host_matched, replica=True)

    def _as_choice(self, worker: WorkerView, matched: dict[str, int], host_matched: Mapping[str, int]
                   ) -> PrefillChoice:
        return PrefillChoice(worker, matched.get(worker.worker_id, 0), 0.0, host_matched.get(worker.worker_id, 0))

    def _pick_decode(self, workers: Sequence[WorkerView]) -> WorkerView:
        costs = [decode_cost(w) for w in workers]
        best = min(costs)
        return self._rng.choice([w for w, c in zip(workers, costs, strict=True) if c <= best + 1e-9])


class PrefixPolicy(RoutingPolicy):
    name = "prefix"
    uses_index = True

    def _pick_replica(self, workers: Sequence[WorkerView], matched: dict[str, int], prompt_tokens: int,
                      block_size: int, host_matched: Mapping[str, int]) -> PrefillChoice:
        """SGLang's cache-aware choice. Dynamo's cost alone broke affinity whenever the holder ran one request more
        than its peer (a running request's KV weighs about a conversation's cached prefix): on 2-core CPU
        replicas, 7 conversations x 6 turns, it kept 0.81 of prompt tokens cached, TTFT p50 0.30 s; this rule 0.84,
        0.27 s (bench/results/kv_tiers_replica_routing_cpu_smollm2.json)."""
        w = self.weights
        loads = [requests_on(v) for v in workers]
        if max(loads) - min(loads) > w.balance_abs_threshold and max(loads) > w.balance_rel_threshold * min(loads):
            return self._as_choice(self._pick_decode(workers), matched, host_matched)
        most = max(matched.get(v.worker_id, 0) for v in workers)
        if most > 0 and min(most * block_size, prompt_tokens) >= w.cache_threshold * prompt_tokens:
            workers = [v for v in workers if matched.get(v.worker_id, 0) == most]
        return self._cheapest(workers, matched, prompt_tokens, block_size, host_matched, replica=True)


class LeastLoadPolicy(RoutingPolicy):
    name = "least-load"


class RoundRobinPolicy(RoutingPolicy):
    name = "round-robin"

    def __init__(self, weights: CostWeights | None = None, seed: int | None = None) -> None:
        super().__init__(weights, seed)
        self._prefill_turn = itertools.count()
        self._decode_turn = itertools.count()

    def _pick_prefill(self, workers: Sequence[WorkerView], matched: dict[str, int], prompt_tokens: int,
                      block_size: int, host_matched: Mapping[str, int]) -> PrefillChoice:
        return self._as_choice(workers[next(self._prefill_turn) % len(workers)], matched, host_matched)

    def _pick_replica(self, workers: Sequence[WorkerView], matched: dict[str, int], prompt_tokens: int,
                      block_size: int, host_matched: Mapping[str, int]) -> PrefillChoice:
        return self._as_choice(self._pick_decode(workers), matched, host_matched)

    def _pick_decode(self, workers: Sequence[WorkerView]) -> WorkerView:
        return workers[next(self._decode_turn) % len(workers)]


class RandomPolicy(RoutingPolicy):
    name = "random"

    def _pick_prefill(self, workers: Sequence[WorkerView], matched: dict[str, int], prompt_tokens: int,
                      block_size: int, host_matched: Mapping[str, int]) -> PrefillChoice:
        return self._as_choice(self._rng.choice(list(workers)), matched, host_matched)

    def _pick_replica(self, workers: Sequence[WorkerView], matched: dict[str, int], prompt_tokens: int,
                      block_size: int, host_matched: Mapping[str, int]) -> PrefillChoice:
        return self._as_choice(self._pick_decode(workers), matched, host_matched)

    def _pick_decode(self, workers: Sequence[WorkerView]) -> WorkerView:
        return self._rng.choice(list(workers))


def make_policy(name: str, weights: CostWeights | None = None, seed: int | None = None) -> RoutingPolicy:
    policies: dict[str, type[RoutingPolicy]] = {"prefix": PrefixPolicy, "round-robin": RoundRobinPolicy,
                                                "least-load": LeastLoadPolicy, "random": RandomPolicy}
    if name not in policies:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    return policies[name](weights, seed)
