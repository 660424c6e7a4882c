"""Disaggregated prefill -> decode over gRPC with real worker processes (SmolLM2 on CPU).

Greedy outputs through the prefill and decode workers equal the unified engine's token for token (long prompts
span many 64-token prefill chunks); KV bytes match the layout; the decode side computes no prompt tokens for
transferred requests; killing either side mid-transfer strands no blocks; bad input gets INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import grpc
import pytest

from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc
from tests.helpers.pd import (
    BLOCK,
    BLOCK_BYTES,
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    MAX_MODEL_LEN,
    MAX_TOKENS,
    Worker,
    channel_to,
    generate,
    info,
    metric,
    running_pair,
    running_worker,
    settled_metric,
    wait_until,
)


@pytest.fixture(scope="module")
def tmp_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pd_logs")


@pytest.fixture(scope="module")
def cluster(tmp_logs: Path) -> Iterator[tuple[Worker, Worker]]:
    with running_pair(tmp_logs, ("--max-num-batched-tokens", "64")) as pair:
        yield pair


def test_disaggregated_greedy_equals_unified(cluster, prompt_sets, unified) -> None:  # noqa: ANN001
    prefill, decode = cluster
    prompts = prompt_sets["short"] + prompt_sets["long"]
    assert max(len(p) for p in prompts) > 20 * 64, "a long prompt must span many prefill chunks"
    prompt_tokens_before = settled_metric(decode, "vllm:prompt_tokens_total")

    async def run_all() -> list[pb.GenerateComplete]:
        return await asyncio.gather(*(asyncio.to_thread(generate, decode, p, prefill) for p in prompts))

    results = asyncio.run(run_all())
    for prompt, result in zip(prompts, results, strict=True):
        assert result.prefill_path == pb.PREFILL_PATH_DISAGGREGATED
        assert list(result.choices[0].token_ids) == unified[tuple(prompt)], f"prompt of {len(prompt)} tokens"
        assert result.usage.prompt_tokens == len(prompt)
        assert result.usage.completion_tokens == MAX_TOKENS
    # Transferred requests are never prefilled on the decode side.
    assert settled_metric(decode, "vllm:prompt_tokens_total") == prompt_tokens_before


def test_transfer_bytes_match_layout_and_skip_cached_blocks(cluster, tokenizer) -> None:  # noqa: ANN001
    prefill, decode = cluster
    base = tokenizer("A fresh prompt about copper mining in the Andes, " * 12).input_ids[:100]
    moved = settled_metric(decode, "kvflow:kv_transfer_bytes_total")

    first = generate(decode, base, prefill)
    assert first.prefill_path == pb.PREFILL_PATH_DISAGGREGATED and first.usage.cached_tokens == 0
    after_first = settled_metric(decode, "kvflow:kv_transfer_bytes_total")
    assert after_first - moved == 7 * BLOCK_BYTES  # ceil(100 / 16) blocks

    extended = base + tokenizer(" and then the rest of the story goes on for a while longer").input_ids
    extended = (extended * 3)[:150]
    second = generate(decode, extended, prefill)
    assert second.usage.cached_tokens == 96  # 6 full blocks were cached on the decode side: not sent again
    after_second = settled_metric(decode, "kvflow:kv_transfer_bytes_total")
    assert after_second - after_first == (10 - 6) * BLOCK_BYTES


def test_local_prefill_paths(cluster, prompt_sets, unified) -> None:  # noqa: ANN001
    prefill, decode = cluster
    prompt = prompt_sets["short"][3]
    no_address = generate(decode, prompt)
    assert no_address.prefill_path == pb.PREFILL_PATH_LOCAL
    assert list(no_address.choices[0].token_ids) == unified[tuple(prompt)]
    fresh = prompt_sets["short"][4]
    below_threshold = generate(decode, fresh, prefill, min_prompt_tokens=10_000)
    assert below_threshold.prefill_path == pb.PREFILL_PATH_LOCAL
    assert list(below_threshold.choices[0].token_ids) == unified[tuple(fresh)]


def test_malformed_requests_get_invalid_argument(cluster) -> None:  # noqa: ANN001
    prefill, decode = cluster
    cases = [
        (pb.GenerateRequest(sampling_params=pb.SamplingParams(max_tokens=4)), "text"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), sampling_params=pb.SamplingParams(temperature=-1)),
         "temperature"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[10**6])), "token ids"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * (MAX_MODEL_LEN + 5))), "context length"),
        (pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(top_p=0.0)), "top_p"),
    ]
    with channel_to(decode) as channel:
        _assert_refused_as_invalid(kvflow_pb2_grpc.GenerationStub(channel).Generate, cases)
    layout = info(decode).kv_layout
    bad_layout = pb.KVLayout(dtype="bfloat16", num_layers=layout.num_layers, block_size=layout.block_size,
                             num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, order=layout.order)
    prefill_cases = [
        (pb.PrefillRequest(), "empty"),
        (pb.PrefillRequest(prompt_token_ids=[1, 2, 3], expected_layout=bad_layout), "layout mismatch"),
        (pb.PrefillRequest(prompt_token_ids=[1] * 32, skip_blocks=2), "skip_blocks"),
        (pb.PrefillRequest(prompt_token_ids=[1, 2], sampling_params=pb.SamplingParams(n=2)), "n must be 1"),
    ]
    with channel_to(prefill) as channel:
        _assert_refused_as_invalid(kvflow_pb2_grpc.PrefillStub(channel).Prefill, prefill_cases)


def _assert_refused_as_invalid(rpc: Callable[..., Iterable[object]], cases: list[tuple[object, str]]) -> None:
    """Each (request, reason): the streaming `rpc` fails with INVALID_ARGUMENT, its details naming the reason."""
    for request, reason in cases:
        with pytest.raises(grpc.RpcError) as caught:
            list(rpc(request, timeout=30))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert reason in caught.value.details(), caught.value.details()


def test_info_health_metrics_and_kv_events(cluster) -> None:  # noqa: ANN001
    prefill, decode = cluster
    for worker, role in ((prefill, pb.WORKER_ROLE_PREFILL), (decode, pb.WORKER_ROLE_DECODE)):
        described = info(worker)
        assert described.role == role and described.block_size == BLOCK and described.dtype == "float32"
        assert (described.kv_layout.num_layers, described.kv_layout.num_kv_heads, described.kv_layout.head_dim) \
            == (LAYERS, KV_HEADS, HEAD_DIM)
        assert described.num_kv_blocks > 0 and described.model_id
    text = urllib.request.urlopen(f"http://127.0.0.1:{decode.metrics_port}/metrics", timeout=5).read().decode()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:time_per_output_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "kvflow:kv_transfer_bytes_total", "kvflow:kv_transfer_seconds_bucket",
                 "kvflow:kv_blocks_freed_total"):
        assert re.search(rf"^{re.escape(name)}\{{.*model_name=\"smollm2\"", text, re.M), name

    def subscribe(worker: Worker, count: int) -> list[pb.KVEventBatch]:
        with channel_to(worker) as channel:
            stub = kvflow_pb2_grpc.GenerationStub(channel) if worker.role == "decode" \
                else kvflow_pb2_grpc.PrefillStub(channel)
            batches = []
            for batch in stub.StreamKVEvents(pb.KVEventsRequest(subscriber="test"), timeout=30):
                batches.append((time.monotonic(), batch))
                if len(batches) == count:
                    return batches  # type: ignore[return-value]
        raise AssertionError("event stream ended")

    async def two_subscribers() -> list[list]:
        return await asyncio.gather(asyncio.to_thread(subscribe, decode, 4), asyncio.to_thread(subscribe, decode, 3))

    first, second = asyncio.run(two_subscribers())
    for batches in (first, second):
        snapshot = batches[0][1]
        assert snapshot.events[0].WhichOneof("event") == "cleared"
        assert len(snapshot.events) > 1, "earlier tests left cached blocks: the snapshot lists them"
        assert all(e.WhichOneof("event") == "stored" for e in snapshot.events[1:])
        assert [b.sequence for _, b in batches] == list(range(len(batches)))
        assert len({b.epoch for _, b in batches}) == 1 and snapshot.worker_id
        assert all(b.load.num_kv_blocks > 0 for _, b in batches)
        gaps = [t1 - t0 for (t0, _), (t1, _) in zip(batches[1:], batches[2:], strict=False)]
        assert all(g < 0.8 for g in gaps), gaps  # heartbeats every 500 ms
    prefill_batches = subscribe(prefill, 1)
    assert prefill_batches[0][1].events[0].WhichOneof("event") == "cleared"


def test_cancelled_prefill_stream_frees_blocks(cluster, prompt_sets) -> None:  # noqa: ANN001
    prefill, _ = cluster
    baseline = info(prefill).num_free_kv_blocks
    prompt = [t + 1 for t in prompt_sets["long"][1]]  # uncached on the prefill worker
    with channel_to(prefill) as channel:
        call = kvflow_pb2_grpc.PrefillStub(channel).Prefill(pb.PrefillRequest(
            request_id="cancel-me", prompt_token_ids=prompt, sampling_params=pb.SamplingParams(temperature=0)))
        kinds = []
        for response in call:
            kinds.append(response.WhichOneof("response"))
            if kinds.count("kv") == 2:
                break
        assert kinds[0] == "header"
        assert info(prefill).num_free_kv_blocks < baseline, "the prefill is mid-way"
        call.cancel()
    wait_until(lambda: info(prefill).num_free_kv_blocks == baseline, 3.0, "prefill blocks back to baseline")


def test_decode_killed_mid_transfer_frees_prefill_blocks(cluster, prompt_sets, tmp_logs) -> None:  # noqa: ANN001
    prefill, _ = cluster
    with running_worker("decode", tmp_logs) as doomed:
        baseline = info(prefill).num_free_kv_blocks
        prompt = [t + 2 for t in prompt_sets["long"][1]]
        pending = asyncio.new_event_loop()
        thread_future = pending.run_in_executor(None, lambda: _generate_expecting_failure(doomed, prompt, prefill))
        wait_until(lambda: info(prefill).num_free_kv_blocks < baseline, 60.0, "the transfer to start")
        doomed.process.send_signal(signal.SIGKILL)
        doomed.process.wait(10)
        wait_until(lambda: info(prefill).num_free_kv_blocks == baseline, 10.0, "prefill blocks back to baseline")
        pending.run_until_complete(thread_future)
        pending.close()


def _generate_expecting_failure(decode: Worker, prompt: list[int], prefill: Worker) -> None:
    with pytest.raises(grpc.RpcError):
        generate(decode, prompt, prefill)


def test_prefill_killed_mid_transfer_decode_recomputes(cluster, prompt_sets, unified, tmp_logs) -> None:  # noqa: ANN001
    _, decode = cluster
    with running_worker("prefill", tmp_logs, "--max-num-batched-tokens", "64") as doomed:
        decode_baseline = info(decode).num_free_kv_blocks
        prefill_baseline = info(doomed).num_free_kv_blocks
        fallbacks = metric(decode, "kvflow:disagg_fallback_total")
        prompt = prompt_sets["long"][0]
        # Drop the decode worker's cached copy so the whole prompt must come from (or be recomputed after) the
        # doomed prefill worker: a unique salt changes every block hash.
        complete = _complete_after_transfer_starts(
            decode, _greedy_request(prompt, doomed, salt="kill-prefill"),
            started=lambda: info(doomed).num_free_kv_blocks < prefill_baseline,
            then=lambda: doomed.process.send_signal(signal.SIGKILL))
        assert complete.prefill_path == pb.PREFILL_PATH_LOCAL
        assert list(complete.choices[0].token_ids) == unified[tuple(prompt)]
        wait_until(lambda: metric(decode, "kvflow:disagg_fallback_total") > fallbacks, 5.0, "fallback counted")
        assert metric(decode, "kvflow:disagg_fallback_total", 'reason="prefill_unavailable"') >= 1
        assert info(decode).num_free_kv_blocks == decode_baseline


def test_sigterm_drains_in_flight_prefill(cluster, prompt_sets, unified) -> None:  # noqa: ANN001
    """Last test of the module: it stops the shared prefill worker."""
    prefill, decode = cluster
    prompt = prompt_sets["long"][0]
    baseline = info(prefill).num_free_kv_blocks
    complete = _complete_after_transfer_starts(
        decode, _greedy_request(prompt, prefill, salt="drain"),
        started=lambda: info(prefill).num_free_kv_blocks < baseline,
        then=lambda: prefill.process.send_signal(signal.SIGTERM))
    assert complete.prefill_path == pb.PREFILL_PATH_DISAGGREGATED, "the in-flight prefill finished before exit"
    assert list(complete.choices[0].token_ids) == unified[tuple(prompt)]
    assert prefill.process.wait(40) == 0


def _greedy_request(prompt: list[int], prefill: Worker, salt: str) -> pb.GenerateRequest:
    """A non-streaming greedy request prefilled by `prefill`; `salt` gives its blocks hashes of their own."""
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), stream=False, cache_salt=[salt],
                              sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                              disaggregation=pb.DisaggregationParams(prefill_address=prefill.address))


def _complete_after_transfer_starts(decode: Worker, request: pb.GenerateRequest, started: Callable[[], bool],
                                    then: Callable[[], object]) -> pb.GenerateComplete:
    """Send `request` to `decode`; once `started()` holds (the KV transfer is under way), `then()`; the final
    message of the reply."""
    with channel_to(decode) as channel:
        call = kvflow_pb2_grpc.GenerationStub(channel).Generate(request, timeout=300)
        wait_until(started, 60.0, "the transfer to start")
        then()
        responses = list(call)
    return responses[-1].complete
