"""Speculative decoding (issue 13): config, exactness of greedy output with n-gram and self-draft proposers under
chunked prefill and preemption, rejection sampling's distribution, KV rollback / no leaks, metrics."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from engine.arg_utils import EngineArgs
from engine.llm_engine import LLMEngine
from engine.metrics.prometheus import EngineMetrics
from engine.sampling_params import SamplingParams
from engine.spec.config import SpecConfig
from engine.spec.proposer import draft_engine_config, ngram_lookup
from engine.spec.rejection_sampler import rejection_sample, verify_greedy
from kvflow.launcher import engine_argv
from kvflow.llm import LLM

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n"
PROMPTS = [
    f"Rewrite this code with type hints:\n{CODE}\nAnswer:",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    f"{CODE}\n# The same functions again:\n",
    "List the numbers: 1, 2, 3, 4, 5, 6, 7, 8,",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
SELF_DRAFT = {"model": "smollm2", "num_speculative_tokens": 3}
# Chunked prefill (a 48-token budget) and preemption (7 usable blocks of 16 tokens for 4 requests of up to ~80 tokens).
ENGINE = {"max_model_len": 112, "max_num_batched_tokens": 48, "num_gpu_blocks_override": 8, "seed": 0}


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=32, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=24, stop=["mul"]),
        SamplingParams(temperature=0.0, max_tokens=9, min_tokens=3),
    ]


@pytest.fixture(scope="module")
def baseline() -> list:
    return LLM("smollm2", **ENGINE).generate(PROMPTS, _params())


@pytest.fixture(scope="module")
def ngram_llm() -> LLM:
    return LLM("smollm2", speculative_config=NGRAM, **ENGINE)


# ---- configuration -----------------------------------------------------------------------------------------
def test_config_forms_match_vllm() -> None:
    spec = SpecConfig.parse(NGRAM)
    assert spec == SpecConfig("ngram", 4, None, 4, 2)
    assert SpecConfig.parse(json.dumps(NGRAM)) == spec
    assert SpecConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}) == \
        SpecConfig("ngram", 2, None, 3, 3)
    draft = SpecConfig.parse({"model": "smollm2", "num_speculative_tokens": 3, "draft_num_layers": 12})
    assert (draft.method, draft.model, draft.draft_num_layers) == ("draft_model", "smollm2", 12)
    legacy = EngineArgs(speculative_model="[ngram]", num_speculative_tokens=4, ngram_prompt_lookup_max=4,
                        ngram_prompt_lookup_min=2)
    assert legacy.spec_config() == spec
    assert EngineArgs(speculative_model="smollm2", num_speculative_tokens=3,
                      speculative_disable_by_batch_size=8).spec_config() == \
        SpecConfig("draft_model", 3, "smollm2", 5, 5, 8)
    assert EngineArgs().spec_config() is None


@pytest.mark.parametrize(("value", "field"), [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "foo": 1}, "foo"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ("{not json", "JSON"),
])
def test_bad_config_names_the_field(value: object, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SpecConfig.parse(value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=field):
        LLM("tiny", speculative_config=value)


def test_draft_with_another_vocabulary_is_refused() -> None:
    target = EngineArgs(model="smollm2").create_engine_config()
    with pytest.raises(ValueError, match="vocabulary"):
        draft_engine_config(target, SpecConfig.build(model="tiny", num_speculative_tokens=2))
    with pytest.raises(ValueError, match="draft_num_layers"):
        draft_engine_config(target, SpecConfig.build(model="smollm2", num_speculative_tokens=2, draft_num_layers=99))
    with pytest.raises(ValueError, match="not both"):
        EngineArgs(speculative_config=NGRAM, speculative_model="[ngram]", num_speculative_tokens=2).spec_config()


def test_cli_flags_and_serve_forwarding() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--speculative-config", json.dumps(NGRAM)]))
    assert args.spec_config() == SpecConfig.parse(NGRAM)
    old = EngineArgs.from_cli_args(parser.parse_args(
        ["--speculative-model", "[ngram]", "--num-speculative-tokens", "3", "--ngram-prompt-lookup-max", "4",
         "--speculative-disable-by-batch-size", "16"]))
    assert old.spec_config() == SpecConfig("ngram", 3, None, 4, 4, 16)
    argv = engine_argv(EngineArgs(speculative_config=NGRAM))
    assert argv == ["--speculative-config", json.dumps(NGRAM)]
    assert EngineArgs.from_cli_args(parser.parse_args(argv)).spec_config() == SpecConfig.parse(NGRAM)
    assert engine_argv(EngineArgs(speculative_config=NGRAM).without_speculation()) == []


# ---- proposers and verification (no model) -----------------------------------------------------------------
def test_ngram_lookup_prefers_longest_then_most_recent() -> None:
    import numpy as np

    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    assert ngram_lookup(tokens, 2, 3, 2) == [7, 8]  # "2 3" last seen at 5..6, followed by 7 8
    assert ngram_lookup(np.array([5, 1, 2, 6, 7, 0, 1, 2]), 1, 2, 3) == [6, 7, 0]
    assert ngram_lookup(np.array([1, 2, 3, 4]), 2, 3, 2) == []
    assert verify_greedy([4, 5, 6], [4, 5]) == [4, 5, 6]
    assert verify_greedy([4, 9, 6], [4, 5]) == [4, 9]
    assert verify_greedy([3, 5, 6], [4, 5]) == [3]


@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(one_hot: bool) -> None:
    """Fixed p (target) and q (draft) over 5 tokens; drafts drawn from q (or a fixed one-hot draft, n-gram style).
    The first emitted token must follow p[0] and, given the first draft was accepted, the second p[1]."""
    p = torch.tensor([[0.40, 0.25, 0.20, 0.10, 0.05], [0.05, 0.15, 0.50, 0.20, 0.10], [0.2] * 5])
    q = torch.tensor([[0.10, 0.10, 0.50, 0.20, 0.10], [0.30, 0.30, 0.10, 0.20, 0.10]])
    gen = torch.Generator().manual_seed(1234)
    trials = 12000
    first = torch.zeros(5)
    second = torch.zeros(5)
    drafts_all = torch.multinomial(q, trials, replacement=True, generator=gen).T.tolist()
    for drafts in drafts_all:
        if one_hot:
            drafts = [2, 1]
        out = rejection_sample(p, drafts, None if one_hot else q, gen)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    for counts, target in ((first, p[0]), (second, p[1])):
        n = counts.sum()
        expected = n * target
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 18.47, (counts, expected)  # chi-square, 4 degrees of freedom, p = 0.001
    assert 0 < second.sum() < trials


# ---- the engine --------------------------------------------------------------------------------------------
def _same(spec_out: list, base_out: list) -> None:
    for got, want in zip(spec_out, base_out, strict=True):
        g, w = got.outputs[0], want.outputs[0]
        assert g.token_ids == w.token_ids
        assert g.text == w.text
        assert (g.finish_reason, g.stop_reason) == (w.finish_reason, w.stop_reason)
        if w.logprobs is not None:
            assert len(g.logprobs) == len(w.logprobs) == len(w.token_ids)
            for a, b in zip(g.logprobs, w.logprobs, strict=True):
                assert set(a) == set(b)
                for token in a:
                    assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-3)
            assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-2)


def test_ngram_greedy_equals_plain_decoding(baseline: list, ngram_llm: LLM) -> None:
    out = ngram_llm.generate(PROMPTS, _params())
    _same(out, baseline)
    stats = ngram_llm.stats
    assert stats.num_preemptions > 0  # the small pool forced preemption mid-speculation
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_accepted_tokens > 0
    assert stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == stats.spec_decode_num_accepted_tokens
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))  # position j needs j - 1 accepted
    pool = ngram_llm.llm_engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_self_draft_greedy_equals_plain_decoding_and_accepts_everything(baseline: list) -> None:
    llm = LLM("smollm2", speculative_config=SELF_DRAFT, **ENGINE)
    _same(llm.generate(PROMPTS, _params()), baseline)
    stats = llm.stats
    assert stats.num_preemptions > 0
    assert stats.spec_decode_num_drafts > 0
    # The draft is the target itself: every draft the penalty-free greedy requests see is accepted; only the
    # repetition-penalty request (the draft proposes without penalties) rejects (measured: 41 of 54 accepted).
    assert stats.spec_decode_num_accepted_tokens >= 0.7 * stats.spec_decode_num_draft_tokens
    engine = llm.llm_engine
    engine.step()  # the proposer drops finished requests' draft sequences at its next call
    draft_pool = engine.proposer.kv.pool
    assert draft_pool.num_free_blocks == draft_pool.num_usable_blocks
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_usable_blocks


def test_aborts_mid_speculation_leak_no_blocks(ngram_llm: LLM) -> None:
    engine: LLMEngine = ngram_llm.llm_engine
    pool = engine.kv_manager.pool
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"abort-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=40))
    for _ in range(200):
        engine.step()
        engine.proposer.propose(engine.scheduler.running)  # what the next step starts with
        if any(r.spec_token_ids for r in engine.scheduler.running):
            break
    assert any(r.spec_token_ids for r in engine.scheduler.running)
    engine.abort_request([r.request_id for r in engine.scheduler.running if not r.spec_token_ids])  # room
    out = engine.scheduler.schedule()  # KV slots for the drafts are allocated: the abort lands mid-speculation
    assert any(c.spec_token_ids for c in out.chunks)
    engine.abort_all()
    engine.step()
    assert not engine.has_unfinished_requests()
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_seeded_sampling_with_speculation_is_reproducible(ngram_llm: LLM) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, seed=7)
    a = ngram_llm.generate(PROMPTS[:2], params)
    b = ngram_llm.generate(PROMPTS[:2], params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert all(len(o.outputs[0].token_ids) == 16 for o in a)


def test_metrics_export_vllm_names(ngram_llm: LLM) -> None:
    if not ngram_llm.stats.spec_decode_num_accepted_tokens:  # run alone: produce some accepted drafts first
        ngram_llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=32))
    stats = ngram_llm.stats
    assert stats.spec_decode_num_accepted_tokens > 0
    metrics = EngineMetrics("smollm2")
    metrics.update(stats, [])
    value = metrics.registry.get_sample_value
    labels = {"model_name": "smollm2"}
    assert value("vllm:spec_decode_num_drafts_total", labels) == stats.spec_decode_num_drafts
    assert value("vllm:spec_decode_num_draft_tokens_total", labels) == stats.spec_decode_num_draft_tokens
    assert value("vllm:spec_decode_num_accepted_tokens_total", labels) == stats.spec_decode_num_accepted_tokens
    assert value("vllm:spec_decode_num_accepted_tokens_per_pos_total", {**labels, "position": "0"}) == \
        stats.spec_decode_num_accepted_tokens_per_pos[0]


def test_scheduler_counts_drafts_in_the_budget_and_rolls_back_rejected_slots() -> None:
    from engine.config import SchedulerConfig
    from engine.core.block_hash import BlockHasher
    from engine.core.kv_cache_manager import KVCacheManager
    from engine.core.request import Request
    from engine.core.scheduler import Scheduler
    from engine.outputs import ModelRunnerOutput

    kv = KVCacheManager(32, 4, BlockHasher.for_model("t", 4), enable_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4, max_model_len=64), kv, None)
    request = Request("a", list(range(1, 8)), SamplingParams(max_tokens=20), eos_token_id=None)
    sched.add_request(request)
    sched.update_from_output(sched.schedule(), ModelRunnerOutput({}))  # prompt chunk 1 (4 of 7 tokens)
    sched.update_from_output(sched.schedule(), ModelRunnerOutput({"a": 50}))  # rest of the prompt + 1st token
    assert request.num_tokens == 8 and request.num_computed_tokens == 7
    request.spec_token_ids = [60, 61, 62, 63, 64]
    out = sched.schedule()
    chunk = out.chunks[0]
    # budget 4: the last token + 3 of the 5 drafts; KV slots for positions 7..10 -> 3 blocks of 4
    assert (chunk.token_ids, chunk.spec_token_ids, out.total_num_scheduled_tokens) == ([50, 60, 61, 62],
                                                                                      [60, 61, 62], 4)
    assert len(kv.block_ids("a")) == 3
    sched.update_from_output(out, ModelRunnerOutput({"a": 70}, accepted_token_ids={"a": [60, 70]}))
    # one draft accepted + the target's token: KV kept for 50, 60 (positions 7, 8); 70 is next to compute
    assert request.output_token_ids == [50, 60, 70] and request.num_computed_tokens == 9
    assert request.spec_token_ids == [] and len(kv.block_ids("a")) == 3  # 10 tokens need 3 blocks
    request.spec_token_ids = [1, 2, 3]
    out = sched.schedule()
    assert len(kv.block_ids("a")) == 4  # positions 9..12
    sched.update_from_output(out, ModelRunnerOutput({"a": 9}, accepted_token_ids={"a": [9]}))  # all rejected
    assert request.num_computed_tokens == 10 and len(kv.block_ids("a")) == 3  # the 4th block is freed
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks - 3


def test_disable_by_batch_size_defaults_on_and_null_keeps_speculating() -> None:
    """Speculation turns itself off above DEFAULT_DISABLE_BY_BATCH_SIZE unless told otherwise (GPU: a verify step
    costs 2-3x a decode step under load); JSON null speculates at every batch size, and both survive to_dict."""
    from engine.spec.config import DEFAULT_DISABLE_BY_BATCH_SIZE

    default = SpecConfig.parse({"method": "ngram", "num_speculative_tokens": 4})
    assert default is not None and default.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE
    assert default.enabled_for(DEFAULT_DISABLE_BY_BATCH_SIZE) and not default.enabled_for(64)
    always = SpecConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": null}')
    assert always is not None and always.disable_by_batch_size is None and always.enabled_for(512)
    assert SpecConfig.parse(always.to_dict()) == always
    assert SpecConfig.parse(default.to_dict()) == default
    legacy = SpecConfig.from_legacy("[ngram]", 4, None, None, None)
    assert legacy is not None and legacy.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE


def test_verify_as_decode_rows_matches_the_extend_forward() -> None:
    """The GPU replays a verify step from a decode CUDA graph with one query row per token
    (`expand_to_decode_rows`); on the CPU the same rows through the model must give the extend forward's hidden
    states: row r attends to the prefix plus rows 0..r-1, whose KV the step wrote first."""
    from engine.outputs import ScheduledChunk
    from engine.runner.attention import AttentionBatch
    from engine.runner.input_batch import expand_to_decode_rows

    engine = LLMEngine.from_engine_args(EngineArgs(model="tiny", load_format="dummy", device="cpu",
                                                   dtype="float32", kv_cache_memory_bytes=1 << 22, seed=0))
    runner = engine.runner
    bs = runner.block_size
    table = [3, 1, 2]
    prompt = [(11 * i + 5) % 200 + 3 for i in range(bs + 5)]

    def forward(batch: AttentionBatch, ids: list[int], positions: list[int]) -> torch.Tensor:
        meta = runner.attn_backend.build_metadata(batch, runner.device)
        with torch.inference_mode():
            return runner.model(torch.tensor(ids), torch.tensor(positions), runner.kv_caches, meta)

    def slot(pos: int) -> int:
        return table[pos // bs] * bs + pos % bs

    plen = len(prompt)
    forward(AttentionBatch([plen], [plen], [table], [slot(p) for p in range(plen)]), prompt, list(range(plen)))
    drafts = [17, 23, 29, 31]
    tokens = [41, *drafts]
    positions = list(range(plen, plen + len(tokens)))
    extend = forward(AttentionBatch([len(tokens)], [plen + len(tokens)], [table], [slot(p) for p in positions]),
                     tokens, positions)
    chunk = ScheduledChunk("r", tokens, plen, table, True, False, drafts)
    rows = expand_to_decode_rows([chunk], bs)
    assert rows.positions == positions and rows.seq_lens == [p + 1 for p in positions]
    assert rows.slots == [slot(p) for p in positions] and rows.spec_spans == [("r", 0, drafts)]
    assert rows.sample_rows == [] and rows.input_ids == tokens
    as_rows = forward(AttentionBatch([1] * len(tokens), rows.seq_lens, rows.block_tables, rows.slots),
                      rows.input_ids, rows.positions)
    torch.testing.assert_close(as_rows, extend, rtol=1e-5, atol=1e-5)
    engine.shutdown()


def test_expand_to_decode_rows_keeps_plain_chunks_sampling_their_last_row() -> None:
    from engine.outputs import ScheduledChunk
    from engine.runner.input_batch import expand_to_decode_rows

    chunks = [ScheduledChunk("a", [5], 40, [2, 7, 9], True, False, []),
              ScheduledChunk("b", [6, 8, 9], 16, [4, 1], True, False, [8, 9])]
    rows = expand_to_decode_rows(chunks, 16)
    assert rows.positions == [40, 16, 17, 18] and rows.seq_lens == [41, 17, 18, 19]
    assert rows.slots == [9 * 16 + 8, 16 + 0, 16 + 1, 16 + 2]
    assert rows.sample_rows == [0] and rows.sample_ids == ["a"] and rows.spec_spans == [("b", 1, [8, 9])]
    assert rows.block_tables == [[2, 7, 9], [4, 1], [4, 1], [4, 1]]


def test_ngram_index_proposes_exactly_what_the_scan_finds() -> None:
    """The incremental index (what the proposer runs) against the whole-history scan, token by token, on
    repetitive random sequences, including a history that shrinks (truncated output)."""
    import numpy as np

    from engine.spec.proposer import NgramIndex

    rng = np.random.default_rng(0)
    for trial in range(20):
        tokens = rng.integers(0, 4 + trial % 5, size=120).tolist()
        index = NgramIndex(2, 4)
        for length in range(1, len(tokens) + 1):
            prefix = tokens[:length]
            assert index.propose(prefix, 3) == ngram_lookup(np.asarray(prefix), 2, 4, 3), (trial, length)
        assert index.propose(tokens[:50], 3) == ngram_lookup(np.asarray(tokens[:50]), 2, 4, 3)
