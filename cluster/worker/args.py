"""A worker's command-line flags (`kvflow prefill` / `kvflow decode`) and the engine arguments they give.

Light on purpose: registering the CLI's sub-parsers imports this module, so it imports no engine runner, model or
kernel code and no torch.distributed (the process that serves these flags is cluster/worker/runtime.py).
"""

from __future__ import annotations

import argparse
import dataclasses

from cluster.auth import add_cluster_auth_args
from cluster.transfer.backends import KV_TRANSFER_BACKENDS
from engine.arg_utils import EngineArgs

DRAIN_TIMEOUT_S = 30.0  # --drain-timeout default


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address the worker's gRPC server listens on")
    parser.add_argument("--port", type=int, required=True, help="the worker's gRPC port")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics on this HTTP port (default: none)")
    parser.add_argument("--index", default="memory",
                        help="prefix index the router reads ('memory' or redis://...); workers always serve "
                             "StreamKVEvents, which the router consumes")
    parser.add_argument("--worker-id", default=None,
                        help="the worker's name in KV events, metrics and the registry (default: ROLE-HOSTNAME-PORT)")
    parser.add_argument("--advertise-address", default=None,
                        help="host:port routers should dial (default --host:--port); registered in Redis when "
                             "--index is redis://; its host is also where decode workers reach this worker's KV-link "
                             "rendezvous")
    parser.add_argument("--kv-transfer-backend", choices=KV_TRANSFER_BACKENDS, default="auto",
                        help="how prompt KV moves from prefill to decode workers: 'nccl' (a torch.distributed link: "
                             "NCCL between GPUs, gloo between CPU workers), 'grpc' (bytes in the gRPC stream), or "
                             "'auto' (NCCL between GPU workers, gRPC otherwise or when no link can be opened; a "
                             "tensor-parallel decode worker always pulls over links, rank to rank)")
    parser.add_argument("--kv-transfer-fault-rate", type=float, default=0.0,
                        help="fault testing only: fail this share of KV transfers at a random point (the decode "
                             "side recomputes); 0 in production")
    parser.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S,
                        help="seconds in-flight requests may still run after SIGTERM (new ones get UNAVAILABLE); "
                             "the rest are then aborted")
    add_cluster_auth_args(parser)


def server_engine_args(args: argparse.Namespace) -> EngineArgs:
    """The engine arguments of an API server (every worker, `kvflow serve`): vLLM's server batch defaults."""
    return dataclasses.replace(EngineArgs.from_cli_args(args), usage_context="server")
