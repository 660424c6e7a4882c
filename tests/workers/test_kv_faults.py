"""Injected KV-transfer faults (`--kv-transfer-fault-rate`) on both workers, over the torch.distributed link (gloo
on CPU): every request still answers with the unified engine's greedy tokens (the decode side recomputes what a
fault cut), faults are counted, the link keeps pairing its messages, and no block is stranded on either side."""

from __future__ import annotations

import random
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from engine.arg_utils import EngineArgs
from kvflow import LLM, SamplingParams
from kvflow.launcher import ClusterSpec, WorkerCluster, free_port
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc

ENGINE = EngineArgs(model="tiny", num_gpu_blocks_override=400, max_model_len=1024)
RATE = 0.3
NUM_REQUESTS = 24
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[WorkerCluster, int]]:
    metrics_port = free_port()
    spec = ClusterSpec(ENGINE, prefill_workers=1, decode_workers=1, log_dir=tmp_path_factory.mktemp("workers"),
                       kv_transfer_backend="nccl",
                       worker_extra_args=("--kv-transfer-fault-rate", str(RATE), "--max-num-batched-tokens", "64"),
                       decode_extra_args=("--metrics-port", str(metrics_port)))
    with WorkerCluster(spec) as workers:
        workers.wait_ready(300, progress=False)
        yield workers, metrics_port


def free_blocks(address: str, role: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = kvflow_pb2_grpc.GenerationStub(channel) if role == "decode" else kvflow_pb2_grpc.PrefillStub(channel)
        return stub.Info(pb.InfoRequest(), timeout=10).num_free_kv_blocks


def test_faulty_transfers_still_answer_exactly_and_strand_nothing(cluster: tuple[WorkerCluster, int]) -> None:
    workers, metrics_port = cluster
    prefill, decode = workers.addresses("prefill")[0], workers.addresses("decode")[0]
    baseline = {prefill: free_blocks(prefill, "prefill"), decode: free_blocks(decode, "decode")}
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(40, 400))] for _ in range(NUM_REQUESTS)]
    llm = LLM("tiny", load_format="dummy", num_gpu_blocks_override=400, max_model_len=1024)
    expected = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                   ignore_eos=True))]

    def run(prompt: list[int]) -> pb.GenerateComplete:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling_params=pb.SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
            disaggregation=pb.DisaggregationParams(prefill_address=prefill))
        with grpc.insecure_channel(decode) as channel:
            return list(kvflow_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120))[-1].complete

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, prompts))
    for got, want in zip(results, expected, strict=True):
        assert list(got.choices[0].token_ids) == want
    paths = [r.prefill_path for r in results]
    assert pb.PREFILL_PATH_LOCAL in paths, "some transfers were cut and recomputed"
    assert pb.PREFILL_PATH_DISAGGREGATED in paths, "and the link still carries the others"
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    counted = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("kvflow:disagg_fallback_total{"))
    assert counted == paths.count(pb.PREFILL_PATH_LOCAL)
    assert 'reason="injected_fault"' in text or 'reason="prefill_unavailable"' in text
    deadline = time.monotonic() + 10  # leases and aborts settle within the 10 s lease
    while time.monotonic() < deadline:
        if all(free_blocks(a, r) == baseline[a] for a, r in ((prefill, "prefill"), (decode, "decode"))):
            break
        time.sleep(0.2)
    assert free_blocks(prefill, "prefill") == baseline[prefill], "no prefill block stranded"
    assert free_blocks(decode, "decode") == baseline[decode], "no decode block stranded"
