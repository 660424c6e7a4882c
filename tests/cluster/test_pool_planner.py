"""Adaptive disaggregation's decisions, without processes: the per-request prefill choice (cluster/routing/disagg.py)
and the pool planner's moves with their hysteresis (cluster/routing/planner.py)."""

from __future__ import annotations

import pytest

from cluster.routing.disagg import choose_prefill_path
from cluster.routing.events import WorkerLoad
from cluster.routing.planner import Member, PaceSampler, PlannerConfig, PoolPlanner, SampleWindow
from cluster.routing.policy import WorkerView, shares_compute

CONFIG = PlannerConfig(slo_ttft_s=1.0, slo_itl_s=0.040, window_s=5.0, confirm_ticks=2, min_dwell_s=5.0,
                       min_samples=4)


def view(worker_id: str, domain: str, queued: int = 0, running: int = 0, pending_prefill: int = 0) -> WorkerView:
    return WorkerView(worker_id, worker_id, WorkerLoad(num_running=running, queued_prefill_tokens=queued),
                      pending_prefill_tokens=pending_prefill, compute_domain=domain)


def member(worker_id: str, pool: str, domain: str | None = None, movable: bool = True, since: float = -100.0,
           **load: float) -> Member:
    return Member(worker_id, pool, movable, domain or f"gpu-{worker_id}", WorkerLoad(**load), since)  # type: ignore[arg-type]


# ---- the per-request choice -------------------------------------------------------------------------------------
def test_static_always_uses_the_prefill_worker_and_no_pool_means_local() -> None:
    p, d = view("p", "gpu-a", queued=10**6), view("d", "gpu-b", running=5)
    assert choose_prefill_path("static", p, d, 100, 100).remote
    path = choose_prefill_path("adaptive", None, d, 100, 100)
    assert (path.remote, path.reason) == (False, "no_prefill_worker")


def test_adaptive_prefills_locally_on_an_idle_decode_worker_and_remotely_beside_its_decodes() -> None:
    p = view("p", "gpu-a")
    idle, busy = view("d", "gpu-b"), view("d", "gpu-b", running=8)
    assert choose_prefill_path("adaptive", p, idle, 2048, 2048).reason == "cheaper_local"  # no hop, no transfer
    assert choose_prefill_path("adaptive", p, busy, 2048, 2048).reason == "cheaper_remote"  # shields its decodes


def test_adaptive_overflows_to_local_when_the_prefill_worker_is_backed_up() -> None:
    busy = view("d", "gpu-b", running=8)
    backed_up = view("p", "gpu-a", queued=32 * 2048)
    assert choose_prefill_path("adaptive", backed_up, busy, 2048, 2048).reason == "cheaper_local"
    # the router's own recent sends count before the next heartbeat reports them
    pending = view("p", "gpu-a", pending_prefill=32 * 2048)
    assert not choose_prefill_path("adaptive", pending, busy, 2048, 2048).remote


def test_adaptive_never_prefills_for_a_worker_on_the_same_compute() -> None:
    p, d = view("p", "cpu@host"), view("d", "cpu@host", running=8)
    path = choose_prefill_path("adaptive", p, d, 4096, 4096)
    assert (path.remote, path.reason) == (False, "shared_compute")


def test_tensor_parallel_workers_sharing_one_of_their_gpus_share_compute() -> None:
    """A TP2 worker names both ranks' GPUs: one on GPUs a-b and one on b-c share b; a-b and c-d share nothing."""
    assert shares_compute("gpu-a,gpu-b", "gpu-b,gpu-c") and shares_compute("gpu-b", "gpu-a,gpu-b")
    assert not shares_compute("gpu-a,gpu-b", "gpu-c,gpu-d") and not shares_compute("", "")
    path = choose_prefill_path("adaptive", view("p", "gpu-a,gpu-b"), view("d", "gpu-b,gpu-c", running=8), 4096, 4096)
    assert (path.remote, path.reason) == (False, "shared_compute")
    assert choose_prefill_path("adaptive", view("p", "gpu-a,gpu-b"), view("d", "gpu-c", running=8), 4096, 4096).remote


def test_a_prefix_cached_on_the_decode_worker_favours_local() -> None:
    p, d = view("p", "gpu-a"), view("d", "gpu-b", running=1)
    assert choose_prefill_path("adaptive", p, d, 4096, 4096).remote
    assert not choose_prefill_path("adaptive", p, d, 4096, 64).remote


# ---- the planner ------------------------------------------------------------------------------------------------
def feed(planner: PoolPlanner, now: float, ttft: float | None = None, itl: float | None = None, remote: int = 0,
         local: int = 0, n: int = 10) -> None:
    """`n` samples of each latency given, and `n` routes sharing the remote and the local prompt tokens."""
    for i in range(n):
        at = now - 1.0 + i * 0.1
        if ttft is not None:
            planner.observe_ttft(at, ttft)
        if itl is not None:
            planner.observe_itl(at, itl)
        if remote:
            planner.observe_route(at, True, remote // n)
        if local:
            planner.observe_route(at, False, local // n)


def settle(planner: PoolPlanner, members: list[Member], now: float) -> list:
    return [planner.tick(now + i * 0.01, members) for i in range(CONFIG.confirm_ticks)]


def test_a_busy_decode_pool_beside_an_idle_prefill_pool_takes_the_prefill_worker() -> None:
    planner = PoolPlanner(CONFIG)
    members = [member("p", "prefill"), member("d", "decode", num_running=20)]
    feed(planner, 10.0, ttft=0.2, itl=0.02, local=5000)
    first, second = settle(planner, members, 10.0)
    assert first is None, "one tick is not enough (hysteresis)"
    assert (second.worker_id, second.source, second.target) == ("p", "prefill", "decode")
    assert "idle" in second.reason


def test_gaps_over_the_slo_from_local_prefill_give_one_decode_worker_to_prefill() -> None:
    planner = PoolPlanner(CONFIG)
    members = [member("a", "decode", num_running=9, queued_prefill_tokens=4000),
               member("b", "decode", num_running=3, queued_prefill_tokens=2000)]
    feed(planner, 10.0, ttft=0.5, itl=0.080, local=8000)
    move = settle(planner, members, 10.0)[-1]
    assert (move.worker_id, move.target) == ("b", "prefill")  # the one with fewer running decodes
    assert "prefill locally" in move.reason


def test_ttft_over_the_slo_with_gap_headroom_grows_the_prefill_pool() -> None:
    planner = PoolPlanner(CONFIG)
    members = [member("a", "decode", num_running=4), member("b", "decode", num_running=4)]
    feed(planner, 10.0, ttft=3.0, itl=0.010, local=8000)
    move = settle(planner, members, 10.0)[-1]
    assert move is not None and move.target == "prefill" and "TTFT" in move.reason


def test_gaps_over_the_slo_from_decode_load_grow_the_decode_pool() -> None:
    planner = PoolPlanner(CONFIG)
    members = [member("p", "prefill", queued_prefill_tokens=100), member("d", "decode", num_running=200)]
    feed(planner, 10.0, ttft=0.3, itl=0.090, remote=8000)
    move = settle(planner, members, 10.0)[-1]
    assert move is not None and (move.worker_id, move.target) == ("p", "decode")


def test_a_busy_last_prefill_worker_stays_whatever_the_gaps_say() -> None:
    """Its remote prefills would land on the decode pool, break the gaps there and move it back (mixed chat + 8k
    documents on 2 x H200: a move each way within 13 s, TTFT p99 30 s)."""
    planner = PoolPlanner(CONFIG)
    members = [member("p", "prefill", busy_fraction=0.5, queued_prefill_tokens=100),
               member("d", "decode", num_running=200, busy_fraction=1.0)]
    feed(planner, 10.0, ttft=0.3, itl=0.090, remote=8000)
    assert settle(planner, members, 10.0) == [None, None]
    # a second prefill worker may go: one stays to carry the remote prefills
    members.append(member("q", "prefill", busy_fraction=0.5))
    move = settle(planner, members, 10.1)[-1]
    assert move is not None and move.target == "decode"
    # and a nearly full decode KV takes even the last one
    members = [member("p", "prefill", busy_fraction=0.5), member("d", "decode", kv_cache_usage=0.95)]
    move = settle(PoolPlanner(CONFIG), members, 20.0)[-1]
    assert move is not None and "KV" in move.reason


def test_no_move_while_the_slos_hold_and_the_pools_are_used() -> None:
    planner = PoolPlanner(CONFIG)
    members = [member("p", "prefill", queued_prefill_tokens=3000), member("d", "decode", num_running=20)]
    feed(planner, 10.0, ttft=0.4, itl=0.030, remote=8000, local=500)
    assert settle(planner, members, 10.0) == [None, None]


def test_a_few_requests_say_nothing_about_the_prefill_pool() -> None:
    planner = PoolPlanner(CONFIG)
    members = [member("p", "prefill"), member("d", "decode", num_running=3)]
    feed(planner, 10.0, ttft=0.2, itl=0.02, local=5000, n=CONFIG.min_samples - 1)  # a warm-up's worth, all local
    assert settle(planner, members, 10.0) == [None, None]


def test_pinned_recent_and_shared_compute_workers_stay() -> None:
    busy = member("d", "decode", domain="cpu@h", num_running=20)
    for prefill in (member("p", "prefill", movable=False),  # pinned (kvflow prefill)
                    member("p", "prefill", since=8.0),  # moved 2 s ago: dwell
                    member("p", "prefill", domain="cpu@h")):  # same cores as the decode worker
        planner = PoolPlanner(CONFIG)
        feed(planner, 10.0, ttft=0.2, itl=0.02, local=5000)
        assert settle(planner, [prefill, busy], 10.0) == [None, None]
    busy = member("d", "decode", domain="gpu-b,gpu-c", num_running=20)
    for prefill in (member("p", "prefill", domain="gpu-a,gpu-b"),):  # a TP2 worker sharing one of its GPUs
        planner = PoolPlanner(CONFIG)
        feed(planner, 10.0, ttft=0.2, itl=0.02, local=5000)
        assert settle(planner, [prefill, busy], 10.0) == [None, None]


def test_the_last_decode_worker_never_leaves_and_samples_before_a_move_do_not_count() -> None:
    planner = PoolPlanner(CONFIG)
    lone = [member("d", "decode", num_running=9, queued_prefill_tokens=4000)]
    feed(planner, 10.0, ttft=3.0, itl=0.010, local=8000)
    assert settle(planner, lone, 10.0) == [None, None]
    members = [member("a", "decode", num_running=9), member("b", "decode", num_running=3)]
    assert settle(planner, members, 10.0)[-1] is not None
    # right after a move, the old samples say nothing about the new layout
    assert planner.signals(10.5).ttft_p90_s is None


def test_slo_flags_are_validated() -> None:
    with pytest.raises(ValueError, match="--slo-itl-ms"):
        PoolPlanner(PlannerConfig(slo_itl_s=0.0))
    with pytest.raises(ValueError, match="--slo-ttft-ms"):
        PoolPlanner(PlannerConfig(slo_ttft_s=-1.0))


def test_pace_is_a_requests_mean_gap_per_period_so_one_long_step_does_not_read_as_a_breach() -> None:
    """25 ms steps with one 200 ms prefill chunk among them: gap by gap, 1 in 33 is over a 40 ms SLO (a p90 can
    cross it once such chunks come every few steps); the request's pace over that second is 30.3 ms, as its TPOT."""
    pace = PaceSampler(period_s=1.0)
    gaps = [0.025] * 40
    gaps[10] = 0.200
    samples = [sample for gap in gaps if (sample := pace.add(gap, 1)) is not None]
    assert samples == [pytest.approx(sum(gaps[:33]) / 33)]  # the 33rd gap fills the second
    assert samples[0] < 0.040
    assert pace.flush(min_seconds=0.5) is None  # what is left (a few gaps) says no pace
    burst = PaceSampler(period_s=1.0)
    assert burst.add(0.6, 3) is None and burst.flush(min_seconds=0.5) == pytest.approx(0.2)  # 3 tokens, one chunk
    assert burst.flush() is None  # nothing since


def test_sample_window_forgets_old_samples() -> None:
    window = SampleWindow(2.0)
    window.add(0.0, 1.0)
    window.add(1.5, 2.0)
    assert window.values(1.9) == [1.0, 2.0]
    assert window.values(3.0) == [2.0]
    assert window.values(3.0, since=2.0) == []


def test_with_measured_rates_the_choice_compares_seconds() -> None:
    def rated(worker_id: str, rate: float, queued: int = 0, running: int = 0) -> WorkerView:
        return WorkerView(worker_id, worker_id, WorkerLoad(num_running=running, queued_prefill_tokens=queued,
                                                           prefill_tokens_per_s=rate), compute_domain=f"gpu-{worker_id}")
    fast_p = rated("p", 40_000)
    # D decodes under an ITL cap: 2,000 tokens/s left for prefill -> 1 s locally vs 0.05 s + the hop remotely
    assert choose_prefill_path("adaptive", fast_p, rated("d", 2_000, running=60), 2048, 2048).reason == "faster_remote"
    # P is 4 s behind: D's slow local prefill still wins
    backed_up = rated("p", 40_000, queued=160_000)
    assert choose_prefill_path("adaptive", backed_up, rated("d", 2_000, running=60), 2048, 2048).reason == "faster_local"


def test_a_saturated_decode_pool_takes_a_mostly_idle_prefill_worker() -> None:
    planner = PoolPlanner(CONFIG)
    members = [member("p", "prefill", busy_fraction=0.1, queued_prefill_tokens=256),
               member("d", "decode", num_running=190, busy_fraction=1.0)]
    feed(planner, 10.0, ttft=0.3, itl=0.035, remote=8000)
    move = settle(planner, members, 10.0)[-1]
    assert move is not None and (move.worker_id, move.target) == ("p", "decode") and "saturated" in move.reason
    # and no second move follows within the dwell time, whatever the signals say
    members = [member("p", "decode", since=10.0), member("d", "decode", num_running=190, busy_fraction=1.0)]
    feed(planner, 12.0, ttft=3.0, itl=0.010, local=8000)
    assert settle(planner, members, 12.0) == [None, None]


def test_a_lone_decode_worker_whose_pace_breaks_beside_local_prefill_takes_the_busy_prefill_worker() -> None:
    """It has no peer to give to prefill; the replicas' layout adds a decoder (2 x H200, 2k prompts at 16 req/s
    from 1P1D: pace p90 104 ms, SLO 0.09; two replicas met it for every request)."""
    planner = PoolPlanner(CONFIG)
    members = [member("p", "prefill", busy_fraction=0.9, queued_prefill_tokens=8000),
               member("d", "decode", num_running=150, busy_fraction=1.0, queued_prefill_tokens=4000)]
    feed(planner, 10.0, ttft=0.5, itl=0.104, remote=8000, local=8000)
    move = settle(planner, members, 10.0)[-1]
    assert move is not None and (move.worker_id, move.target) == ("p", "decode")
    assert "only decode worker" in move.reason
    # an uncapped worker prefills a burst in one step, so its queue reads empty at most heartbeats: the routes say
    # it prefills locally all the same
    members[1] = member("d", "decode", num_running=150, busy_fraction=1.0)
    planner = PoolPlanner(CONFIG)
    feed(planner, 10.0, ttft=0.5, itl=0.104, remote=8000, local=8000)
    assert settle(planner, members, 10.0)[-1].worker_id == "p"
    # without local prefill the lone worker's gaps come from decode load, which the busy prefill worker's remote
    # prefills would only add to: it stays (test_a_busy_last_prefill_worker_stays_whatever_the_gaps_say)
    planner = PoolPlanner(CONFIG)
    feed(planner, 10.0, ttft=0.5, itl=0.104, remote=8000)
    assert settle(planner, members, 10.0) == [None, None]


def test_a_move_that_undoes_the_last_waits_the_reverse_dwell() -> None:
    planner = PoolPlanner(CONFIG)
    members = [member("p", "prefill", busy_fraction=0.9, queued_prefill_tokens=8000),
               member("d", "decode", num_running=150, queued_prefill_tokens=4000)]
    feed(planner, 10.0, ttft=0.5, itl=0.104, remote=8000, local=8000)
    assert settle(planner, members, 10.0)[-1] is not None  # p -> decode
    replicas = [member("p", "decode", since=10.0, num_running=80, queued_prefill_tokens=4000),
                member("d", "decode", num_running=80, queued_prefill_tokens=4000)]
    at = 10.0 + CONFIG.min_dwell_s + 1.0
    feed(planner, at, ttft=0.5, itl=0.080, local=8000)  # pace breaks beside local prefill: wants one back
    assert settle(planner, replicas, at) == [None, None]
    later = 10.0 + CONFIG.reverse_dwell_s + 1.0
    feed(planner, later, ttft=0.5, itl=0.080, local=8000)
    move = settle(planner, replicas, later)[-1]
    assert move is not None and move.target == "prefill"
