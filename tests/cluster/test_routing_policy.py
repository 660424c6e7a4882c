"""Routing policies: the prefix cost prefers the worker with the cached prefix unless it is overloaded."""

from __future__ import annotations

import pytest

from cluster.routing.events import WorkerLoad
from cluster.routing.policy import CostWeights, WorkerView, decode_cost, make_policy, prefill_cost


def view(wid: str, queued: int = 0, usage: float = 0.0, running: int = 0, pending: int = 0) -> WorkerView:
    return WorkerView(wid, f"{wid}:1", WorkerLoad(num_running=running, queued_prefill_tokens=queued,
                                                  kv_cache_usage=usage, num_kv_blocks=100),
                      pending_requests=pending)


def test_prefix_policy_follows_the_cache() -> None:
    policy = make_policy("prefix", seed=0)
    workers = [view("a"), view("b"), view("c")]
    for _ in range(20):
        choice = policy.choose_prefill(workers, {"b": 60}, prompt_tokens=1024, block_size=16)
        assert choice.worker.worker_id == "b" and choice.matched_blocks == 60


def test_prefix_policy_avoids_an_overloaded_cache_holder() -> None:
    policy = make_policy("prefix", seed=0)
    workers = [view("a"), view("b", queued=8000)]
    choice = policy.choose_prefill(workers, {"b": 60}, prompt_tokens=1024, block_size=16)
    assert choice.worker.worker_id == "a" and choice.matched_blocks == 0


def test_cost_function_values() -> None:
    w = view("a", queued=160, usage=0.5)
    # (160 queued + 320 prompt - 2 blocks * 16 cached) / 16 + 50 used blocks
    assert prefill_cost(w, 320, 2, 16, CostWeights()) == pytest.approx(28 + 50)
    assert decode_cost(view("d", running=3, pending=5, usage=0.25)) == pytest.approx(5.25)


def test_least_load_ignores_the_cache_and_ties_spread() -> None:
    policy = make_policy("least-load", seed=1)
    workers = [view("a"), view("b")]
    picks = {policy.choose_prefill(workers, {"a": 60}, 1024, 16).worker.worker_id for _ in range(50)}
    assert picks == {"a", "b"}
    assert policy.choose_decode([view("x", running=4), view("y", running=1)]).worker_id == "y"


def test_round_robin_and_random() -> None:
    rr = make_policy("round-robin")
    workers = [view("a"), view("b"), view("c")]
    assert [rr.choose_prefill(workers, {}, 10, 16).worker.worker_id for _ in range(4)] == ["a", "b", "c", "a"]
    assert [rr.choose_decode(workers[:2]).worker_id for _ in range(3)] == ["a", "b", "a"]
    rnd = make_policy("random", seed=3)
    assert {rnd.choose_prefill(workers, {}, 10, 16).worker.worker_id for _ in range(60)} == {"a", "b", "c"}


def test_bad_policy_and_empty_pools() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("fastest")
    with pytest.raises(ValueError, match="no prefill workers"):
        make_policy("prefix").choose_prefill([], {}, 10, 16)
    with pytest.raises(ValueError, match="no decode workers"):
        make_policy("round-robin").choose_decode([])
