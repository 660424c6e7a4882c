"""vLLM's periodic stats line: format, interval deltas, and who logs it by default."""

from __future__ import annotations

import logging

import pytest

from engine.arg_utils import EngineArgs
from engine.metrics.stat_logger import StatLogger
from engine.metrics.stats import EngineStats
from kvflow.cli import build_parser
from kvflow.launcher import ClusterSpec, Placement, WorkerCluster


def test_line_reports_interval_throughput_state_and_hit_rate() -> None:
    lines: list[str] = []
    logger = StatLogger("cuda", interval_s=10.0, log=lines.append)
    assert logger.observe(EngineStats(prompt_tokens=100, generation_tokens=10), now=0.0) is None
    assert logger.observe(EngineStats(prompt_tokens=500), now=5.0) is None  # not yet an interval
    line = logger.observe(EngineStats(prompt_tokens=1100, generation_tokens=510, num_requests_running=7,
                                      num_requests_waiting=2, num_requests_swapped=1, kv_cache_usage=0.412,
                                      prefix_cache_queries=200, prefix_cache_hits=126, num_preemptions=3), now=10.0)
    assert line == ("Engine 000: Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 50.0 tokens/s, "
                    "Running: 7 reqs, Swapped: 1 reqs, Waiting: 2 reqs, GPU KV cache usage: 41.2%, "
                    "Prefix cache hit rate: 63.0%, Preemptions: 3")
    assert lines == [line]
    quiet = logger.observe(EngineStats(prompt_tokens=1100, generation_tokens=510, prefix_cache_queries=200,
                                       prefix_cache_hits=126), now=20.0)
    assert quiet is not None and "Avg prompt throughput: 0.0" in quiet and "hit rate: 0.0%" in quiet
    tiered = logger.observe(EngineStats(prefix_cache_queries=400, prefix_cache_hits=126,
                                        external_prefix_cache_queries=200, external_prefix_cache_hits=48), now=30.0)
    assert tiered is not None and "Prefix cache hit rate: 0.0%, External prefix cache hit rate: 24.0%, " in tiered
    assert "CPU KV cache usage" in (StatLogger("cpu", interval_s=0.0, log=lambda _: None).observe(
        EngineStats(), now=0.0) or StatLogger("cpu").cache_label)


@pytest.mark.parametrize("argv,disabled", [
    (["serve"], False), (["serve", "--disable-log-stats"], True),
    (["prefill", "--port", "1"], False), (["decode", "--port", "1", "--disable-log-stats"], True),
    (["generate", "hi"], True),  # offline, like vLLM's LLM: no stats line unless asked
])
def test_servers_log_stats_by_default_and_the_flag_silences_them(argv: list[str], disabled: bool) -> None:
    ns = build_parser().parse_args([*argv, "--model", "tiny"])
    assert ns.disable_log_stats is disabled


def test_llm_with_stats_enabled_logs_the_line(caplog: pytest.LogCaptureFixture) -> None:
    from kvflow import LLM, SamplingParams

    llm = LLM("tiny", load_format="dummy", kv_cache_memory_bytes=16 << 20, disable_log_stats=False)
    llm._stat_logger.interval_s = 0.0  # type: ignore[union-attr]
    with caplog.at_level(logging.INFO, logger="kvflow.stats"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert any("Avg generation throughput" in r.getMessage() for r in caplog.records)
    assert LLM("tiny", load_format="dummy", kv_cache_memory_bytes=16 << 20)._stat_logger is None


def test_cluster_workers_get_the_flag_only_when_stats_are_disabled(tmp_path) -> None:  # noqa: ANN001
    for disabled in (True, False):
        cluster = WorkerCluster(ClusterSpec(EngineArgs(model="tiny", disable_log_stats=disabled), 0, 1,
                                            log_dir=tmp_path))
        argv = cluster.worker_argv(0, Placement("decode", None, None), 12345)
        assert ("--disable-log-stats" in argv) is disabled
        assert argv[argv.index("--port") + 1] == "12345"


def test_gauges_published_while_idle_read_the_engine_now() -> None:
    """An abort between steps frees KV without a step: the stats an idle engine publishes must not keep the last
    step's usage (AsyncEngine refreshes the gauges before it publishes)."""
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine.from_engine_args(EngineArgs(model="tiny", load_format="dummy", kv_cache_memory_bytes=16 << 20,
                                                   enable_prefix_caching=False))
    engine.add_request("a", {"prompt_token_ids": list(range(5, 69))}, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    busy = engine.stats.kv_cache_usage
    assert busy > 0 and engine.stats.num_requests_running == 1
    engine.abort_request("a")
    assert engine.stats.kv_cache_usage == busy  # stale until something reads the engine again
    engine.refresh_gauges()
    assert engine.stats.kv_cache_usage == 0.0 and engine.stats.num_requests_running == 0


def test_an_idle_async_engine_publishes_the_usage_an_abort_freed() -> None:
    import asyncio

    from engine.async_engine import AsyncEngine
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine.from_engine_args(EngineArgs(model="tiny", load_format="dummy", kv_cache_memory_bytes=16 << 20,
                                                   enable_prefix_caching=False))
    published: list[float] = []

    def prefill_then_abort(e: LLMEngine) -> float:
        e.add_request("a", {"prompt_token_ids": list(range(5, 69))}, SamplingParams(max_tokens=8, ignore_eos=True))
        e.step()
        busy = e.stats.kv_cache_usage
        e.abort_request("a")
        return busy

    async def run() -> float:
        aengine = AsyncEngine(engine, stats_interval_s=0.0, on_stats=lambda stats, _: published.append(
            stats.kv_cache_usage))
        aengine.start()
        try:
            busy = await aengine.call(prefill_then_abort)
            published.clear()
            while not published:
                await asyncio.sleep(0.05)
            return busy
        finally:
            await aengine.stop()

    assert asyncio.run(run()) > 0 and published[-1] == 0.0
