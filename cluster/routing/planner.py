"""The pool planner: moves role-free workers between the prefill and the decode pool, in seconds, from what the router
measures (TTFT and inter-token pace against the SLO) and what the workers report (queued prefill tokens, KV usage).

The pace ("gaps" below) is what the SLO's TPOT counts: each request's mean gap per token over about a second of its
stream (`PaceSampler`), not each gap alone. One long step (a prefill chunk beside the decodes) then weighs as its
share of the requests' pace: on 4 x H200 under a prefill flood, four replicas met the TPOT SLO for every request
(TPOT p99 26 ms) with a gap p99 of 89 ms, and gap p90s over 40 ms had sent adaptive's planner out of its 2P2D
layout (SLO 0.98 static) back to 1P3D (0.26).

A worker in the prefill pool gets no new decodes; one in the decode pool decodes and prefills what the per-request
choice (cluster/routing/disagg.py) leaves it. A move only changes where new work is routed: the worker's running
decodes finish where they are and its KV transfers complete, so nothing restarts and no request fails.

Rules, checked each tick (`--slo-ttft-ms`, `--slo-itl-ms`):
- to decode: the decode pool's KV is nearly full; or inter-token gaps break the SLO while no decode worker prefills
  locally (decode capacity is short); or the prefill pool idles (it got under 10 % of the window's routed prompt
  tokens and queues nothing) while the decode pool has work; or the prefill pool is mostly idle (busy under half
  the time) while the decode pool is saturated (busy over 90 %) and gaps near the SLO;
- to prefill (with at least two decode workers): gaps break the SLO while decode workers prefill locally (one
  worker prefilling for the others shields them); or TTFT breaks the SLO while gaps have headroom.
The prefill pool's last worker leaves only when it is mostly idle (`last_prefill_busy`) or idle by share, or the
decode KV is nearly full: its remote prefills would otherwise land on the decode pool. Or when the decode pool is a
single worker whose pace breaks while it prefills locally: it has no peer to give to prefill, and the replicas'
layout adds a decoder.
Hysteresis: a move must be wanted on `confirm_ticks` consecutive ticks, no move follows another within
`min_dwell_s`, a move that undoes the previous one waits `reverse_dwell_s`, and after a move only samples taken
since count. A move never empties the decode pool, never touches a pinned worker, and never puts a worker in a pool
whose members share its compute (that adds no capacity).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from cluster.routing.events import WorkerLoad
from cluster.routing.policy import shares_compute

POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class PlannerConfig:
    slo_ttft_s: float = 1.0
    slo_itl_s: float = 0.040
    window_s: float = 5.0  # latency samples older than this are forgotten
    confirm_ticks: int = 2  # ticks in a row a move must be wanted
    min_dwell_s: float = 5.0  # a moved worker stays this long in its new pool
    min_samples: int = 16  # fewer latency samples (or routed requests) than this: no opinion
    itl_headroom: float = 0.8  # gaps under this share of the SLO leave room for more local prefill
    idle_remote_share: float = 0.1  # the prefill pool got less than this share of routed prompt tokens: idle
    saturated_kv_usage: float = 0.9
    idle_busy: float = 0.5  # a pool busy less than this share of the time has capacity to give
    # The prefill pool's last worker leaves (but for a full decode KV) only when it is busy less than this share of
    # the time or idle by share: its remote prefills would otherwise land on the decode pool, whose gaps then break
    # the SLO and move it back (measured: a move each way within 13 s, TTFT p99 30 s, on mixed chat + 8k documents).
    last_prefill_busy: float = 0.25
    saturated_busy: float = 0.9
    # A move that undoes the previous one waits this long: the two rules that can want a lone decode worker's
    # layout and the replicas' layout each would otherwise flip the pools every `min_dwell_s`.
    reverse_dwell_s: float = 30.0

    def validate(self) -> None:
        if not self.slo_ttft_s > 0:
            raise ValueError(f"--slo-ttft-ms must be > 0, got {self.slo_ttft_s * 1000:g}")
        if not self.slo_itl_s > 0:
            raise ValueError(f"--slo-itl-ms must be > 0, got {self.slo_itl_s * 1000:g}")


@dataclass(frozen=True, slots=True)
class Member:
    """The planner's view of one worker."""

    worker_id: str
    pool: str
    movable: bool  # role-free and healthy
    compute_domain: str
    load: WorkerLoad
    since: float  # monotonic time it entered its pool


@dataclass(frozen=True, slots=True)
class Move:
    worker_id: str
    source: str
    target: str
    reason: str


@dataclass(frozen=True, slots=True)
class Signals:
    ttft_p90_s: float | None
    itl_p90_s: float | None
    routed_requests: int
    remote_share: float  # of routed prompt tokens, prefilled on the prefill pool


class PaceSampler:
    """One request's pace: its mean gap per token over each `period_s` of its stream (one sample per period, and
    the remainder at its end), the planner's ITL samples."""

    def __init__(self, period_s: float = 1.0) -> None:
        self.period_s = period_s
        self._seconds = 0.0
        self._tokens = 0

    def add(self, seconds: float, num_tokens: int) -> float | None:
        """A chunk of `num_tokens` that came `seconds` after the previous one; the period's mean gap per token once
        the period is full, else None."""
        self._seconds += seconds
        self._tokens += num_tokens
        return self.flush() if self._seconds >= self.period_s else None

    def flush(self, min_seconds: float = 0.0) -> float | None:
        """The unreported rest's mean gap per token (None: nothing since the last sample, or a rest shorter than
        `min_seconds`, too few gaps to say a pace)."""
        if self._tokens == 0 or self._seconds < min_seconds:
            return None
        pace = self._seconds / self._tokens
        self._seconds, self._tokens = 0.0, 0
        return pace


class SampleWindow:
    """Timestamped samples of the last `window_s` seconds (one thread: the router's event loop)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, now: float, value: float) -> None:
        self._samples.append((now, value))
        self._trim(now)

    def values(self, now: float, since: float = -math.inf) -> list[float]:
        self._trim(now)
        return [v for t, v in self._samples if t >= since]

    def _trim(self, now: float) -> None:
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()


def _mean_busy(members: Sequence[Member]) -> float:
    return sum(m.load.busy_fraction for m in members) / len(members)


def quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


class PoolPlanner:
    def __init__(self, config: PlannerConfig) -> None:
        config.validate()
        self.config = config
        self._ttft = SampleWindow(config.window_s)
        self._itl = SampleWindow(config.window_s)
        self._remote_tokens = SampleWindow(config.window_s)  # value: tokens prefilled remotely
        self._local_tokens = SampleWindow(config.window_s)
        self._last_move_at = -math.inf
        self._last_move: Move | None = None
        self._wanted: Move | None = None
        self._streak = 0

    # ---- what the router measures ------------------------------------------------------------------------
    def observe_ttft(self, now: float, seconds: float) -> None:
        self._ttft.add(now, seconds)

    def observe_itl(self, now: float, seconds: float) -> None:
        """One request's pace sample (`PaceSampler`): seconds per token."""
        self._itl.add(now, seconds)

    def observe_route(self, now: float, remote: bool, prompt_tokens: int) -> None:
        (self._remote_tokens if remote else self._local_tokens).add(now, prompt_tokens)

    def signals(self, now: float) -> Signals:
        since = self._last_move_at
        ttft, itl = self._ttft.values(now, since), self._itl.values(now, since)
        remote_routes, local_routes = self._remote_tokens.values(now, since), self._local_tokens.values(now, since)
        remote, local = sum(remote_routes), sum(local_routes)
        enough = self.config.min_samples
        return Signals(quantile(ttft, 0.9) if len(ttft) >= enough else None,
                       quantile(itl, 0.9) if len(itl) >= enough else None,
                       len(remote_routes) + len(local_routes), remote / (remote + local) if remote + local else 0.0)

    # ---- the decision ------------------------------------------------------------------------------------
    def tick(self, now: float, members: Sequence[Member]) -> Move | None:
        """The move to make now, if one has been wanted `confirm_ticks` ticks in a row (then it counts as made)."""
        if now - self._last_move_at < self.config.min_dwell_s:
            return None
        wanted = self._want(self.signals(now), members, now)
        if wanted is not None and self._undoes_last(wanted, now):
            wanted = None
        if wanted is None or wanted != self._wanted:
            self._wanted, self._streak = wanted, 1 if wanted is not None else 0
        else:
            self._streak += 1
        if wanted is None or self._streak < self.config.confirm_ticks:
            return None
        self._wanted, self._streak, self._last_move_at, self._last_move = None, 0, now, wanted
        return wanted

    def _undoes_last(self, move: Move, now: float) -> bool:
        last = self._last_move
        return (last is not None and now - self._last_move_at < self.config.reverse_dwell_s
                and (move.source, move.target) == (last.target, last.source))

    def _want(self, signals: Signals, members: Sequence[Member], now: float) -> Move | None:
        prefill = [m for m in members if m.pool == "prefill"]
        decode = [m for m in members if m.pool == "decode"]
        reason = self._to_decode_reason(signals, prefill, decode)
        if reason is not None:
            move = self._pick(prefill, decode, "decode", reason, now, key=lambda m: m.load.queued_prefill_tokens)
            if move is not None:
                return move
        reason = self._to_prefill_reason(signals, decode)
        if reason is not None and len(decode) >= 2:
            return self._pick(decode, prefill, "prefill", reason, now, key=lambda m: m.load.num_running,
                              keep=decode)
        return None

    def _to_decode_reason(self, s: Signals, prefill: list[Member], decode: list[Member]) -> str | None:
        c = self.config
        if not prefill or not decode:
            return None
        if all(m.load.kv_cache_usage >= c.saturated_kv_usage for m in decode):
            return "decode pool KV cache nearly full"
        idle = s.routed_requests >= c.min_samples and s.remote_share < c.idle_remote_share
        locally = self._prefills_locally(s, decode)
        if len(decode) == 1 and locally and s.itl_p90_s is not None and s.itl_p90_s > c.slo_itl_s:
            # The only decode worker's pace breaks beside its local prefill, and it has no peer to give to the
            # prefill pool: the replicas' layout adds a decoder (2 x H200, 2k prompts at 16 req/s from 1P1D:
            # pace p90 104 ms, SLO 0.09, while two replicas met it for every request).
            return (f"pace p90 {s.itl_p90_s * 1000:.0f} ms/token over the {c.slo_itl_s * 1000:.0f} ms SLO on the "
                    "only decode worker, which prefills locally")
        if len(prefill) == 1 and _mean_busy(prefill) >= c.last_prefill_busy and not idle:
            return None
        if s.itl_p90_s is not None and s.itl_p90_s > c.slo_itl_s and not locally:
            return f"pace p90 {s.itl_p90_s * 1000:.0f} ms/token over the {c.slo_itl_s * 1000:.0f} ms SLO from decode load"
        busy = any(m.load.num_running > 0 for m in decode)
        if busy and idle and all(m.load.queued_prefill_tokens == 0 for m in prefill):
            return f"prefill pool idle ({s.remote_share:.0%} of prompt tokens)"
        prefill_busy, decode_busy = _mean_busy(prefill), _mean_busy(decode)
        near_slo = s.itl_p90_s is not None and s.itl_p90_s > c.itl_headroom * c.slo_itl_s
        if prefill_busy < c.idle_busy and decode_busy > c.saturated_busy and near_slo:
            return (f"decode pool saturated ({decode_busy:.0%} busy, pace p90 {s.itl_p90_s * 1000:.0f} ms/token) "
                    f"beside a prefill pool {prefill_busy:.0%} busy")
        return None

    def _prefills_locally(self, s: Signals, decode: list[Member]) -> bool:
        """The decode pool prefills locally: a worker reports queued prompt tokens, or the window's routes left it
        at least `idle_remote_share` of the prompt tokens. The routes count too: an uncapped worker prefills a
        burst of prompts in one step, so its queue reads empty at most heartbeats (2 x H200, 2k prompts at
        16 req/s from 1P1D: half the prompts prefilled locally, the pace p90 at 104 ms read as decode load)."""
        c = self.config
        routed_locally = s.routed_requests >= c.min_samples and 1.0 - s.remote_share >= c.idle_remote_share
        return routed_locally or any(m.load.queued_prefill_tokens > 0 for m in decode)

    def _to_prefill_reason(self, s: Signals, decode: list[Member]) -> str | None:
        c = self.config
        locally = self._prefills_locally(s, decode)
        if s.itl_p90_s is not None and s.itl_p90_s > c.slo_itl_s and locally:
            return (f"pace p90 {s.itl_p90_s * 1000:.0f} ms/token over the {c.slo_itl_s * 1000:.0f} ms SLO while "
                    "decode workers prefill locally")
        headroom = s.itl_p90_s is None or s.itl_p90_s <= c.itl_headroom * c.slo_itl_s
        if s.ttft_p90_s is not None and s.ttft_p90_s > c.slo_ttft_s and headroom:
            return (f"TTFT p90 {s.ttft_p90_s * 1000:.0f} ms over the {c.slo_ttft_s * 1000:.0f} ms SLO with "
                    "inter-token headroom")
        return None

    def _pick(self, source: list[Member], target: list[Member], target_pool: str, reason: str, now: float,
              key: object, keep: list[Member] | None = None) -> Move | None:
        """The movable member of `source` (least `key` first) that shares compute with no member of `target`
        (nor, when moving out of the decode pool, with a decode worker that stays)."""
        for m in sorted(source, key=key):  # type: ignore[arg-type]
            if not m.movable or now - m.since < self.config.min_dwell_s:
                continue
            others = [t for t in [*target, *(keep or [])] if t is not m]
            if any(shares_compute(m.compute_domain, t.compute_domain) for t in others):
                continue
            return Move(m.worker_id, m.pool, target_pool, reason)
        return None
