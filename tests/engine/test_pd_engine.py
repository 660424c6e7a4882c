"""Engine-level P/D hooks, in one process with the `tiny` preset: held KV with a lease on the prefill side,
remote-prefill admission on the decode side, KV export/import through the engines' `KVPort` (also through bytes),
fallback and abort accounting."""

from __future__ import annotations

import random
import time

import pytest

from cluster.transfer.contract import plan_slices, tensor_bytes
from engine.arg_utils import EngineArgs
from engine.kv_layout import KVSlice, KVTransferError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.helpers.oracle import run_to_end

ARGS = dict(model="tiny", kv_cache_memory_bytes=16 << 20, max_model_len=1024)


def make(**overrides: object) -> LLMEngine:
    return LLMEngine(EngineArgs(**{**ARGS, **overrides}).create_engine_config())  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engines() -> tuple[LLMEngine, LLMEngine, LLMEngine]:
    return make(max_num_batched_tokens=32), make(), make()  # prefill (small chunks), decode, unified


def prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(500) for _ in range(n)] for n in (3, 16, 17, 200)]


@pytest.mark.parametrize("seed,temperature", [(None, 0.0), (11, 0.9)])
def test_remote_prefill_equals_unified(engines, seed, temperature) -> None:  # noqa: ANN001
    prefill, decode, unified = engines
    layout = prefill.kv_port.layout
    for i, prompt in enumerate(prompts()):
        params = dict(max_tokens=6, temperature=temperature, seed=seed)
        rid = f"{i}-{seed}"
        unified.add_request(rid, prompt, SamplingParams(**params))
        expected = run_to_end(unified, rid)

        slot = decode.add_remote_prefill_request(rid, prompt, SamplingParams(**params))
        assert slot is not None and len(slot.block_ids) == -(-len(prompt) // 16)
        free_before = prefill.kv_manager.pool.num_free_blocks
        prefill.add_request(rid, prompt, SamplingParams(**{**params, "max_tokens": 1}), kv_lease_s=10)
        first = run_to_end(prefill, rid)[0]
        sampler_state = prefill.sampler_state(rid)
        assert bool(sampler_state) == (seed is not None)
        held = prefill.kv_block_ids(rid)
        assert len(held) == len(slot.block_ids), "finished request's blocks are held for the transfer"
        skip = slot.num_cached_blocks
        for n, part in enumerate(plan_slices(skip, len(held) - skip, layout, max_bytes=4096)):
            export = prefill.kv_port.export(held[part.first_block : part.first_block + part.num_blocks], part)
            ids = slot.block_ids[part.first_block : part.first_block + part.num_blocks]
            wire = export.tensor if n % 2 else decode.kv_port.wire_from_bytes(part, tensor_bytes(export.tensor))
            assert decode.kv_port.import_(ids, part, wire).wait()
        assert prefill.release_kv(rid) == len(held)
        assert prefill.kv_manager.pool.num_free_blocks == free_before

        prompt_tokens = decode.stats.prompt_tokens
        decode.finish_remote_prefill(rid, first, None, sampler_state)
        assert run_to_end(decode, rid) == expected
        assert decode.stats.prompt_tokens == prompt_tokens, "the decode side computed no prompt token"


def test_lease_expiry_frees_held_blocks() -> None:
    engine = make()
    baseline = engine.kv_manager.pool.num_free_blocks
    engine.add_request("r", list(range(40)), SamplingParams(max_tokens=1), kv_lease_s=0.2)
    run_to_end(engine, "r")
    assert engine.kv_manager.pool.num_free_blocks == baseline - 3
    time.sleep(0.25)
    engine.expire_kv_leases()
    assert engine.kv_manager.pool.num_free_blocks == baseline
    assert engine.num_lease_expired_blocks == 3
    engine.add_request("a", list(range(40)), SamplingParams(max_tokens=50), kv_lease_s=10)
    engine.step()
    engine.abort_request("a")  # aborted requests are never held
    engine.step()
    assert engine.kv_manager.pool.num_free_blocks == baseline


def test_remote_admission_threshold_room_fallback_and_abort() -> None:
    engine = make(num_gpu_blocks_override=8, max_model_len=112)  # 7 usable blocks
    baseline = engine.kv_manager.pool.num_free_blocks
    assert engine.add_remote_prefill_request("short", list(range(20)), SamplingParams(max_tokens=2),
                                             min_uncached_tokens=21) is None
    assert engine.add_remote_prefill_request("big", list(range(100)), SamplingParams(max_tokens=2)) is not None
    assert engine.add_remote_prefill_request("no-room", list(range(200, 240)), SamplingParams(max_tokens=2)) is None
    engine.abort_request("big")
    engine.step()  # delivers the abort
    assert engine.get_num_unfinished_requests() == 0 and engine.kv_manager.pool.num_free_blocks == baseline
    with pytest.raises(ValueError, match="single-sample"):
        engine.add_remote_prefill_request("n2", [1, 2, 3], SamplingParams(n=2))

    slot = engine.add_remote_prefill_request("fb", list(range(40)), SamplingParams(max_tokens=3, temperature=0))
    assert slot is not None and engine.kv_manager.pool.num_free_blocks == baseline - 3
    assert not engine.has_unfinished_requests(), "a request waiting for remote KV is never scheduled"
    engine.fail_remote_prefill("fb")  # recompute locally
    assert len(run_to_end(engine, "fb")) == 3
    assert engine.kv_manager.pool.num_free_blocks == baseline

    slot = engine.add_remote_prefill_request("ab", list(range(100, 140)), SamplingParams(max_tokens=3))
    assert slot is not None
    engine.abort_request("ab")
    assert engine.kv_manager.pool.num_free_blocks == baseline


def test_kv_port_rejects_bad_payloads() -> None:
    engine = make()
    port = engine.kv_port
    layout = port.layout
    with pytest.raises(KVTransferError, match="expected"):
        port.wire_from_bytes(KVSlice(0, 1, 0, layout.num_layers), b"\0" * 10)
    with pytest.raises(KVTransferError, match="layers"):
        part = KVSlice(0, 1, layout.num_layers, 1)
        port.import_([1], part, port.wire_from_bytes(part, b"\0" * layout.payload_bytes(1, 1)))
    part = KVSlice(0, 1, 0, layout.num_layers)
    with pytest.raises(KVTransferError, match="outside the KV cache"):
        port.import_([engine.num_gpu_blocks], part, port.empty_wire(part))
    with pytest.raises(KVTransferError, match="block ids"):
        port.export([1, 2], part)
    with pytest.raises(KVTransferError, match="does not match"):
        port.import_([1], part, port.empty_wire(KVSlice(0, 2, 0, layout.num_layers)))


@pytest.mark.parametrize("seed,temperature,transfer_fails", [(None, 0.0, False), (None, 0.0, True),
                                                             (5, 0.9, False), (5, 0.9, True)])
def test_first_token_streams_before_the_kv(engines, seed, temperature, transfer_fails) -> None:  # noqa: ANN001
    """The prefill worker's first token is delivered while the KV is still landing; decoding waits for the KV,
    and a transfer that then fails recomputes the prompt and that token: the output is the unified one."""
    prefill, decode, unified = engines
    prompt = prompts()[3]
    params = dict(max_tokens=6, temperature=temperature, seed=seed)
    rid = f"early-{seed}-{transfer_fails}"
    unified.add_request(rid, prompt, SamplingParams(**params))
    expected = run_to_end(unified, rid)

    slot = decode.add_remote_prefill_request(rid, prompt, SamplingParams(**params), output_kind="delta")
    assert slot is not None
    prefill.add_request(rid, prompt, SamplingParams(**{**params, "max_tokens": 1}), kv_lease_s=10)
    first = run_to_end(prefill, rid)[0]
    sampler_state = prefill.sampler_state(rid)
    assert first == expected[0]

    assert decode.take_remote_first_token(rid, first, None, sampler_state)
    early = decode.take_pending_outputs()
    assert [o.outputs[0].token_ids for o in early] == [[first]] and not early[0].finished
    assert not decode.take_remote_first_token(rid, first, None, sampler_state), "taken once"
    for _ in range(3):  # no decoding before the KV is there
        assert all(o.request_id != rid for o in decode.step())
    if transfer_fails:
        decode.fail_remote_prefill(rid)
    else:
        held = prefill.kv_block_ids(rid)
        part = KVSlice(slot.num_cached_blocks, len(held) - slot.num_cached_blocks, 0, prefill.kv_port.layout.num_layers)
        export = prefill.kv_port.export(held[part.first_block :], part)
        assert decode.kv_port.import_(slot.block_ids[part.first_block :], part, export.tensor).wait()
        decode.finish_remote_prefill(rid, first, None, sampler_state)
    prefill.release_kv(rid)
    tokens: list[int] = [first]
    for _ in range(1000):
        outputs = [o for o in decode.step() if o.request_id == rid]
        for output in outputs:
            tokens = output.outputs[0].token_ids
        if outputs and outputs[-1].finished:
            break
    assert tokens == expected


def test_first_token_that_ends_the_request_waits_for_the_kv() -> None:
    decode = make()
    prompt = prompts()[2]
    cases = {"length": (SamplingParams(max_tokens=1), 7), "stop-id": (SamplingParams(stop_token_ids=[7]), 7),
             "stop-string": (SamplingParams(max_tokens=5, stop=["zz"]), 7)}
    for name, (params, token) in cases.items():
        slot = decode.add_remote_prefill_request(name, prompt, params)
        assert slot is not None
        assert not decode.take_remote_first_token(name, token, None), name
        assert decode.take_pending_outputs() == []
        decode.abort_request(name)
        decode.take_pending_outputs()
