"""The NCCL-shaped KV path on CPU: prefill and decode workers with `--kv-transfer-backend nccl` move KV over a
torch.distributed link, which is gloo between CPU workers (the same code as NCCL between GPUs, minus streams).

Greedy outputs equal the unified engine's; the bytes are counted under backend="gloo"; an Abort mid-transfer
keeps the link usable; a prefill worker killed mid-transfer is detected within 2 s and the decode side recomputes,
and a new link is built when it comes back; a hung (stopped) prefill worker is detected by its missing
heartbeats and never stalls the decode worker's other requests; a decode worker killed mid-transfer strands no
prefill blocks.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc
from tests.helpers.pd import (
    BLOCK,
    BLOCK_BYTES,
    MAX_TOKENS,
    Worker,
    abort_mid_transfer,
    channel_to,
    generate,
    info,
    metric,
    running_pair,
    running_worker,
    settled_metric,
    start_worker,
    wait_healthy,
    wait_until,
)

LINK = ("--kv-transfer-backend", "nccl")
SLOW_PREFILL = ("--max-num-batched-tokens", "64")  # long prompts take many steps: time to act mid-transfer


@pytest.fixture(scope="module")
def tmp_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pd_link_logs")


@pytest.fixture(scope="module")
def cluster(tmp_logs: Path) -> Iterator[tuple[Worker, Worker]]:
    with running_pair(tmp_logs, (*LINK, *SLOW_PREFILL), LINK) as pair:
        yield pair


def _gloo_bytes(worker: Worker) -> float:
    return metric(worker, "kvflow:kv_transfer_bytes_total", 'backend="gloo"')


def test_link_transfer_greedy_equals_unified(cluster, prompt_sets, unified) -> None:  # noqa: ANN001
    prefill, decode = cluster
    prompts = prompt_sets["short"] + prompt_sets["long"]
    prompt_tokens_before = settled_metric(decode, "vllm:prompt_tokens_total")

    async def run_all() -> list[pb.GenerateComplete]:
        return await asyncio.gather(*(asyncio.to_thread(generate, decode, p, prefill) for p in prompts))

    results = asyncio.run(run_all())  # concurrent pulls interleave their slices on one link
    for prompt, result in zip(prompts, results, strict=True):
        assert result.prefill_path == pb.PREFILL_PATH_DISAGGREGATED
        assert list(result.choices[0].token_ids) == unified[tuple(prompt)], f"prompt of {len(prompt)} tokens"
    assert settled_metric(decode, "vllm:prompt_tokens_total") == prompt_tokens_before
    blocks = sum(-(-len(p) // BLOCK) for p in prompts)
    # Metrics export every ~0.5 s: wait for the expected total on each side, then check that it holds.
    for worker in (decode, prefill):
        wait_until(lambda w=worker: _gloo_bytes(w) >= blocks * BLOCK_BYTES, 30.0,
                   f"every block's bytes counted on the {worker.role} side")
        assert settled_metric(worker, "kvflow:kv_transfer_bytes_total", 'backend="gloo"') == blocks * BLOCK_BYTES
    assert metric(decode, "kvflow:kv_transfer_bytes_total", 'backend="grpc"') == 0


def test_abort_mid_transfer_keeps_the_link(cluster, prompt_sets, unified) -> None:  # noqa: ANN001
    prefill, decode = cluster
    decode_baseline = info(decode).num_free_kv_blocks
    prefill_baseline = info(prefill).num_free_kv_blocks
    prompt = [t + 3 for t in prompt_sets["long"][1]]  # uncached on both sides
    finish_reason = abort_mid_transfer(decode, prefill, prompt, prefill_baseline, 60.0)
    assert finish_reason == pb.FINISH_REASON_ABORT
    wait_until(lambda: info(decode).num_free_kv_blocks == decode_baseline, 10.0, "decode blocks back to baseline")
    wait_until(lambda: info(prefill).num_free_kv_blocks == prefill_baseline, 10.0, "prefill blocks back")
    moved = _gloo_bytes(decode)
    again = generate(decode, prompt_sets["short"][0], prefill)  # the same link still pairs its messages
    assert again.prefill_path == pb.PREFILL_PATH_DISAGGREGATED
    assert list(again.choices[0].token_ids) == unified[tuple(prompt_sets["short"][0])]
    wait_until(lambda: _gloo_bytes(decode) > moved, 5.0, "bytes over the link")


def test_prefill_killed_mid_transfer_recomputes_and_link_is_rebuilt(cluster, prompt_sets, unified,
                                                                     tmp_logs) -> None:  # noqa: ANN001
    _, decode = cluster
    with running_worker("prefill", tmp_logs, *LINK, *SLOW_PREFILL) as doomed:
        warm = generate(decode, [t + 5 for t in prompt_sets["short"][1]], doomed)  # opens the link
        assert warm.prefill_path == pb.PREFILL_PATH_DISAGGREGATED
        decode_baseline = info(decode).num_free_kv_blocks
        prefill_baseline = info(doomed).num_free_kv_blocks
        fallbacks = metric(decode, "kvflow:disagg_fallback_total")
        prompt = prompt_sets["long"][0]
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), stream=True, cache_salt=["kill-link"],
                                     sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                                     disaggregation=pb.DisaggregationParams(prefill_address=doomed.address))
        first_token_at: list[float] = []
        tokens: list[int] = []

        def consume() -> None:
            with channel_to(decode) as channel:
                for response in kvflow_pb2_grpc.GenerationStub(channel).Generate(request, timeout=300):
                    if response.WhichOneof("response") == "chunk" and not first_token_at:
                        first_token_at.append(time.monotonic())
                    if response.WhichOneof("response") == "complete":
                        tokens.extend(response.complete.choices[0].token_ids)
                        assert response.complete.prefill_path == pb.PREFILL_PATH_LOCAL

        reader = threading.Thread(target=consume)
        reader.start()
        wait_until(lambda: info(doomed).num_free_kv_blocks < prefill_baseline, 60.0, "the transfer to start")
        doomed.process.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        wait_until(lambda: metric(decode, "kvflow:disagg_fallback_total") > fallbacks, 2.0 + 1.0,
                   "the decode worker to notice the dead peer (2 s, plus the metrics export period)")
        detected = time.monotonic() - killed_at
        reader.join(120)
        assert tokens == unified[tuple(prompt)], "recomputed locally, same greedy output"
        assert first_token_at and detected < 3.0
        wait_until(lambda: info(decode).num_free_kv_blocks == decode_baseline, 10.0, "no stranded decode blocks")

        # the peer comes back at the same address
        with running_worker("prefill", tmp_logs, *LINK, port=doomed.port) as reborn:
            moved = _gloo_bytes(decode)
            prompt = [t + 7 for t in prompt_sets["short"][2]]
            deadline = time.monotonic() + 10
            result = generate(decode, prompt, reborn)
            while result.prefill_path != pb.PREFILL_PATH_DISAGGREGATED and time.monotonic() < deadline:
                time.sleep(0.5)  # a pull right after the failure may still be inside the reopen backoff
                prompt = [t + 1 for t in prompt]
                result = generate(decode, prompt, reborn)
            assert result.prefill_path == pb.PREFILL_PATH_DISAGGREGATED, "a new link to the restarted peer"
            wait_until(lambda: _gloo_bytes(decode) > moved, 5.0, "bytes over the new link")


def test_hung_prefill_worker_is_detected_and_decode_keeps_serving(cluster, prompt_sets, unified,
                                                                   tmp_logs) -> None:  # noqa: ANN001
    _, decode = cluster
    hung = start_worker("prefill", tmp_logs, *LINK, *SLOW_PREFILL)
    try:
        wait_healthy(hung)
        assert generate(decode, [t + 9 for t in prompt_sets["short"][1]], hung).prefill_path == \
            pb.PREFILL_PATH_DISAGGREGATED
        baseline = info(hung).num_free_kv_blocks
        decode_baseline = info(decode).num_free_kv_blocks
        prompt = prompt_sets["long"][0]
        outcome: dict[str, object] = {}

        def consume() -> None:
            outcome["complete"] = generate(decode, prompt, hung)
            outcome["at"] = time.monotonic()

        reader = threading.Thread(target=consume)
        reader.start()
        wait_until(lambda: info(hung).num_free_kv_blocks < baseline, 60.0, "the transfer to start")
        hung.process.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        # Meanwhile the decode worker serves other requests: its engine never waits on the hung link.
        other = generate(decode, prompt_sets["short"][0])
        assert list(other.choices[0].token_ids) == unified[tuple(prompt_sets["short"][0])]
        reader.join(120)
        complete = outcome["complete"]
        assert isinstance(complete, pb.GenerateComplete) and complete.prefill_path == pb.PREFILL_PATH_LOCAL
        assert list(complete.choices[0].token_ids) == unified[tuple(prompt)]
        # Detection (2 s without heartbeat) plus the local recompute of the prompt.
        assert float(outcome["at"]) - stopped_at < 30.0  # type: ignore[arg-type]
        wait_until(lambda: info(decode).num_free_kv_blocks == decode_baseline, 10.0, "no stranded decode blocks")
    finally:
        if hung.process.poll() is None:
            hung.process.send_signal(signal.SIGCONT)
        hung.stop()


def test_decode_killed_mid_transfer_frees_prefill_blocks(cluster, prompt_sets, tmp_logs) -> None:  # noqa: ANN001
    prefill, _ = cluster
    with running_worker("decode", tmp_logs, *LINK) as doomed:
        baseline = info(prefill).num_free_kv_blocks
        prompt = [t + 4 for t in prompt_sets["long"][1]]

        def doomed_request() -> None:
            with pytest.raises(grpc.RpcError):
                generate(doomed, prompt, prefill)

        reader = threading.Thread(target=doomed_request)
        reader.start()
        wait_until(lambda: info(prefill).num_free_kv_blocks < baseline, 60.0, "the transfer to start")
        doomed.process.send_signal(signal.SIGKILL)
        doomed.process.wait(10)
        wait_until(lambda: info(prefill).num_free_kv_blocks == baseline, 10.0, "prefill blocks back to baseline")
        reader.join(30)
