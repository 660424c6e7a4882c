"""Unit tests of the engine's parts: block hashes across processes, the block pool, the scheduler's budget rule,
incremental detokenization."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.config import SchedulerConfig
from engine.core.block_hash import BlockHasher
from engine.core.block_pool import BlockPool, BlockRemoved, BlockStored
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.sampling_params import SamplingParams

HASH_SCRIPT = """
from engine.core.block_hash import BlockHasher
h = BlockHasher.for_model("smollm2-135m-instruct-q4_1", 16)
print(",".join(x.hex() for x in h.hash_blocks(list(range(100, 164)), extra_keys=("salt",))))
"""


def test_block_hashes_agree_across_processes() -> None:
    runs = [subprocess.run([sys.executable, "-c", HASH_SCRIPT], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(seed), "PATH": ""}).stdout.strip() for seed in (1, 2)]
    local = ",".join(x.hex() for x in BlockHasher.for_model("smollm2-135m-instruct-q4_1", 16).hash_blocks(
        list(range(100, 164)), extra_keys=("salt",)))
    assert runs[0] == runs[1] == local
    assert len(local.split(",")) == 4


def test_hashes_chain_and_separate_models() -> None:
    h = BlockHasher.for_model("m", 4)
    a = h.hash_blocks([1, 2, 3, 4, 5, 6, 7, 8])
    b = h.hash_blocks([9, 9, 9, 9, 5, 6, 7, 8])
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different parent
    assert h.hash_block(a[0], [5, 6, 7, 8]) == a[1]
    assert BlockHasher.for_model("other", 4).hash_blocks([1, 2, 3, 4]) != a[:1]
    assert h.hash_blocks([1, 2, 3]) == []  # partial blocks are never hashed
    with pytest.raises(ValueError):
        h.hash_block(None, [1, 2])


def test_block_pool_lru_eviction_and_events() -> None:
    pool = BlockPool(5, enable_caching=True, enable_events=True)
    first = pool.get_new_blocks(2)
    assert first is not None and [b.block_id for b in first] == [1, 2]
    pool.cache_full_block(first[0], b"h1", None)
    pool.cache_full_block(first[1], b"h2", b"h1")
    pool.free_blocks(reversed(first))  # tail first: h2 is evicted before h1
    assert pool.get_new_blocks(5) is None  # only 4 usable blocks
    fresh = pool.get_new_blocks(3)
    assert fresh is not None and [b.block_id for b in fresh] == [3, 4, 2]
    assert pool.get_cached_block(b"h2") is None and pool.get_cached_block(b"h1") is first[0]
    assert pool.take_events() == [BlockStored([b"h1"], None), BlockStored([b"h2"], b"h1"), BlockRemoved([b"h2"])]
    pool.touch([first[0]])  # a hit on a free cached block takes it out of the free queue
    assert pool.num_free_blocks == 0 and first[0].ref_cnt == 1


def _request(rid: str, n_prompt: int, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens), eos_token_id=None)


def test_scheduler_token_budget_running_first_and_chunking() -> None:
    kv = KVCacheManager(64, 4, BlockHasher.for_model("t", 4), enable_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10, max_model_len=64), kv, None)
    a, b = _request("a", 6), _request("b", 12)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("a", 6), ("b", 4)]  # b chunked
    assert out.chunks[0].sample and not out.chunks[1].sample
    from engine.outputs import ModelRunnerOutput

    sched.update_from_output(out, ModelRunnerOutput({"a": 7}))
    out = sched.schedule()
    # running first: a decodes one token, b continues its prefill with what is left of the budget
    assert [(c.request_id, len(c.token_ids), c.start_position) for c in out.chunks] == [("a", 1, 6), ("b", 8, 4)]


def test_allocator_returns_none_and_scheduler_preempts_last_admitted() -> None:
    kv = KVCacheManager(5, 4, BlockHasher.for_model("t", 4), enable_caching=False)  # 4 usable blocks
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=16), kv, None)
    first, second = _request("first", 8, max_tokens=8), _request("second", 8, max_tokens=8)
    sched.add_request(first)
    sched.add_request(second)
    from engine.outputs import ModelRunnerOutput

    out = sched.schedule()
    assert len(out.chunks) == 2 and kv.pool.num_free_blocks == 0
    sched.update_from_output(out, ModelRunnerOutput({"first": 1, "second": 1}))
    assert kv.allocate_slots(first, 1) is None  # full: the allocator says so, it does not choose a victim
    out = sched.schedule()
    assert [c.request_id for c in out.chunks] == ["first"]
    assert second.status is RequestStatus.PREEMPTED and second.num_computed_tokens == 0
    assert sched.num_preemptions == 1 and sched.waiting[0] is second


def test_incremental_detokenizer_multibyte() -> None:
    from engine.processing.detokenizer import IncrementalDetokenizer
    from tests.helpers.oracle import hf_tokenizer

    tokenizer = hf_tokenizer()
    text = "naïve café 東京 🚀 done"
    ids = tokenizer(text).input_ids
    detok = IncrementalDetokenizer(tokenizer, [], True, [], False)
    pieces = []
    for token in ids:
        before = detok.text
        detok.update([token])
        pieces.append(detok.text[len(before):])
        assert "\ufffd" not in detok.text
    assert "".join(pieces) == text == detok.text


def test_detokenizer_stop_string_across_tokens() -> None:
    from engine.processing.detokenizer import IncrementalDetokenizer
    from tests.helpers.oracle import hf_tokenizer

    tokenizer = hf_tokenizer()
    ids = tokenizer("alpha beta gamma delta").input_ids
    detok = IncrementalDetokenizer(tokenizer, [], True, ["ta gam"], False)
    for token in ids:
        if detok.update([token]):
            break
    assert detok.stop_matched == "ta gam" and detok.text == "alpha be"


def test_full_hit_recomputes_last_token_and_generated_blocks_are_cached() -> None:
    from kvflow import LLM

    llm = LLM("tiny", max_model_len=256, kv_cache_memory_bytes=8 << 20)
    prompt = list(range(10, 42))  # exactly 2 blocks of 16
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": prompt}, params)[0]
    again = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert again.num_cached_tokens == 16  # not 32: the last prompt token is recomputed for its logits
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    extended = prompt + first.outputs[0].token_ids  # 52 tokens: blocks of generated tokens are cached too
    assert llm.generate({"prompt_token_ids": extended}, params)[0].num_cached_tokens == 48
