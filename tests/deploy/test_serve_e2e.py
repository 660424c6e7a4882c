"""A real `kvflow serve` on SmolLM2 (1 prefill + 1 decode worker) driven by the real `openai` SDK and kvflow's
gRPC client: completions and chat, streaming, usage, stop, n, greedy parity with the offline `LLM`, metrics,
API key, 4xx for bad input, workers that refuse callers without the generated cluster token (handed over in the
environment, never the command line), and a clean shutdown with no orphan workers."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from cluster.auth import TOKEN_ENV, ClusterAuth
from kvflow.client import Client, InvalidArgumentError
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc
from tests.helpers.serve import API_KEY, Server, _children

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline_greedy() -> str:
    from engine.sampling_params import SamplingParams
    from kvflow import LLM

    llm = LLM("smollm2", kv_cache_memory_bytes=64 << 20, max_model_len=1024)
    text = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    del llm
    return text


def test_models_and_health(server: Server, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_completion_greedy_matches_offline_llm(client: openai.OpenAI, offline_greedy: str) -> None:
    result = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=16, temperature=0)
    assert result.choices[0].text == offline_greedy
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 16 and result.usage.prompt_tokens > 0


def test_streaming_completion_concatenates_to_the_same_text(client: openai.OpenAI, offline_greedy: str) -> None:
    chunks = list(client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline_greedy
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_chat_stream_and_non_stream(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is 2+2?"}]
    full = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0)
    assert full.choices[0].message.role == "assistant" and full.choices[0].message.content
    stream = list(client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == full.choices[0].message.content
    assert stream[-1].usage.total_tokens == full.usage.total_tokens


def test_stop_n_logprobs_and_request_id(server: Server, client: openai.OpenAI) -> None:
    stopped = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=16, temperature=0,
                                        stop=["."])
    assert "." not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"
    many = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=1, n=3,
                                     logprobs=2)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert all(len(c.logprobs.tokens) == 6 and len(c.logprobs.top_logprobs[0]) >= 1 for c in many.choices)
    assert many.usage.completion_tokens == 18
    chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                          max_completion_tokens=3, logprobs=True, top_logprobs=2)
    assert len(chat.choices[0].logprobs.content) == 3 and len(chat.choices[0].logprobs.content[0].top_logprobs) == 2
    response = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}",
                                                                   "x-request-id": "my-id-1"},
                          json={"prompt": PROMPT, "max_tokens": 2, "unknown_field": 1}, timeout=60)
    assert response.status_code == 200 and response.headers["x-request-id"] == "my-id-1"


@pytest.mark.parametrize(("body", "status", "needle"), [
    (b"{not json", 400, "not valid JSON"),
    ({"model": "smollm2", "prompt": 5}, 400, "prompt"),
    ({"model": "smollm2", "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "does not exist"),
    ({"model": "smollm2", "prompt": "hi " * 1100}, 400, "maximum context length"),
    ({"model": "smollm2", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "smollm2", "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"model": "smollm2", "prompt": "hi", "max_tokens": 2000}, 400, "maximum context length"),
    ({"model": "smollm2", "prompt": [10**10] + [1] * 20}, 400, "token ids"),  # once a block-hashing overflow (500)
    (b'{"model": "smollm2", "prompt": "\\ud800"}', 400, "surrogate"),
    (b'{"model": "smollm2", "prompt": "hi", "temperature": NaN}', 400, "not valid JSON"),
    ({"model": "smollm2", "prompt": "hi", "suffix": "x"}, 400, "suffix"),
])
def test_bad_requests_get_4xx_with_reason(server: Server, body: object, status: int, needle: str) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(f"{server.url}/v1/completions", headers=headers, timeout=30, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert needle in error["message"] and set(error) >= {"message", "type", "param", "code"}


def test_chat_bad_messages_and_api_key(server: Server) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    bad = httpx.post(f"{server.url}/v1/chat/completions", headers=headers, json={"messages": "hi"}, timeout=30)
    assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200  # probes need no key


def test_grpc_sdk_against_the_router(server: Server, offline_greedy: str) -> None:
    with Client(f"127.0.0.1:{server.grpc_port}", api_key=API_KEY, timeout=60) as sdk:
        result = sdk.generate(PROMPT, max_tokens=16, temperature=0)
        assert result.text == offline_greedy and result.prefill_path == "disaggregated"
        pieces = list(sdk.generate_stream(PROMPT, max_tokens=16, temperature=0))
        assert "".join(p.text for p in pieces[:-1]) == offline_greedy
        with pytest.raises(InvalidArgumentError, match="top_p"):
            sdk.generate(PROMPT, max_tokens=4, top_p=2.0)


def test_logit_bias_reaches_prefill_and_decode_workers(server: Server, client: openai.OpenAI) -> None:
    """The first token is sampled on the prefill worker, the rest on the decode worker: both must apply the bias."""
    with Client(f"127.0.0.1:{server.grpc_port}", api_key=API_KEY, timeout=60) as sdk:
        forced = sdk.generate(PROMPT, max_tokens=4, temperature=0, ignore_eos=True, logit_bias={42: 100})
    assert forced.choices[0].token_ids == [42] * 4 and forced.prefill_path == "disaggregated"
    http = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=4, temperature=0,
                                     logit_bias={"42": 100})
    assert http.choices[0].text == forced.text


def test_metrics_count_disaggregated_requests(server: Server, client: openai.OpenAI) -> None:
    def value(name: str) -> float:
        for line in httpx.get(f"{server.url}/metrics").text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = value('kvflow:requests_total{path="disaggregated"}')
    for _ in range(2):
        client.completions.create(model="smollm2", prompt=PROMPT + " a city", max_tokens=2)
    assert value('kvflow:requests_total{path="disaggregated"}') == before + 2
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:time_per_output_token_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "kvflow:route_prefix_matched_blocks_total",
                 'kvflow:route_decisions_total{policy="prefix"}', "kvflow:index_lag_seconds_bucket",
                 "kvflow:index_unavailable_total"):
        assert name in text, name


def test_workers_refuse_callers_without_the_cluster_token(server: Server) -> None:
    workers = {}
    for pid in _children(server.process.pid):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        if "kvflow.cli" not in argv:
            continue
        environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().decode()
                       .split("\0") if "=" in item)
        workers[argv[argv.index("kvflow.cli") + 1]] = (argv, environ.get(TOKEN_ENV, ""))
    assert set(workers) == {"prefill", "decode"}
    (prefill_argv, token), (decode_argv, decode_token) = workers["prefill"], workers["decode"]
    assert len(token) >= 32 and decode_token == token  # generated by serve, one per cluster
    assert not any(token in " ".join(argv) for argv, _ in workers.values())  # `ps` never shows it
    prefill_address = f"127.0.0.1:{prefill_argv[prefill_argv.index('--port') + 1]}"
    assert decode_argv[decode_argv.index("--prefill-allowlist") + 1] == prefill_address
    for role, (argv, _) in workers.items():
        address = f"127.0.0.1:{argv[argv.index('--port') + 1]}"
        for auth in (ClusterAuth(), ClusterAuth(API_KEY * 4)):
            with auth.channel(address) as channel:
                stub = kvflow_pb2_grpc.PrefillStub(channel) if role == "prefill" \
                    else kvflow_pb2_grpc.GenerationStub(channel)
                with pytest.raises(grpc.RpcError) as caught:
                    stub.Abort(pb.AbortRequest(request_id="x"), timeout=10)
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, role
                assert stub.Info(pb.InfoRequest(), timeout=10).model == ""  # probes get role and version only
        with ClusterAuth(token).channel(address) as channel:
            stub = kvflow_pb2_grpc.PrefillStub(channel) if role == "prefill" else kvflow_pb2_grpc.GenerationStub(channel)
            assert not stub.Abort(pb.AbortRequest(request_id="x"), timeout=10).found
            assert stub.Info(pb.InfoRequest(), timeout=10).model == "smollm2"


@pytest.mark.stops_shared_server
def test_sigterm_stops_everything(server: Server) -> None:
    children = _children(server.process.pid)
    assert len(children) >= 2  # the two workers
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(60) == 0
    deadline = time.monotonic() + 15
    while any(Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid) for pid in children):
        assert time.monotonic() < deadline, "worker processes outlived kvflow serve"
        time.sleep(0.2)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "zombie"
