"""Routing policies: the prefix cost prefers the worker with the cached prefix unless it is overloaded; the fetch
choice pulls a long cached prefix from its holder and recomputes a short one."""

from __future__ import annotations

import pytest

from cluster.routing.disagg import PrefillPath, PrefillPathWeights, choose_fetch, fetch_transfer_cost
from cluster.routing.events import WorkerLoad
from cluster.routing.policy import CostWeights, WorkerView, decode_cost, make_policy, prefill_cost
from cluster.transfer.contract import TransferPace


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


def test_a_replica_keeps_its_conversation_unless_the_replicas_are_out_of_balance() -> None:
    """No prefill pool (SGLang's cache-aware rule): the worker caching at least 30 % of the prompt takes it, even a
    few requests busier; requests apart by more than 4 and 1.5x send it to the least loaded; below the threshold
    the cheapest by prefill cost, where this router's unreported requests count at the prompt's size each."""
    prefix = make_policy("prefix", seed=0)
    idle_pair = [view("a"), view("b")]
    assert all(prefix.choose_replica(idle_pair, {"a": 20}, 352, 16).worker.worker_id == "a" for _ in range(20))
    busier = [view("a", running=4, usage=0.6), view("b")]
    assert prefix.choose_replica(busier, {"a": 20}, 352, 16).worker.worker_id == "a"
    out_of_balance = [view("a", pending=100), view("b", running=30)]
    choice = prefix.choose_replica(out_of_balance, {"a": 20}, 352, 16)
    assert (choice.worker.worker_id, choice.matched_blocks) == ("b", 0)
    # a shared template header (40 % of a short prompt) cached on the first replica only: an idle peer gets a
    # request once the holder runs 5 more, caches the header too, and from then on the two tie on the match
    header = [view("a", running=5), view("b")]
    assert prefix.choose_replica(header, {"a": 2}, 80, 16).worker.worker_id == "b"
    assert prefix.choose_replica([view("a", running=4), view("b")], {"a": 2}, 80, 16).worker.worker_id == "a"
    many = [view("a", running=100), view("b", running=96)]  # busy replicas: the ratio keeps the affinity
    assert prefix.choose_replica(many, {"a": 20}, 352, 16).worker.worker_id == "a"
    # 2 of 22 blocks cached (under 30 %): load decides, unreported requests included
    assert prefix.choose_replica([view("a", pending=2), view("b")], {"a": 2}, 352, 16).worker.worker_id == "b"
    # reported work is in the heartbeat's numbers already: not counted twice
    reported = [view("a", running=2, pending=2), view("b", usage=0.05)]
    assert prefix.choose_replica(reported, {"a": 2}, 352, 16).worker.worker_id == "a"
    least = make_policy("least-load", seed=1)
    assert {least.choose_replica(idle_pair, {"a": 20}, 352, 16).worker.worker_id for _ in range(40)} == {"a", "b"}
    rr = make_policy("round-robin")
    assert [rr.choose_replica(idle_pair, {"a": 20}, 352, 16).worker.worker_id for _ in range(3)] == ["a", "b", "a"]
    with pytest.raises(ValueError, match="no workers"):
        prefix.choose_replica([], {}, 10, 16)
    for bad in ({"cache_threshold": 1.5}, {"balance_abs_threshold": -1}, {"balance_rel_threshold": 0.5}):
        with pytest.raises(ValueError, match="threshold"):
            CostWeights(**bad)


def test_bad_policy_and_empty_pools() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("fastest")
    with pytest.raises(ValueError, match="no prefill workers"):
        make_policy("prefix").choose_prefill([], {}, 10, 16)
    with pytest.raises(ValueError, match="no decode workers"):
        make_policy("round-robin").choose_decode([])


def rated(wid: str, rate: float, queued: int = 0) -> WorkerView:
    return WorkerView(wid, f"{wid}:1", WorkerLoad(queued_prefill_tokens=queued, prefill_tokens_per_s=rate))


def test_fetch_pulls_a_long_cached_prefix_and_recomputes_a_short_one() -> None:
    # The holder caches 1024 of a 1100-token prompt; the decode worker caches none and would prefill it all.
    holder, decode = view("a"), view("b")
    assert choose_fetch(holder, decode, False, 76, 1100, 1100, decoding=False) == PrefillPath(True, "cheaper_fetch")
    # 32 cached tokens do not pay the hop and the transfer of 1100.
    assert choose_fetch(holder, decode, False, 1068, 1100, 1100, decoding=False).remote is False
    # A busy holder loses: its queue comes first.
    assert choose_fetch(view("a", queued=4000), decode, False, 76, 1100, 1100, decoding=False).remote is False


def test_fetch_in_seconds_weighs_the_transfer_against_the_recompute() -> None:
    weights = PrefillPathWeights(fetch_transfer_cost=0.5)
    # 1000 cached tokens save 1 s at 1000 tok/s; shipping 1100 costs 0.55 s of recompute plus the hop.
    choice = choose_fetch(rated("a", 1000), rated("b", 1000), False, 100, 1100, 1100, False, weights)
    assert choice == PrefillPath(True, "faster_fetch")
    # Against a remote plan that ships too, a holder twice as slow still wins: 200 tokens at 500/s vs 1100 at 1000/s.
    assert choose_fetch(rated("a", 500), rated("p", 1000), True, 200, 1100, 1100, False, weights).remote
    # A transfer as dear as half the recompute, with only 100 tokens cached: recompute.
    assert choose_fetch(rated("a", 1000), rated("b", 1000), False, 1000, 1100, 1100, False, weights) == \
        PrefillPath(False, "faster_recompute")
    with pytest.raises(ValueError, match="fetch_transfer_cost"):
        PrefillPathWeights(fetch_transfer_cost=1.0)


def test_a_measured_link_prices_the_fetch_transfer() -> None:
    """The decode worker's pulls measured 0.2 ms of wire time per token; the holder prefills 1,000 tok/s: a shipped
    token costs 0.2 tokens of its recompute, not the 0.1 default. A slow link (0.9 ms/token) turns the fetch down."""
    holder = rated("a", 1000)
    unmeasured = rated("b", 1000)
    measured = WorkerView("b", "b:1", WorkerLoad(prefill_tokens_per_s=1000, kv_receive_s_per_token=2e-4))
    assert fetch_transfer_cost(unmeasured, holder) == PrefillPathWeights().fetch_transfer_cost
    assert fetch_transfer_cost(measured, holder) == pytest.approx(0.2)
    assert fetch_transfer_cost(measured, rated("a", 0.0)) == 0.1  # the holder's rate unknown: the default
    slow = WorkerView("b", "b:1", WorkerLoad(prefill_tokens_per_s=1000, kv_receive_s_per_token=0.05))
    assert fetch_transfer_cost(slow, holder) == 0.99  # capped below the recompute
    # 600 of 1100 tokens cached on the holder: fetch at the default cost, recompute over a link at 0.9 ms/token
    assert choose_fetch(holder, unmeasured, False, 500, 1100, 1100, False).remote
    assert not choose_fetch(holder, unmeasured, False, 500, 1100, 1100, False, transfer_cost=0.9).remote


def test_the_transfer_pace_averages_pulls_that_moved_blocks() -> None:
    pace = TransferPace(weight=0.5)
    assert pace.seconds_per_token == 0.0
    pace.observe(0, 1.0)  # nothing moved (every block cached here): says nothing
    pace.observe(100, 0.0)
    assert pace.seconds_per_token == 0.0
    pace.observe(1000, 0.002)  # the first pull sets it
    assert pace.seconds_per_token == pytest.approx(2e-6)
    pace.observe(1000, 0.004)  # then each moves it halfway
    assert pace.seconds_per_token == pytest.approx(3e-6)
    with pytest.raises(ValueError, match="weight"):
        TransferPace(weight=0.0)

