"""The host KV tier (--kv-offloading-size, engine/core/host_tier.py): blocks evicted from a small device cache are
copied to a second (host) pool on the CPU engine and loaded back on a later prefix hit. Greedy output equals the
engine without the tier; the hit counts say the reload happened; the KV events always describe what the worker can
serve; the tier's LRU and its refusals."""

from __future__ import annotations

import random

import pytest
import torch

from engine.arg_utils import EngineArgs
from engine.core.block_pool import BlockRemoved, BlockStored, KVTier
from engine.core.host_tier import HostKVTier
from engine.llm_engine import LLMEngine
from engine.outputs import SchedulerOutput
from engine.parallel import codec
from engine.runner.kv_cache import KVCacheSpec
from engine.runner.kv_tier import KVTierCopier, _layers, _runs, _slot_spans
from engine.sampling_params import SamplingParams

BLOCK = 16
TINY_BLOCK_BYTES = BLOCK * 2 * 2 * 2 * 16 * 4  # tokens x (K, V) x layers x KV heads x head_dim x fp32
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def make_engine(host_blocks: int = 0, events: bool = False) -> LLMEngine:
    """The tiny model with 11 usable device blocks: three 72-token requests evict a fourth's prefix."""
    size = host_blocks * TINY_BLOCK_BYTES / 2**30 if host_blocks else None
    args = EngineArgs(model="tiny", device="cpu", num_gpu_blocks_override=12, max_model_len=160,
                      kv_offloading_size=size)
    return LLMEngine(args.create_engine_config(), enable_kv_events=events)


def generate(engine: LLMEngine, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy token ids and the prompt tokens that were not computed (num_cached_tokens)."""
    request_id = engine.add_request(None, {"prompt_token_ids": prompt}, GREEDY)
    for _ in range(1000):
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return list(output.outputs[0].token_ids), output.num_cached_tokens
    raise AssertionError("request never finished")


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(64)] for _ in range(count)]


def test_reload_after_eviction_gives_identical_greedy_output() -> None:
    first, *fillers = prompts(4)
    plain, tiered = make_engine(), make_engine(host_blocks=64)
    runs = {}
    for name, engine in (("plain", plain), ("tiered", tiered)):
        runs[name] = [generate(engine, p) for p in (first, *fillers, first)]
    assert [ids for ids, _ in runs["plain"]] == [ids for ids, _ in runs["tiered"]]
    assert runs["plain"][-1][0] == runs["plain"][0][0]  # the repeat equals the first run
    assert runs["plain"][-1][1] == 0  # without the tier the evicted prefix is recomputed ...
    assert runs["tiered"][-1][1] == 48  # ... with it, 3 blocks (the last token is always computed) load back
    stats = tiered.stats
    assert stats.external_prefix_cache_hits == 48
    assert stats.external_prefix_cache_queries == 5 * 64
    assert stats.kv_offloaded_blocks >= 3 and plain.stats.kv_offloaded_blocks == 0
    assert plain.stats.external_prefix_cache_hits == 0 and plain.stats.external_prefix_cache_queries == 0
    assert tiered.runner.kv_tier is not None and tiered.runner.kv_tier.copy_seconds_per_block > 0


def _apply(mirror: dict[bytes, KVTier], events: list) -> None:
    for event in events:
        for block_hash in event.block_hashes:
            if isinstance(event, BlockStored):
                mirror[block_hash] = event.tier
            else:
                assert isinstance(event, BlockRemoved)
                mirror.pop(block_hash)  # removing a block never advertised would be an error too


def test_events_advertise_exactly_what_the_worker_can_serve() -> None:
    engine = make_engine(host_blocks=4, events=True)  # a host tier smaller than the traffic: it evicts too
    pool, tier = engine.kv_manager.pool, engine.kv_manager.host_tier
    assert tier is not None
    mirror: dict[bytes, KVTier] = {}
    moved = removed = 0
    traffic = prompts(6, seed=1)
    for prompt in [*traffic, traffic[3], traffic[0]]:  # one recently evicted prefix, one long gone
        generate(engine, prompt)
        events = pool.take_events()
        moved += sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored) and e.tier is KVTier.HOST)
        removed += sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved))
        _apply(mirror, events)
        expected = {h: KVTier.HOST for h in tier.hashes()} | {h: KVTier.DEVICE for h in pool.cached}
        assert mirror == expected
    assert moved > 0 and removed > 0 and len(tier) == 4
    # every removal here is a full tier letting a block go (some drops leave a copy on the device: no event)
    assert engine.stats.kv_host_dropped_blocks >= removed
    assert engine.stats.external_prefix_cache_hits > 0  # the repeated prompts found some blocks on the host


def test_host_tier_is_lru_and_never_reuses_a_protected_slot() -> None:
    tier = HostKVTier(2)
    a, b, c, d = (bytes([i]) * 4 for i in range(4))
    assert tier.store(a).slot is not None and tier.store(b).slot is not None
    assert tier.store(a).slot is None  # already held: nothing to copy
    assert tier.lookup(a) is not None  # a is now the most recently used
    stored = tier.store(c)
    assert stored.dropped == b and b not in tier and tier.lookup(c) == stored.slot
    tier.protect([tier.lookup(a), tier.lookup(c)])
    assert tier.store(d).dropped == d and d not in tier  # every slot is being read: d is dropped instead
    tier.unprotect()
    assert tier.store(d).dropped == a  # least recently used first
    with pytest.raises(ValueError, match="at least 1 block"):
        HostKVTier(0)


def test_a_reserved_slot_is_kept_until_released_and_reservations_hold_half_the_tier() -> None:
    tier = HostKVTier(4)
    a, b, c, d, e, f = (bytes([i]) * 4 for i in range(6))
    for block_hash in (a, b, c, d):
        tier.store(block_hash)
    assert tier.max_reserved == 2
    slots = tier.reserve([a, b, c, e])  # e is not held: skipped; c would pass the cap
    assert slots == [tier.lookup(a), tier.lookup(b)] and tier.num_reserved == 2
    assert tier.reserve([a]) == [tier.lookup(a)]  # a second waiting request sharing the prefix
    assert tier.store(e).dropped not in (a, b) and tier.store(f).dropped not in (a, b)  # c and d go instead
    assert a in tier and b in tier
    tier.release(slots)
    assert tier.num_reserved == 1  # a: still reserved by the second request
    tier.release([tier.lookup(a)])
    assert tier.num_reserved == 0
    tier.lookup(e), tier.lookup(f)  # a and b are now the least recently used: the next stores drop them
    assert tier.store(c).dropped in (a, b)


def _wait_behind_a_filler(reserve: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], int]:
    """One conversation's prefix evicted to the host tier; then a long filler and the conversation's next turn
    arrive together: max_num_seqs=1, so the turn waits while the filler's blocks evict into a full tier."""
    if not reserve:
        monkeypatch.setattr(HostKVTier, "reserve", lambda self, hashes: [])
    size = 8 * TINY_BLOCK_BYTES / 2**30
    args = EngineArgs(model="tiny", device="cpu", num_gpu_blocks_override=12, max_model_len=160,
                      kv_offloading_size=size, max_num_seqs=1)
    engine = LLMEngine(args.create_engine_config())
    first, *fillers = prompts(5, seed=4)
    for prompt in (first, *fillers[:3]):
        generate(engine, prompt)
    tier = engine.kv_manager.host_tier
    assert tier is not None and all(h in tier for h in engine.kv_manager.hasher.hash_blocks(first)[:3])
    long_filler = SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True)
    engine.add_request("filler", {"prompt_token_ids": fillers[3]}, long_filler)
    turn = engine.add_request("turn", {"prompt_token_ids": first + [9] * 8}, GREEDY)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    assert tier.num_reserved == 0  # released at admission
    return list(outputs[turn].outputs[0].token_ids), outputs[turn].num_cached_tokens


def test_a_waiting_turn_keeps_its_host_prefix_while_other_requests_evict(monkeypatch: pytest.MonkeyPatch) -> None:
    """The router predicted the turn's prefix on this worker's host tier: reserved on arrival, it survives the
    filler's evictions and loads back; without the reservation LRU dropped it (a false hit, recomputed)."""
    ids, cached = _wait_behind_a_filler(True, monkeypatch)
    with monkeypatch.context() as patched:
        ids_off, cached_off = _wait_behind_a_filler(False, patched)
    assert cached == 64 and cached_off < cached
    assert ids == ids_off  # the same greedy tokens either way


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(kv_offloading_size=-1.0), "positive number of GiB"),
    (dict(kv_offloading_size=float("nan")), "positive number of GiB"),
    (dict(kv_offloading_backend="native"), "needs --kv-offloading-size"),
    (dict(kv_offloading_size=1.0, kv_offloading_backend="lmcache"), "'lmcache' is not supported"),
    (dict(kv_offloading_size=1.0, kv_offloading_backend="disk"), "must be 'native'"),
    (dict(kv_offloading_size=1.0, enable_prefix_caching=False), "needs prefix caching"),
    (dict(kv_offloading_size=1.0, tensor_parallel_size=2), "tensor-parallel-size 2 is not supported"),
    (dict(kv_offloading_size=1.0, speculative_config={"model": "tiny", "num_speculative_tokens": 2}),
     "draft-model"),
])
def test_bad_offloading_arguments_are_refused_by_name(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineArgs(model="tiny", **kwargs).validate_kv_offloading()


def test_a_size_below_one_block_is_refused() -> None:
    with pytest.raises(ValueError, match="holds no KV block"):
        make_engine(host_blocks=0.5)  # type: ignore[arg-type]


def test_remote_admission_loads_host_blocks_before_a_transport_can_write() -> None:
    """The decode side of P/D: a remote admission's host hits are loaded (and its evictions saved) at once, not
    at the next step, since a KV transport writes into the reserved blocks before that."""
    engine = make_engine(host_blocks=64)
    first, *fillers = prompts(4, seed=2)
    for prompt in (first, *fillers):
        generate(engine, prompt)
    tier = engine.kv_manager.host_tier
    assert tier is not None and all(h in tier for h in engine.kv_manager.hasher.hash_blocks(first)[:4])
    host_k = engine.runner.kv_tier.host_caches[0][0]
    slots = [tier.lookup(h) for h in engine.kv_manager.hasher.hash_blocks(first)[:4]]
    slot = engine.add_remote_prefill_request("remote", first + [7] * 16, SamplingParams(max_tokens=2))
    assert slot is not None and slot.num_cached_blocks == 4
    assert engine.kv_manager.take_tier_copies() == []  # nothing left for the next step
    device_k = engine.runner.kv_caches[0][0]
    for host_slot, block_id in zip(slots, slot.block_ids[:4], strict=True):
        assert torch.equal(device_k[block_id], host_k[host_slot])


def test_step_codec_carries_the_tier_copies() -> None:
    so = SchedulerOutput([], [], 0, kv_tier_copies=[(True, 3, 0), (False, 0, 5)])
    assert codec.decode(codec.encode(so)).kv_tier_copies == so.kv_tier_copies


def test_gpu_transfers_join_only_consecutive_host_slots_in_order() -> None:
    assert _slot_spans([4, 5, 6, 9, 2, 3, 7]) == [(4, 3, 0), (9, 1, 3), (2, 2, 4), (7, 1, 6)]
    assert _slot_spans([]) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_the_gpu_staged_copies_move_the_same_bytes_as_the_cpu_path(dtype: torch.dtype) -> None:
    """The CUDA path (a staging buffer of 2 blocks, so runs go in chunks; one transfer per run of consecutive host
    slots), run on CPU tensors and, on a GPU machine, through `run` on CUDA caches, against the CPU path's
    per-layer gathers; fp8 moves as bytes."""
    spec = KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    torch.manual_seed(0)
    start = [(torch.randn(12, 4, 2, 8).to(dtype), torch.randn(12, 4, 2, 8).to(dtype)) for _ in range(2)]
    copies = [(True, 3, 0), (True, 4, 1), (True, 8, 2), (False, 0, 10), (False, 1, 11), (True, 9, 0),
              (False, 2, 5), (False, 0, 6), (False, 1, 7)]
    results = []
    for staged in (False, True):
        device = [(k.clone(), v.clone()) for k, v in start]
        copier = KVTierCopier(spec.allocate_host_pool(6, pin=False), (4, 2, 8), torch.device("cpu"), stage_blocks=2)
        if staged:
            for run in _runs(copies):
                copier._copy_run_staged(run, _layers(device))
        else:
            copier.run(copies, device)
        results.append((device, copier.host_caches))
    if torch.cuda.is_available():  # on a GPU machine, the real thing too: CUDA caches, a pinned pool, its stream
        cuda = torch.device("cuda")
        device = [(k.to(cuda), v.to(cuda)) for k, v in start]
        copier = KVTierCopier(spec.allocate_host_pool(6, pin=True), (4, 2, 8), cuda, stage_blocks=2)
        copier.run(copies, device)
        torch.cuda.synchronize()
        results.append(([(k.cpu(), v.cpu()) for k, v in device], copier.host_caches))
    (dev_a, host_a), *others = results
    for dev_b, host_b in others:
        for a, b in zip([*dev_a, *host_a], [*dev_b, *host_b], strict=True):
            assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))
            assert torch.equal(a[1].view(torch.uint8), b[1].view(torch.uint8))
    bits = [t.view(torch.uint8) for t in (dev_a[0][0][10], dev_a[0][0][3], host_a[1][1][0], dev_a[1][1][9])]
    assert torch.equal(bits[0], bits[1]) and torch.equal(bits[2], bits[3])
    assert torch.equal(dev_a[1][0][5].view(torch.uint8), start[1][0][8].view(torch.uint8))  # slot 2 = block 8
