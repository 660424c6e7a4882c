"""--itl-target-ms: the step-time model (engine/core/step_budget.py), the scheduler's prefill cap while requests
decode, the engine feeding the model from its step timing (SmolLM2 on CPU), and the flag's validation and
forwarding."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.arg_utils import EngineArgs
from engine.config import SchedulerConfig
from engine.core.block_hash import BlockHasher
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.core.scheduler import Scheduler, is_decoding
from engine.core.step_budget import StepCost, StepTimeModel, attention_pairs, nonnegative_lstsq
from engine.llm_engine import LLMEngine
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.sampling_params import SamplingParams
from tests.helpers.oracle import PROMPTS

TRUE = StepCost(base_s=2e-3, per_decode_seq_s=1e-4, per_prefill_token_s=1e-5, mixed_step_s=1e-3)


def trained(cost: StepCost = TRUE, **kwargs: object) -> StepTimeModel:
    model = StepTimeModel(skip_first=0, **kwargs)  # type: ignore[arg-type]
    for decodes in (1, 4, 8, 16, 32):
        for tokens in (0, 0, 64, 256, 1024):
            model.observe(decodes, tokens, cost.predict(decodes, tokens))
    return model


# ---- (a) the step-time model ------------------------------------------------------------------------------------
def test_model_fits_a_linear_cost_and_gives_the_budget() -> None:
    model = trained()
    cost = model.cost()
    assert cost is not None
    for got, want in zip((cost.base_s, cost.per_decode_seq_s, cost.per_prefill_token_s, cost.mixed_step_s),
                         (TRUE.base_s, TRUE.per_decode_seq_s, TRUE.per_prefill_token_s, TRUE.mixed_step_s),
                         strict=True):
        assert math.isclose(got, want, rel_tol=1e-6)
    # 20 ms target, 10 decodes: 20 - 2 - 1 - 1 (mixed) = 16 ms of prefill at 10 us a token
    assert model.prefill_token_budget(10, 0.020) in (1599, 1600)  # rounding of the fit
    budget = model.prefill_token_budget(3, 0.012555)
    assert budget is not None and TRUE.predict(3, budget) <= 0.012555 < TRUE.predict(3, budget + 1)


def test_floor_none_and_the_range_seen() -> None:
    model = StepTimeModel(floor_tokens=32, skip_first=0)
    assert model.prefill_token_budget(4, 0.05) is None  # nothing observed: no cap
    for decodes in range(1, 9):
        model.observe(decodes, 0, TRUE.predict(decodes, 0))
    assert model.num_samples == 8 and model.prefill_token_budget(4, 0.05) == 32  # prefill never seen: start small
    for tokens in (100, 200, 300):
        model.observe(2, tokens, TRUE.predict(2, tokens))
    assert model.prefill_token_budget(4, 0.05) == 600  # the fit allows 4660: only twice the largest chunk seen
    assert model.prefill_token_budget(100, 0.010) == 32  # decodes alone predicted at 12 ms: the floor
    assert model.prefill_token_budget(4, 0.0035) == 32  # slack under the floor: still the floor
    free = trained(StepCost(2e-3, 1e-4, 0.0, 0.0))
    assert free.prefill_token_budget(4, 0.05) == 2048  # prefill looks free: as far as seen (2 x 1024)


def test_attention_pairs_make_deep_chunks_smaller() -> None:
    deep = StepCost(2e-3, 1e-4, 1e-5, 1e-3, per_attention_pair_s=1e-8)
    model = StepTimeModel(skip_first=0)
    for decodes in (1, 4, 8, 16):
        for tokens, cached in ((0, 0), (64, 0), (256, 1024), (1024, 0), (512, 4096), (128, 8192)):
            pairs = attention_pairs(tokens, cached)
            model.observe(decodes, tokens, deep.predict(decodes, tokens, pairs), pairs)
    cost = model.cost()
    assert cost is not None and math.isclose(cost.per_attention_pair_s, 1e-8, rel_tol=1e-4)
    fresh, deeper = model.prefill_token_budget(4, 0.020), model.prefill_token_budget(4, 0.020, context_tokens=8192)
    assert fresh is not None and deeper is not None and deeper < fresh
    for budget, cached in ((fresh, 0), (deeper, 8192)):  # each is the largest chunk predicted within 20 ms
        assert deep.predict(4, budget, attention_pairs(budget, cached)) <= 0.020
        assert deep.predict(4, budget + 1, attention_pairs(budget + 1, cached)) > 0.020


def test_a_model_that_saw_only_decodes_explores_by_doubling() -> None:
    model = StepTimeModel(skip_first=0)
    for decodes in range(1, 9):
        model.observe(decodes, 0, TRUE.predict(decodes, 0))
    budgets = []
    for _ in range(10):
        budget = model.prefill_token_budget(4, 0.020)
        assert budget is not None
        budgets.append(budget)
        model.observe(4, budget, TRUE.predict(4, budget))  # the capped step, as the scheduler would run it
    assert budgets[:6] == [16, 32, 64, 128, 256, 512]
    assert budgets[-1] in (1659, 1660)  # then the fitted slope binds: (20 - 2.4 - 1) ms / 10 us


def test_warm_up_and_outliers_are_dropped() -> None:
    model = StepTimeModel(skip_first=3, max_outliers=2)
    assert [model.observe(1, 0, 5.0) for _ in range(3)] == [False, False, False]  # compiling kernels
    assert model.num_samples == 0
    model = trained(max_outliers=2)
    before = model.cost()
    assert not model.observe(8, 256, 1.0) and not model.observe(8, 256, 1.0)  # a GC pause, twice
    assert model.cost() == before
    assert model.observe(8, 256, 1.0)  # a third in a row: the cost really changed, follow it
    assert model.cost() != before
    assert trained().observe(8, 4096, 1.0)  # beyond the range seen: never an outlier, that is where it learns


def test_coefficients_are_never_negative() -> None:
    x = np.array([[1.0, d, 0.0, 0.0] for d in range(1, 9)] + [[1.0, 1.0, t, 1.0] for t in (10, 20, 40)])
    y = np.array([0.010 - 0.0005 * d for d in range(1, 9)] + [0.01, 0.011, 0.013])  # more decodes, faster?
    coef = nonnegative_lstsq(x, y)
    assert (coef >= 0).all()
    unconstrained, *_ = np.linalg.lstsq(x, y, rcond=None)
    assert (unconstrained < 0).any()  # the case the constraint is for
    model = StepTimeModel(skip_first=0, min_samples=4)
    for row, seconds in zip(x, y, strict=True):
        model.observe(int(row[1]), int(row[2]), float(seconds))
    cost = model.cost()
    assert cost is not None and min(cost.base_s, cost.per_decode_seq_s, cost.per_prefill_token_s,
                                    cost.mixed_step_s) >= 0


def test_the_chunk_for_a_rate_is_the_smallest_fast_enough_within_what_was_seen() -> None:
    """--ttft-target-ms: the cap yields to the smallest chunk predicted to prefill at the queue's needed rate."""
    model = trained()  # 10 decodes: a step costs 2 + 1 + 1 ms fixed, plus 10 us a prefill token
    fixed, per_token = 4e-3, 1e-5
    want = 50_000.0  # tokens / (4 ms + 10 us x tokens) >= 50k: tokens >= 400
    chunk = model.prefill_tokens_for_rate(10, want, 0, 8192)
    assert chunk in (399, 400, 401)  # rounding of the fit
    assert chunk / (fixed + per_token * chunk) >= want * (1 - 1e-6)
    assert model.prefill_tokens_for_rate(10, 1.0, 0, 8192) == model.floor_tokens  # a short queue: the floor
    assert model.prefill_tokens_for_rate(10, 99_000.0, 0, 8192) == 2048  # never fast enough: as far as seen
    assert model.prefill_tokens_for_rate(10, 99_000.0, 0, 1000) == 1000  # ... and max_num_batched_tokens
    assert StepTimeModel().prefill_tokens_for_rate(10, want, 0, 8192) == 16  # no fit yet: the floor
    # the rate a new prompt is quoted grows with the queue the cap yields to
    slow, fast = (model.prefill_tokens_per_s(10, 0.0045, 8192, backlog) for backlog in (0.0, want))
    assert slow < 20_000 < want * 0.99 <= fast


# ---- (b) the scheduler's cap ------------------------------------------------------------------------------------
class FixedBudget:
    """A step-time model stand-in that always answers `tokens`."""

    def __init__(self, tokens: int | None) -> None:
        self.tokens = tokens
        self.asked: list[tuple[int, float]] = []
        self.contexts: list[int] = []
        self.rates: list[float] = []

    def prefill_token_budget(self, num_decode_seqs: int, target_s: float, context_tokens: int = 0) -> int | None:
        self.asked.append((num_decode_seqs, target_s))
        self.contexts.append(context_tokens)
        return self.tokens

    def prefill_tokens_for_rate(self, num_decode_seqs: int, tokens_per_s: float, context_tokens: int,
                                max_tokens: int) -> int:
        """A step of 10 ms whatever it carries: the chunk is the queue's rate x 10 ms."""
        self.rates.append(tokens_per_s)
        return min(max(1, math.ceil(tokens_per_s * 0.010)), max_tokens)


def _request(rid: str, n_prompt: int, max_tokens: int = 50) -> Request:
    first = 1000 * (1 + sum(map(ord, rid)))  # distinct prompts: no prefix-cache hits between requests
    return Request(rid, list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens),
                   eos_token_id=None)


def _scheduler(budget: FixedBudget, itl_target_ms: float | None = 25.0, batched: int = 64) -> Scheduler:
    kv = KVCacheManager(256, 4, BlockHasher.for_model("t", 4), enable_caching=True)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=batched, max_model_len=512,
                             itl_target_ms=itl_target_ms)
    return Scheduler(config, kv, None, budget)


def _sizes(out: SchedulerOutput) -> dict[str, int]:
    return {c.request_id: len(c.token_ids) for c in out.chunks}


def _advance(sched: Scheduler, out: SchedulerOutput) -> None:
    sched.update_from_output(out, ModelRunnerOutput({c.request_id: 7 for c in out.chunks if c.sample}))


def test_running_decodes_cap_prefill_tokens() -> None:
    budget = FixedBudget(10)
    sched = _scheduler(budget)
    sched.add_request(_request("a", 6))
    sched.add_request(_request("b", 5))
    out = sched.schedule()
    assert _sizes(out) == {"a": 6, "b": 5} and budget.asked == []  # nobody decodes: no cap, not even asked
    assert (out.num_decode_seqs, out.num_prefill_tokens, out.prefill_token_cap) == (0, 11, None)
    _advance(sched, out)
    sched.add_request(_request("long", 40))
    sched.add_request(_request("next", 8))
    queries = sched.kv.stats.queries
    out = sched.schedule()
    assert _sizes(out) == {"a": 1, "b": 1, "long": 10}  # "next" waits: the cap is spent ...
    assert sched.kv.stats.queries - queries == 40  # ... and is not even looked up in the prefix cache
    assert budget.asked == [(2, 0.025)] and budget.contexts == [0]  # the cap will go to "long", from its start
    assert (out.num_decode_seqs, out.num_prefill_tokens, out.prefill_token_cap) == (2, 10, 10)
    assert out.prefill_attention_pairs == 10 * 11 // 2
    _advance(sched, out)
    budget.tokens = 35
    out = sched.schedule()  # the running prefill continues, then "next" is admitted with what is left
    assert _sizes(out) == {"a": 1, "b": 1, "long": 30, "next": 5}
    assert out.total_num_scheduled_tokens == 37 and budget.contexts[-1] == 10  # "long" is 10 tokens in
    assert out.prefill_attention_pairs == (30 * 10 + 30 * 31 // 2) + 5 * 6 // 2


def test_a_capped_prefill_never_blocks_the_decodes_behind_it() -> None:
    budget = FixedBudget(None)  # the model is still learning: no cap
    sched = _scheduler(budget)
    sched.add_request(_request("a", 4))
    _advance(sched, sched.schedule())
    sched.add_request(_request("p", 100))
    out = sched.schedule()
    assert _sizes(out) == {"a": 1, "p": 63}  # uncapped while the model answers None
    _advance(sched, out)
    sched.add_request(_request("q", 30))
    sched.running.reverse()  # a prefill ahead of a decode, as re-admissions after preemptions can order them
    assert not is_decoding(sched.running[0]) and is_decoding(sched.running[1])
    budget.tokens = 16
    out = sched.schedule()
    assert _sizes(out) == {"p": 16, "a": 1}  # "q" waits: the cap is spent; the decode still runs
    assert out.chunks[-1].request_id == "a" and budget.asked[-1] == (1, 0.025)


def test_the_cap_yields_to_a_queue_that_would_miss_the_ttft_target() -> None:
    budget = FixedBudget(4)
    kv = KVCacheManager(256, 4, BlockHasher.for_model("t", 4), enable_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512,
                                      itl_target_ms=25.0, ttft_target_ms=100.0), kv, None, budget)
    sched.add_request(_request("a", 4))
    _advance(sched, sched.schedule())
    sched.add_request(_request("b", 20))  # 20 queued tokens in 100 ms: 200 tokens/s, 2 a step, under the cap
    assert sched.queued_prefill_tokens() == 20
    out = sched.schedule()
    assert _sizes(out) == {"a": 1, "b": 4} and out.prefill_token_cap == 4 and budget.rates == [200.0]
    _advance(sched, out)
    for name in "cde":
        sched.add_request(_request(name, 100))  # 16 + 300 queued: 3,160 tokens/s, 32 a step, over the cap
    out = sched.schedule()
    assert out.prefill_token_cap == 32 and budget.rates[-1] == 3160.0
    assert _sizes(out) == {"a": 1, "b": 16, "c": 16}
    assert sched.queued_prefill_tokens() == 316  # nothing computed until the step's output comes back


@pytest.mark.parametrize(("itl_target_ms", "chunked", "first", "second"), [
    (25.0, True, {"x": 50, "y": 14}, {"x": 1, "y": 8}),  # x decodes now: y's chunk is capped
    (None, True, {"x": 50, "y": 14}, {"x": 1, "y": 16}),  # flag off
    (25.0, False, {"x": 50}, {"x": 1, "y": 30}),  # no chunked prefill: never capped (arg_utils refuses it)
])
def test_only_steps_with_decodes_are_capped(itl_target_ms: float | None, chunked: bool, first: dict[str, int],
                                            second: dict[str, int]) -> None:
    budget = FixedBudget(8)
    kv = KVCacheManager(256, 4, BlockHasher.for_model("t", 4), enable_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512,
                                      enable_chunked_prefill=chunked, itl_target_ms=itl_target_ms), kv, None, budget)
    sched.add_request(_request("x", 50))
    sched.add_request(_request("y", 30))
    out = sched.schedule()
    assert _sizes(out) == first and budget.asked == []  # a pure prefill step runs at full speed
    _advance(sched, out)
    assert _sizes(sched.schedule()) == second
    assert len(budget.asked) == (1 if second["y"] == 8 else 0)


# ---- (c) end to end: SmolLM2 on CPU, the engine timing its steps ------------------------------------------------
SMOLLM2 = dict(model="smollm2", device="cpu", kv_cache_memory_bytes=256 << 20, max_model_len=1024)
WARM = [*PROMPTS[:6]]
LONG = "Document 1. " + " ".join(PROMPTS) * 2  # ~220 tokens
GREEDY = dict(temperature=0.0, ignore_eos=True)


def run_workload(engine: LLMEngine) -> tuple[dict[str, list[int]], list[dict[str, int]]]:
    """Staggered short requests (the step-time model learns from them), then a long prompt admitted while "d"
    decodes. Returns every request's tokens, and the chunk sizes of each step that prefilled part of the long
    prompt."""
    outputs: dict[str, list[int]] = {}
    long_steps: list[dict[str, int]] = []
    schedule = engine.scheduler.schedule

    def recording() -> SchedulerOutput:
        out = schedule()
        long = engine.scheduler.requests.get("long")
        if any(c.request_id == "long" and c.start_position < long.num_prompt_tokens for c in out.chunks):
            long_steps.append(_sizes(out))
        return out

    engine.scheduler.schedule = recording  # type: ignore[method-assign]

    def step() -> None:
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0].token_ids

    for i, prompt in enumerate(WARM):
        engine.add_request(f"w{i}", prompt, SamplingParams(max_tokens=3, **GREEDY))
        step()
        step()
    engine.add_request("d", PROMPTS[7], SamplingParams(max_tokens=24, **GREEDY))
    step()
    while not is_decoding(engine.scheduler.requests["d"]):  # its prompt may take two capped chunks
        step()
    engine.add_request("long", LONG, SamplingParams(max_tokens=4, **GREEDY))
    while engine.has_unfinished_requests():
        step()
    return outputs, long_steps


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[dict[str, list[int]], list[dict[str, int]], LLMEngine]]:
    results = {}
    # A target no step can meet: once the model has learned, every capped step carries the floor (16 tokens).
    for name, target in (("off", None), ("on", 1e-3)):
        engine = LLMEngine(EngineArgs(**SMOLLM2, itl_target_ms=target).create_engine_config())  # type: ignore[arg-type]
        results[name] = (*run_workload(engine), engine)
    return results


def test_chunking_under_the_target_never_changes_greedy_tokens(runs) -> None:  # noqa: ANN001
    off, on = runs["off"][0], runs["on"][0]
    assert set(off) == {"d", "long", *(f"w{i}" for i in range(len(WARM)))}
    assert on == off


def test_a_long_prompt_is_spread_over_steps_while_another_request_decodes(runs) -> None:  # noqa: ANN001
    _, uncapped, _ = runs["off"]
    _, capped, engine = runs["on"]
    assert len(uncapped) == 1 and uncapped[0]["long"] > 200  # off: one chunk of the whole prompt
    assert engine.step_model is not None and engine.step_model.cost() is not None  # it learned from the steps
    assert len(capped) >= 200 // 16 and sum(s["long"] for s in capped) == uncapped[0]["long"]
    assert all("d" in s for s in capped)  # "d" ran in every one of those steps ...
    assert sum(s["d"] == 1 for s in capped) >= len(capped) - 1  # ... as a decode, once its own prompt was in
    # every prefill token of those steps ("d"'s own prompt chunk too) within the floor of 16
    assert all(sum(n for rid, n in s.items() if n > 1 or rid == "long") <= 16 for s in capped)
    assert engine.stats.itl_prefill_token_budget in (0, 16)  # the last step's cap (0: nobody decoded)
    assert runs["off"][2].step_model is None


# ---- (d) the flag -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0.0, -5.0, float("nan"), float("inf")])
def test_bad_targets_are_refused_naming_the_flag(bad: float) -> None:
    with pytest.raises(ValueError, match="--itl-target-ms must be a positive number"):
        EngineArgs(model="tiny", itl_target_ms=bad).create_engine_config()


@pytest.mark.parametrize(("args", "match"), [
    ({"itl_target_ms": 30, "ttft_target_ms": 0.0}, "--ttft-target-ms must be a positive number"),
    ({"itl_target_ms": 30, "ttft_target_ms": float("nan")}, "--ttft-target-ms must be a positive number"),
    ({"ttft_target_ms": 500.0}, "--ttft-target-ms only says when the --itl-target-ms cap yields"),
])
def test_bad_ttft_targets_are_refused_naming_the_flag(args: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineArgs(model="tiny", **args).create_engine_config()


def test_the_target_needs_chunked_prefill() -> None:
    with pytest.raises(ValueError, match="--itl-target-ms needs chunked prefill"):
        EngineArgs(model="tiny", itl_target_ms=20, enable_chunked_prefill=False).create_engine_config()


def test_the_flag_reaches_the_config_and_the_workers() -> None:
    from kvflow.cli import build_parser
    from kvflow.commands.flag_compat import prepare_argv
    from kvflow.launcher import engine_argv

    assert EngineArgs(model="tiny").create_engine_config().scheduler.itl_target_ms is None
    assert EngineArgs(model="tiny", itl_target_ms=40).create_engine_config().scheduler.itl_target_ms == 40
    parser = build_parser()
    args = parser.parse_args(prepare_argv(parser, ["serve", "--itl_target_ms", "40"]))  # vLLM's spelling too
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.itl_target_ms == 40.0
    forwarded = engine_argv(engine_args)  # what `kvflow serve` hands its workers
    assert forwarded[forwarded.index("--itl-target-ms") + 1] == "40.0"
    args = parser.parse_args(prepare_argv(parser, ["serve", "--itl-target-ms", "40", "--ttft-target-ms", "400"]))
    forwarded = engine_argv(EngineArgs.from_cli_args(args))
    assert forwarded[forwarded.index("--ttft-target-ms") + 1] == "400.0"
    assert EngineArgs(model="tiny", itl_target_ms=40, ttft_target_ms=400).create_engine_config(
    ).scheduler.ttft_target_ms == 400
    back = parser.parse_args(["decode", "--port", "1", *forwarded])
    assert EngineArgs.from_cli_args(back).itl_target_ms == 40.0
    assert "--itl-target-ms" not in engine_argv(EngineArgs())  # off is not forwarded


def test_serve_refuses_a_bad_target_before_any_worker_starts(capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import kvflow.launcher
    from kvflow.cli import main

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("reached a worker start")

    monkeypatch.setattr(kvflow.launcher.WorkerCluster, "start", must_not_run)
    assert main(["serve", "--model", "tiny", "--itl-target-ms", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--itl-target-ms must be a positive number" in err[0]
