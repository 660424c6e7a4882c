"""allowed_token_ids and bad_words (issue 27 item 9: implemented instead of refused), with vLLM's semantics: an
allowed set masks every other token; a bad word's last token is banned when the tokens just generated match the
rest of it, and a one-token word is always banned. Checked on the sampler, on the real model (plain and
speculative decoding), and across the worker wire and the tensor-parallel codec."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidRequest
from engine.runner.sampler import SamplingRow, apply_token_masks
from kvflow import LLM, SamplingParams
from tests.helpers.oracle import PROMPTS, SMALL_KV

INF = float("inf")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2", dtype="float32", kv_cache_memory_bytes=SMALL_KV, max_model_len=512)


def _row(output: list[int], **params: object) -> SamplingRow:
    sampling = SamplingParams(temperature=0.0, **params)
    return SamplingRow(sampling, [0], output, None)


def test_the_masks_follow_vllm_semantics() -> None:
    logits = torch.zeros(3, 6)
    allowed = _row([], allowed_token_ids=[1, 4])
    banned = _row([2, 3])
    banned.params._bad_words_token_ids = [[5], [3, 1], [2, 2, 0]]  # as the input processor tokenized them
    plain = _row([2, 3])
    out = apply_token_masks(logits, [allowed, banned, plain])
    assert out[0].tolist() == [-INF, 0, -INF, -INF, 0, -INF]
    assert out[1].tolist() == [0, -INF, 0, 0, 0, -INF]  # [5] always; [3, 1] after a 3; [2, 2, 0] not after [2, 3]
    assert out[2].tolist() == [0.0] * 6 and logits.eq(0).all()  # other rows and the caller's logits untouched


@pytest.mark.parametrize(("field", "value"), [
    ("allowed_token_ids", []), ("allowed_token_ids", [-1]), ("allowed_token_ids", [1, True]),
    ("allowed_token_ids", "12"), ("bad_words", [""]), ("bad_words", ["  "]), ("bad_words", "darn"),
    ("bad_words", ["x"] * 129), ("bad_words", ["x" * 257])])
def test_bad_values_name_their_field(field: str, value: object) -> None:
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def test_allowed_token_ids_on_the_real_model(llm: LLM) -> None:
    free = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    same = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, allowed_token_ids=sorted(set(free.token_ids)))
    assert llm.generate(PROMPTS[0], same)[0].outputs[0].token_ids == free.token_ids
    allowed = [7, 42, 300, 1000]
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed)
    assert set(llm.generate(PROMPTS[3], sampled)[0].outputs[0].token_ids) <= set(allowed)
    with pytest.raises(InvalidRequest) as info:
        llm.generate(PROMPTS[0], SamplingParams(allowed_token_ids=[10**6]))
    assert info.value.param == "allowed_token_ids"


def test_bad_words_on_the_real_model(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    free = llm.generate(PROMPTS[0], greedy)[0].outputs[0]
    assert "Paris" in free.text, free.text
    banned = SamplingParams(temperature=0.0, max_tokens=8, bad_words=["Paris"])
    out = llm.generate(PROMPTS[0], banned)[0].outputs[0]
    assert "Paris" not in out.text, out.text
    tokenizer = llm.get_tokenizer()
    word = tokenizer.decode(free.token_ids[:2]).strip()  # " Paris.": two tokens, generated from the first step on
    ids = tokenizer.encode(" " + word, add_special_tokens=False)
    assert len(ids) > 1 and free.token_ids[: len(ids)] == ids, (word, ids, free.token_ids)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8, bad_words=[word]))[0].outputs[0]
    assert out.token_ids[: len(ids) - 1] == ids[:-1] and out.token_ids[len(ids) - 1] != ids[-1]  # only the last


def test_speculative_decoding_applies_the_masks() -> None:
    spec = LLM("smollm2", dtype="float32", kv_cache_memory_bytes=SMALL_KV, max_model_len=512, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    plain = LLM("smollm2", dtype="float32", kv_cache_memory_bytes=SMALL_KV, max_model_len=512)
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick"
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, bad_words=["lazy", "dog"])
    expected = plain.generate(prompt, params)[0].outputs[0]
    assert "lazy" not in expected.text and "dog" not in expected.text, expected.text
    assert spec.generate(prompt, params)[0].outputs[0].token_ids == expected.token_ids


def test_the_fields_cross_the_wire_and_the_tp_codec() -> None:
    from cluster.wire import sampling_params_from_proto, sampling_params_to_proto
    from engine.outputs import NewRequestData, SchedulerOutput
    from engine.parallel.codec import decode, encode

    params = SamplingParams(temperature=0.0, allowed_token_ids=[3, 9], bad_words=["darn it", "heck"])
    wire = sampling_params_to_proto(params, explicit_only=True)
    assert list(wire.allowed_token_ids) == [3, 9] and list(wire.bad_words) == ["darn it", "heck"]
    back = sampling_params_from_proto(wire)
    assert back.allowed_token_ids == [3, 9] and back.bad_words == ["darn it", "heck"]
    params._bad_words_token_ids = [[11, 12], [13]]
    so = SchedulerOutput([NewRequestData("r", [1, 2], params, [], b"")], [], 0)
    ranked = decode(encode(so)).new_requests[0].sampling_params
    assert ranked.allowed_token_ids == [3, 9] and ranked.bad_words_token_ids == [[11, 12], [13]]
