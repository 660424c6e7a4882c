"""The per-request prefill choice: prefill remotely on a prefill-pool worker (its KV then moves to the decode worker)
or locally on the decode worker itself.

`static` is the fixed split: every request whose decode worker has a prefill worker to pull from does so (the decode
worker still prefills locally below its --disagg-min-prompt-tokens). `adaptive` weighs what each path would wait
for, in seconds where both workers report their prefill rate (`prefill_tokens_per_s`: their step-time model's, for
a prompt admitted now, so D's counts its decodes and the --itl-target-ms cap on its chunks):

    remote = (queued prefill tokens on P + the prompt's tokens P has not cached) / P's rate + the hop and transfer
    local  = (queued prefill tokens on D + the prompt's tokens D has not cached) / D's rate

and in prompt tokens otherwise, with D's local prefill taken at half speed while it decodes. A prefill worker that
shares D's compute (the same GPU, or the same host's cores) is never used for D: prefilling there adds no
capacity, only the transfer.

The fetch (`choose_fetch`): when another worker H (one that serves `Prefill`) caches more leading blocks of the
prompt than the planned prefiller, the decode worker may pull them from H instead of recomputing them: H prefills
the prompt, which computes only its tail past H's cached blocks (loaded back first if they are in H's host tier),
and ships every block the decode worker lacks, cached ones included, leased on H until exported (the Prefill RPC).
The same weighing decides it, H in place of the prefill worker, plus the transfer of the shipped tokens
(`fetch_transfer_cost` of their recompute each: the decode worker's measured wire time per received token times H's
prefill rate, once both are reported). A shared compute domain does not rule it out: the fetch saves the
cached tokens' compute, wherever the tail runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.routing.policy import WorkerView, shares_compute

DISAGG_POLICIES = ("static", "adaptive")
MAX_TRANSFER_COST = 0.99  # a measured transfer cost is capped here (fetch_transfer_cost)


@dataclass(frozen=True)
class PrefillPathWeights:
    # Local prefill on a decoding worker shares its steps with the decodes: taken at about half its speed.
    local_slowdown_while_decoding: float = 2.0
    # The extra RPC hop, the KV transfer and the first token's relay, in prompt tokens of prefill time (the 1k-token
    # TTFT measured 1.19x local on H100: ~190 tokens).
    remote_overhead_tokens: int = 192
    remote_overhead_s: float = 0.006  # the same, measured: 39.1 vs 32.9 ms TTFT at 1k tokens
    # A shipped token's transfer over its recompute, for the fetch, until the decode worker has measured its pulls
    # (fetch_transfer_cost): NVLink moves a Llama-8B token's KV in ~1 % of its H100 prefill time, gRPC bytes on a
    # CPU pair in ~2 % of SmolLM2's.
    fetch_transfer_cost: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 <= self.fetch_transfer_cost < 1.0:
            raise ValueError(f"fetch_transfer_cost must be in [0, 1), got {self.fetch_transfer_cost}")


@dataclass(frozen=True, slots=True)
class PrefillPath:
    remote: bool
    reason: str  # label of kvflow:prefill_path_decisions_total


def choose_prefill_path(policy: str, prefill: WorkerView | None, decode: WorkerView, remote_uncached: int,
                        local_uncached: int, weights: PrefillPathWeights = PrefillPathWeights()) -> PrefillPath:
    """Where the prompt is prefilled. `remote_uncached` / `local_uncached`: its tokens not cached on the prefill /
    the decode worker."""
    if prefill is None:
        return PrefillPath(False, "no_prefill_worker")
    if policy == "static":
        return PrefillPath(True, "static")
    if shares_compute(prefill.compute_domain, decode.compute_domain):
        return PrefillPath(False, "shared_compute")
    remote_rate, local_rate = prefill.load.prefill_tokens_per_s, decode.load.prefill_tokens_per_s
    if remote_rate > 0 and local_rate > 0:
        remote_s = (prefill.queued_prefill_tokens + remote_uncached) / remote_rate + weights.remote_overhead_s
        local_s = (decode.queued_prefill_tokens + local_uncached) / local_rate
        return PrefillPath(True, "faster_remote") if remote_s < local_s else PrefillPath(False, "faster_local")
    remote = prefill.queued_prefill_tokens + remote_uncached + weights.remote_overhead_tokens
    decoding = decode.load.num_running > 0 or decode.pending_requests > 0
    slowdown = weights.local_slowdown_while_decoding if decoding else 1.0
    local = (decode.queued_prefill_tokens + local_uncached) * slowdown
    return PrefillPath(True, "cheaper_remote") if remote < local else PrefillPath(False, "cheaper_local")


def fetch_transfer_cost(decode: WorkerView, holder: WorkerView,
                        weights: PrefillPathWeights = PrefillPathWeights()) -> float:
    """A shipped token's transfer in tokens of the holder's recompute: the decode worker's measured wire seconds
    per received token times the holder's prefill rate, once both are known (capped below 1: a transfer that
    costs as much as the recompute is never chosen over it anyway); `weights.fetch_transfer_cost` until then."""
    seconds, rate = decode.load.kv_receive_s_per_token, holder.load.prefill_tokens_per_s
    if seconds > 0 and rate > 0:
        return min(seconds * rate, MAX_TRANSFER_COST)
    return weights.fetch_transfer_cost


def choose_fetch(holder: WorkerView, planned: WorkerView, planned_remote: bool, holder_uncached: float,
                 planned_uncached: float, shipped_tokens: int, decoding: bool,
                 weights: PrefillPathWeights = PrefillPathWeights(), transfer_cost: float | None = None
                 ) -> PrefillPath:
    """Prefill on `holder` (it caches more of the prompt) and ship to the decode worker (remote True), or keep the
    plan: `planned` prefills `planned_uncached` tokens, remotely (shipping too) or on the decode worker itself,
    which is `decoding` already. `*_uncached`: the tokens each would compute (host-tier loads counted at their
    reload cost); `shipped_tokens`: the prompt tokens the decode worker does not cache; `transfer_cost`: a shipped
    token's transfer in tokens of recompute (`fetch_transfer_cost`; None: the weights' default)."""
    per_token = weights.fetch_transfer_cost if transfer_cost is None else transfer_cost
    transfer = shipped_tokens * per_token  # in tokens of recompute
    holder_rate, planned_rate = holder.load.prefill_tokens_per_s, planned.load.prefill_tokens_per_s
    if holder_rate > 0 and planned_rate > 0:
        fetch_s = (holder.queued_prefill_tokens + holder_uncached + transfer) / holder_rate + weights.remote_overhead_s
        plan_s = (planned.queued_prefill_tokens + planned_uncached) / planned_rate
        if planned_remote:
            plan_s += transfer / planned_rate + weights.remote_overhead_s
        return PrefillPath(True, "faster_fetch") if fetch_s < plan_s else PrefillPath(False, "faster_recompute")
    fetch = holder.queued_prefill_tokens + holder_uncached + transfer + weights.remote_overhead_tokens
    plan = planned.queued_prefill_tokens + planned_uncached
    if planned_remote:
        plan += transfer + weights.remote_overhead_tokens
    elif decoding:
        plan *= weights.local_slowdown_while_decoding
    return PrefillPath(True, "cheaper_fetch") if fetch < plan else PrefillPath(False, "cheaper_recompute")
