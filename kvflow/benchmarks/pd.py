"""`kvflow bench pd`: what disaggregation costs a request. One prefill and one decode worker (each on its own GPU
when there are two; each role may be tensor-parallel, and there may be several decode workers, each then measured
in turn), then per prompt length, on fresh random prompts (no cache hit on either side):

- TTFT through the decode worker with local prefill, and disaggregated (the prefill worker computes, the KV moves
  over `--kv-transfer-backend`), alternating;
- the transfer itself: KV bytes over the decode side's wire time (first slice in -> last block written), and its
  share of the disaggregated TTFT. With tensor-parallel decode workers the bytes are every decode rank's heads
  (cluster/transfer/link/heads.py: each rank receives the heads it holds), not rank 0's alone.

Runs are alternated (local, disaggregated, local, ...) after a warm-up of both paths at each length (link setup,
kernel compilation). Records carry `workload`, `device`, `prompt_tokens`, `transfer_gbps`, `ttft_disagg_s`,
`ttft_local_s`. Reports numbers; asserts nothing. The workers hold a cluster token (KVFLOW_CLUSTER_TOKEN, or a
fresh one) that the benchmark presents.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from cluster.auth import ClusterAuth
from engine.arg_utils import EngineArgs
from kvflow.benchmarks.throughput import host_context
from kvflow.launcher import ClusterSpec, WorkerCluster
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc

LOCAL_ONLY = 1 << 30  # min_prompt_tokens that no prompt reaches: the decode worker prefills locally


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return host_context()["cpu_model"]


@contextmanager
def ready_workers(cluster: WorkerCluster, ready_timeout_s: float
                  ) -> Iterator[tuple[str, list[tuple[str, kvflow_pb2_grpc.GenerationStub]]]]:
    """A started cluster, once ready: (the first prefill worker's address, (address, Generation stub presenting the
    cluster token) of each decode worker)."""
    cluster.wait_ready(ready_timeout_s, progress=False)
    with ExitStack() as channels:
        decodes = [(address, kvflow_pb2_grpc.GenerationStub(channels.enter_context(cluster.spec.auth.channel(address))))
                   for address in cluster.addresses("decode")]
        yield cluster.addresses("prefill")[0], decodes


@contextmanager
def pd_workers(spec: ClusterSpec, ready_timeout_s: float
               ) -> Iterator[tuple[WorkerCluster, str, list[tuple[str, kvflow_pb2_grpc.GenerationStub]]]]:
    """The cluster of `spec` started and ready: (cluster, then as `ready_workers`)."""
    with WorkerCluster(spec) as cluster, ready_workers(cluster, ready_timeout_s) as (prefill, decodes):
        yield cluster, prefill, decodes


@contextmanager
def pd_pair(spec: ClusterSpec, ready_timeout_s: float) -> Iterator[tuple[WorkerCluster, str, str, Any]]:
    """The cluster of `spec` started and ready: (cluster, prefill address, decode address, a Generation stub on the
    (first) decode worker presenting the cluster token)."""
    with pd_workers(spec, ready_timeout_s) as (cluster, prefill, decodes):
        (decode, stub), *_ = decodes
        yield cluster, prefill, decode, stub


def _one(stub: kvflow_pb2_grpc.GenerationStub, prompt: list[int], prefill_address: str, local: bool,
         output_len: int) -> dict[str, Any]:
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt), stream=True,
        sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True),
        disaggregation=pb.DisaggregationParams(prefill_address=prefill_address,
                                               min_prompt_tokens=LOCAL_ONLY if local else 0))
    started = time.perf_counter()
    ttft = None
    for response in stub.Generate(request, timeout=600):
        kind = response.WhichOneof("response")
        if kind == "chunk" and ttft is None:
            ttft = time.perf_counter() - started
        elif kind == "complete":
            done = response.complete
            t = done.timings
            return {"ttft_s": ttft if ttft is not None else time.perf_counter() - started,
                    "path": "disaggregated" if done.prefill_path == pb.PREFILL_PATH_DISAGGREGATED else "local",
                    "decode_ttft_s": t.ttft_s, "decode_queue_s": t.queue_s, "pull_s": t.prefill_s,
                    "wire_s": t.kv_transfer_s, "prefill_worker_queue_s": t.remote.queue_s,
                    "prefill_worker_first_token_s": t.remote.prefill_s, "prefill_worker_done_s": t.remote.e2e_s}
        elif kind == "error":
            raise RuntimeError(f"request failed: {response.error.code}: {response.error.message}")
    raise RuntimeError("the stream ended without a complete message")


def _timed_runs(stubs: list[kvflow_pb2_grpc.GenerationStub], fresh: Any, prefill: str, reps: int, output_len: int
                ) -> dict[str, list[dict[str, Any]]]:
    """Local and disaggregated TTFTs, alternating, after a warm-up of both paths (link setup, kernels) on each
    decode worker; `reps` of each per decode worker, one request at a time (each run names its `decode_worker`)."""
    for stub in stubs:
        for local in (True, False, True, False):
            _one(stub, fresh(), prefill, local, output_len)
    runs: dict[str, list[dict[str, Any]]] = {"local": [], "disaggregated": []}
    for _ in range(reps):
        for index, stub in enumerate(stubs):
            for local in (True, False):
                run = _one(stub, fresh(), prefill, local, output_len)
                runs["local" if local else "disaggregated"].append({**run, "decode_worker": index})
    return runs


def _length_record(runs: dict[str, list[dict[str, Any]]], kv_bytes: int) -> dict[str, Any]:
    disagg = runs["disaggregated"]
    wire = statistics.median(r["wire_s"] for r in disagg)
    ttft_disagg = statistics.median(r["ttft_s"] for r in disagg)
    ttft_local = statistics.median(r["ttft_s"] for r in runs["local"])
    return {
        "kv_bytes": kv_bytes, "transfer_ms": wire * 1e3, "transfer_gbps": kv_bytes / wire / 1e9 if wire > 0 else None,
        "ttft_disagg_s": ttft_disagg, "ttft_local_s": ttft_local, "ttft_ratio": ttft_disagg / ttft_local,
        "transfer_share_of_ttft": wire / ttft_disagg,
        "breakdown_ms": {key: statistics.median(r[key] for r in disagg) * 1e3 for key in (
            "decode_queue_s", "pull_s", "wire_s", "prefill_worker_queue_s", "prefill_worker_first_token_s",
            "prefill_worker_done_s", "decode_ttft_s")},
        "local_decode_ttft_ms": statistics.median(r["decode_ttft_s"] for r in runs["local"]) * 1e3,
        "all_disaggregated": {r["path"] for r in disagg} == {"disaggregated"},
    }


def received_kv_heads(engine_args: EngineArgs, info: pb.InfoResponse) -> int:
    """KV heads a decode worker receives per token: its layout's (rank 0's) with one rank, else the sum over its
    ranks of the distinct heads each holds (the model's shard plan; a replicated head reaches each rank holding it)."""
    size = info.tensor_parallel_size or 1
    if size == 1:
        return info.kv_layout.num_kv_heads
    from engine.models.loader import resolve_model
    from engine.parallel.layout import shard_for

    arch = resolve_model(engine_args.model, engine_args.load_format).arch
    return sum(len(set(shard_for(arch, rank, size).kv_heads)) for rank in range(size))


def run_pd_bench(engine_args: EngineArgs, prompt_lens: list[int], reps: int, output_len: int,
                 kv_transfer_backend: str, prefill_gpus: tuple[int, ...] | None = None,
                 decode_gpus: tuple[int, ...] | None = None, gpu_memory_utilization: float | None = None,
                 seed: int = 0, *, prefill_tensor_parallel_size: int | None = None,
                 decode_tensor_parallel_size: int | None = None, decode_workers: int = 1,
                 ready_timeout_s: float = 900.0, log_dir: Path | None = None) -> list[dict[str, Any]]:
    """One record per prompt length. Tensor-parallel sizes of None are engine_args' (each role's ranks take
    consecutive GPUs from its listed one); with several decode workers each is measured in turn, `reps` times."""
    longest = max(prompt_lens)
    if engine_args.max_model_len is None or engine_args.max_model_len < longest + output_len + 1:
        engine_args = replace(engine_args, max_model_len=longest + output_len + 16)
    spec = ClusterSpec(replace(engine_args, usage_context="server"), prefill_workers=1, decode_workers=decode_workers,
                       prefill_gpus=prefill_gpus, decode_gpus=decode_gpus, kv_transfer_backend=kv_transfer_backend,
                       gpu_memory_utilization=gpu_memory_utilization, auth=ClusterAuth.from_env().with_token(),
                       prefill_tensor_parallel_size=prefill_tensor_parallel_size,
                       decode_tensor_parallel_size=decode_tensor_parallel_size, log_dir=log_dir)
    rng = random.Random(seed)
    records = []
    with pd_workers(spec, ready_timeout_s) as (_, prefill, decodes):
        stubs = [stub for _, stub in decodes]
        decode_info = stubs[0].Info(pb.InfoRequest(), timeout=30)
        layout = decode_info.kv_layout
        bytes_per_token = 2 * layout.num_layers * received_kv_heads(engine_args, decode_info) * layout.head_dim * \
            {"float32": 4, "bfloat16": 2, "float16": 2}[layout.dtype]
        parallel = {"prefill_tensor_parallel_size": spec.tensor_parallel_size("prefill"),
                    "decode_tensor_parallel_size": spec.tensor_parallel_size("decode"), "decode_workers": decode_workers}
        for length in prompt_lens:
            fresh = lambda n=length: [rng.randrange(100, decode_info.vocab_size) for _ in range(n)]  # noqa: E731
            runs = _timed_runs(stubs, fresh, prefill, reps, output_len)
            kv_bytes = -(-length // layout.block_size) * layout.block_size * bytes_per_token
            records.append({"workload": f"pd_transfer_{engine_args.model}_{length}", "device": device_name(),
                            "model": engine_args.model, "dtype": layout.dtype,
                            "kv_transfer_backend": kv_transfer_backend, "prompt_tokens": length, **parallel,
                            **_length_record(runs, kv_bytes), "reps": reps, "runs": runs, "context": host_context()})
    return records
