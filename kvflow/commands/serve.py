"""`kvflow serve --model smollm2`: a whole cluster on one machine (workers as subprocesses, the router here).

The cluster token is `--cluster-token` / KVFLOW_CLUSTER_TOKEN, else a fresh random one: workers get it in their
environment, the router here in its config, so no worker RPC is served to anyone else.

A worker that dies is restarted (`WorkerCluster.supervise`; counted in kvflow:worker_restarts_total{role}).
SIGTERM or Ctrl-C stops the cluster in order: the router drains first (new requests get 503, in-flight ones run
for up to --drain-timeout through the still-running workers, the rest end with finish_reason "abort"), then the
workers are stopped (each drains what it may still have), then killed if they outlive the drain.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.auth import ClusterAuth, add_cluster_auth_args
from cluster.routing.planner import PlannerConfig
from cluster.transfer.backends import KV_TRANSFER_BACKENDS
from engine.arg_utils import EngineArgs
from kvflow.commands.router import (
    add_disagg_args,
    add_front_args,
    add_lifecycle_args,
    add_request_limit_args,
    disagg_kwargs,
    lifecycle_kwargs,
    request_limit_kwargs,
)

if TYPE_CHECKING:
    from kvflow.launcher import WorkerCluster
    from router.config import RouterConfig

logger = logging.getLogger(__name__)
WORKER_STOP_MARGIN_S = 15.0  # beyond --drain-timeout before a worker that does not stop is killed


def register(subparsers: argparse._SubParsersAction) -> None:

    parser = subparsers.add_parser("serve", help="run router + prefill/decode workers on this machine")
    g = parser.add_argument_group("cluster")
    g.add_argument("--prefill-workers", type=int, default=None,
                   help="workers that start in the prefill pool (default 1; 0 with --data-parallel-size, and under "
                        "--disagg-policy adaptive where two workers get GPUs of their own: they start as replicas); "
                        "with --disagg-policy adaptive the router moves them between pools")
    g.add_argument("--decode-workers", type=int, default=None,
                   help="workers that start in the decode pool (default 1, or 2 where adaptive's two workers start "
                        "as replicas; --data-parallel-size sets it)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=None,
                   help="N unified replicas (decode workers that prefill locally, no prefill workers), each on "
                        "its own GPU(s), behind the router")
    g.add_argument("--index", default="memory", help="'memory' or redis://host:port/db")
    g.add_argument("--host", default="127.0.0.1", help="address the router's HTTP and gRPC fronts listen on "
                                                       "(workers always listen on 127.0.0.1)")
    add_front_args(g)
    g.add_argument("--disagg-min-prompt-tokens", type=int, default=None,
                   help="decode workers prefill locally below this many uncached prompt tokens")
    g.add_argument("--prefill-gpus", type=int, nargs="+", default=None,
                   help="GPU index (among the visible ones) of each prefill worker; default: all workers spread "
                        "over the visible GPUs, prefill workers first")
    g.add_argument("--decode-gpus", type=int, nargs="+", default=None, help="likewise for decode workers")
    g.add_argument("--prefill-tensor-parallel-size", type=int, default=None,
                   help="each prefill worker's tensor-parallel size (default --tensor-parallel-size); KV moves rank "
                        "to rank, re-sharded when it differs from the decode workers'")
    g.add_argument("--decode-tensor-parallel-size", type=int, default=None,
                   help="each decode worker's tensor-parallel size (default --tensor-parallel-size)")
    g.add_argument("--kv-transfer-backend", choices=KV_TRANSFER_BACKENDS, default="auto",
                   help="prefill -> decode KV: 'nccl' (torch.distributed link; gloo on CPU workers), 'grpc', or "
                        "'auto' (NCCL between GPU workers, gRPC otherwise; the link whenever a role is "
                        "tensor-parallel)")
    g.add_argument("--kv-transfer-fault-rate", type=float, default=0.0,
                   help="fault testing only: the workers fail this share of KV transfers at a random point")
    g.add_argument("--disable-log-requests", action="store_true", help="no router log line per request")
    g.add_argument("--log-dir", type=Path, default=None,
                   help="where the workers' logs go (default: a temporary directory, removed at a clean exit "
                        "unless a worker died)")
    g.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for the workers' models")
    add_request_limit_args(parser)
    add_cluster_auth_args(parser)
    add_lifecycle_args(parser)
    add_disagg_args(parser)
    EngineArgs.add_cli_args(parser, default_log_stats=True)  # a server logs vLLM's stats line by default
    # Unset: workers sharing a GPU split vLLM's 0.9 between them; set: every worker's own share (vLLM's rule).
    parser.set_defaults(handler=run, gpu_memory_utilization=None)


def run(args: argparse.Namespace) -> int:
    from cluster.worker.args import server_engine_args
    from kvflow.launcher import (
        DEFAULT_GPU_MEMORY_UTILIZATION,
        ClusterSpec,
        WorkerCluster,
        WorkerExited,
        preflight,
    )
    from router.config import RouterConfig

    share = args.gpu_memory_utilization
    args.gpu_memory_utilization = DEFAULT_GPU_MEMORY_UTILIZATION if share is None else share
    engine_args = server_engine_args(args)
    engine_args.validate_parallel()  # refused here, before any worker starts
    engine_args.validate_cpu_offload()
    engine_args.validate_itl_target()
    engine_args.validate_kv_offloading()
    PlannerConfig(slo_ttft_s=args.slo_ttft_ms / 1000, slo_itl_s=args.slo_itl_ms / 1000).validate()  # before workers
    engine_args.validate_ttft_target()
    engine_args.structured_outputs()
    args.prefill_workers = pipeline_prefill_workers(engine_args.pipeline_parallel_size, args.prefill_workers)
    prefill_tp, decode_tp = role_tensor_parallel(engine_args.tensor_parallel_size, args.prefill_tensor_parallel_size,
                                                 args.decode_tensor_parallel_size)
    if adaptive_starts_as_replicas(args, engine_args, prefill_tp, decode_tp):
        args.prefill_workers, args.decode_workers = 0, 2
        logger.info("adaptive: the two workers start as replicas (both in the decode pool); the planner gives one "
                    "to prefill when the requests' pace breaks beside local prefill (--prefill-workers 1 "
                    "--decode-workers 1 starts as P/D)")
    args.prefill_workers, args.decode_workers = worker_counts(args.prefill_workers, args.decode_workers,
                                                              args.data_parallel_size)
    if args.metrics_require_api_key and not args.api_key:
        raise ValueError("--metrics-require-api-key needs --api-key (or KVFLOW_API_KEY)")
    if args.enable_auto_tool_choice and not args.tool_call_parser:  # before any worker starts
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    auth = ClusterAuth.from_args(args).with_token()
    # The router's flags are checked before any worker starts; the addresses are known once the workers are up.
    config = RouterConfig(prefill=(), decode=(), index=args.index, host=args.host, port=args.port,
                          grpc_port=args.grpc_port, api_key=args.api_key or None, routing=args.routing, cluster=auth,
                          metrics_require_api_key=args.metrics_require_api_key,
                          served_model_name=tuple(args.served_model_name),
                          tokenizer_pool_size=args.tokenizer_pool_size,
                          disable_log_requests=args.disable_log_requests, disable_log_stats=args.disable_log_stats,
                          **request_limit_kwargs(args), **lifecycle_kwargs(args), **disagg_kwargs(args))
    dataclasses.replace(config, decode=("127.0.0.1:1",)).validate()
    if args.disagg_policy == "adaptive" and prefill_tp != decode_tp:
        logger.info("prefill TP %d != decode TP %d: workers are pinned to their pools (role-free workers move "
                    "between them); the router still picks remote or local prefill per request", prefill_tp,
                    decode_tp)
    spec = ClusterSpec(engine_args, args.prefill_workers, args.decode_workers, args.index,
                       "127.0.0.1", args.disagg_min_prompt_tokens, args.log_dir,
                       prefill_gpus=tuple(args.prefill_gpus) if args.prefill_gpus else None,
                       decode_gpus=tuple(args.decode_gpus) if args.decode_gpus else None,
                       kv_transfer_backend=cluster_kv_backend(args.kv_transfer_backend, prefill_tp, decode_tp),
                       gpu_memory_utilization=share, auth=auth,
                       drain_timeout_s=args.drain_timeout,
                       # adaptive: role-free workers, which change pools: pinned when the roles' TP sizes differ
                       # (pipeline-parallel workers are decode workers only: P/D with them is refused)
                       role_free=args.disagg_policy == "adaptive" and prefill_tp == decode_tp
                       and engine_args.pipeline_parallel_size == 1,
                       prefill_tensor_parallel_size=prefill_tp, decode_tensor_parallel_size=decode_tp,
                       worker_extra_args=("--kv-transfer-fault-rate", str(args.kv_transfer_fault_rate))
                       if args.kv_transfer_fault_rate else ())
    spec = preflight(spec)  # the engine config, and CPU workers' memory: refused here, in one line
    cluster = WorkerCluster(spec)
    # Before the router runs (and after it stopped), SIGTERM acts like Ctrl-C; while it runs, it starts its drain.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    clean = False
    try:
        cluster.start()
        logger.info("worker logs in %s", cluster.log_dir)
        cluster.wait_ready(args.ready_timeout)
        config = dataclasses.replace(config, prefill=tuple(cluster.addresses("prefill")),
                                     decode=tuple(cluster.addresses("decode")))
        asyncio.run(_serve(config, cluster))
        clean = True
    except KeyboardInterrupt:
        clean = True
    except (WorkerExited, TimeoutError) as exc:  # the message names the worker's log (kept): no traceback
        print(f"kvflow: error: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        cluster.stop(args.drain_timeout + WORKER_STOP_MARGIN_S)
        if clean:
            cluster.remove_logs()
    return 0


def adaptive_starts_as_replicas(args: argparse.Namespace, engine_args: EngineArgs, prefill_tp: int,
                                decode_tp: int) -> bool:
    """The default pools under adaptive on GPUs: the two workers start as replicas, not as 1P1D, where each gets
    GPUs of its own and no pool, GPU or data-parallel flag is given. Measured on 2 x H200 (Llama-8B shapes, SLO
    TTFT 1 s / TPOT 40 ms): from replicas, mixed chat + documents 1.000 and prefill-heavy 1.000; from 1P1D, 1.000
    and 0.678 (the planner moved the busy prefill worker late); 4 x H200 at twice the rates: 0.997 / 1.000 from
    replicas, 0.995 / 0.990 from 1P3D."""
    if args.disagg_policy != "adaptive" or prefill_tp != decode_tp or engine_args.pipeline_parallel_size != 1:
        return False
    given = (args.prefill_workers, args.decode_workers, args.data_parallel_size, args.prefill_gpus,
             args.decode_gpus)
    if any(flag is not None for flag in given) or engine_args.device not in ("auto", "cuda"):
        return False
    from kvflow.launcher import visible_gpus

    return len(visible_gpus()) >= 2 * decode_tp


def pipeline_prefill_workers(pipeline_parallel: int, prefill: int | None) -> int | None:
    """--prefill-workers under pipeline parallelism: none. P/D with pipeline-parallel workers is refused for now
    (each stage holds only its layers' KV, and KV transfer moves one rank's cache): its workers prefill locally."""
    if pipeline_parallel == 1:
        return prefill
    if prefill:
        raise ValueError(f"--pipeline-parallel-size {pipeline_parallel} with --prefill-workers {prefill}: P/D with "
                         "pipeline-parallel workers is not supported yet (each stage holds only its layers' KV); "
                         "use --prefill-workers 0 (the default with pipeline parallelism)")
    return 0


def worker_counts(prefill: int | None, decode: int | None, data_parallel: int | None) -> tuple[int, int]:
    """(prefill workers, decode workers) from the flags. Data parallelism is N decode workers with local prefill."""
    if data_parallel is not None:
        if data_parallel < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {data_parallel}")
        if decode is not None and decode != data_parallel:
            raise ValueError(f"--data-parallel-size {data_parallel} runs {data_parallel} decode workers; drop "
                             f"--decode-workers {decode}")
        if prefill:
            raise ValueError("--data-parallel-size runs replicas that prefill locally; drop --prefill-workers")
        return 0, data_parallel
    return (1 if prefill is None else prefill), (1 if decode is None else decode)


def role_tensor_parallel(size: int, prefill: int | None, decode: int | None) -> tuple[int, int]:
    """(prefill, decode) tensor-parallel sizes: --tensor-parallel-size for both roles unless a role's own flag
    overrides it."""
    sizes = (size if prefill is None else prefill, size if decode is None else decode)
    for flag, value in zip(("--prefill-tensor-parallel-size", "--decode-tensor-parallel-size"), sizes, strict=True):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    return sizes


def cluster_kv_backend(choice: str, prefill_tp: int, decode_tp: int) -> str:
    """`auto` between tensor-parallel workers is the link (gloo on CPUs): the Prefill stream would carry rank 0's
    heads only, so a TP1 decode worker on CPU (auto: gRPC bytes) would recompute every prompt of a TP prefill
    worker."""
    return "nccl" if choice == "auto" and max(prefill_tp, decode_tp) > 1 else choice


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


async def _serve(config: RouterConfig, cluster: WorkerCluster) -> None:
    from router.core import Router
    from router.server import serve_router

    router = Router(config)
    ready = asyncio.Event()
    task = asyncio.create_task(serve_router(config, ready, router, freeze_heap=True))  # serve's own process
    announce = asyncio.create_task(_announce(config, ready))
    supervisor = asyncio.create_task(cluster.supervise(
        on_restart=lambda worker: router.metrics.worker_restarts.labels(worker.role).inc(),
        active=lambda: not router.lifecycle.draining))
    try:
        await task
    finally:
        announce.cancel()
        supervisor.cancel()


async def _announce(config: RouterConfig, ready: asyncio.Event) -> None:
    import httpx

    await ready.wait()
    url = f"http://{config.host}:{config.port}"
    start = time.monotonic()
    async with httpx.AsyncClient() as client:
        while time.monotonic() - start < 60:
            try:
                if (await client.get(f"{url}/health", timeout=2.0)).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    print(f"kvflow is serving the OpenAI API at {url}/v1 (gRPC on port {config.grpc_port}); Ctrl-C to stop",
          file=sys.stderr, flush=True)
