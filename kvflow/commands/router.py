"""`kvflow router --prefill ADDR,... --decode ADDR,... [--index memory|redis://...]`: the prefix-aware router."""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

from cluster.auth import ClusterAuth, add_cluster_auth_args
from cluster.routing.disagg import DISAGG_POLICIES
from cluster.routing.policy import POLICY_NAMES
from router.config import DISCOVERY_KINDS, RouterConfig
from router.tool_calls import TOOL_CALL_PARSERS


def _addresses(value: str) -> list[str]:
    return [a.strip() for a in value.split(",") if a.strip()]


def add_router_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("router")
    g.add_argument("--prefill", type=_addresses, action="extend", default=[], help="prefill workers host:port,...")
    g.add_argument("--decode", type=_addresses, action="extend", default=[], help="decode workers host:port,...")
    g.add_argument("--index", default=os.environ.get("KVFLOW_INDEX_URL") or "memory",
                   help="prefix index: 'memory' (one router) or redis://[:password@]host:port/db (shared); default: "
                        "$KVFLOW_INDEX_URL, else memory")
    g.add_argument("--host", default="127.0.0.1", help="address the HTTP and gRPC fronts listen on")
    add_front_args(g)
    g.add_argument("--discovery", choices=DISCOVERY_KINDS, default="static",
                   help="where the workers come from: static (--prefill/--decode), redis (the registry in --index) "
                        "or kubernetes (EndpointSlices of --prefill-selector / --decode-selector / "
                        "--worker-selector)")
    g.add_argument("--k8s-namespace", default="default", help="namespace of the EndpointSlices (--discovery "
                                                              "kubernetes)")
    g.add_argument("--prefill-selector", default="", help="EndpointSlice label selector of prefill workers")
    g.add_argument("--decode-selector", default="", help="EndpointSlice label selector of decode workers")
    g.add_argument("--worker-selector", default="",
                   help="EndpointSlice label selector of role-free workers (`kvflow worker`): they join the decode "
                        "pool, as Redis discovery registers them, and the planner moves them between the pools "
                        "(--disagg-policy adaptive)")
    g.add_argument("--worker-grpc-port-name", default="grpc",
                   help="name of the workers' gRPC port in their EndpointSlices (--discovery kubernetes)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the workers' model's)")
    g.add_argument("--disable-log-requests", action="store_true", help="no log line per request")
    g.add_argument("--disable-log-stats", action="store_true", help="no periodic stats line")
    add_request_limit_args(parser)
    add_cluster_auth_args(parser)
    add_lifecycle_args(parser)


def add_front_args(g: argparse._ArgumentGroup) -> None:
    """The router's public fronts, shared by `kvflow router` and `kvflow serve`: ports, API keys, routing policy,
    tokenizer pool and served names."""
    g.add_argument("--port", type=int, default=8000, help="OpenAI-compatible HTTP port")
    g.add_argument("--grpc-port", type=int, default=50051, help="gRPC Generation port (0: off)")
    g.add_argument("--api-key", default=os.environ.get("KVFLOW_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every path but /health, /version (and /metrics, unless "
                        "--metrics-require-api-key); several keys KEY1,KEY2: one per client or tenant, each the "
                        "owner of its requests (default: $KVFLOW_API_KEY, else no key)")
    add_metrics_key_arg(g)
    g.add_argument("--routing", choices=POLICY_NAMES, default="prefix",
                   help="how the router picks a worker: prefix (the one holding the longest cached prefix of the "
                        "prompt, load-aware), round-robin, least-load or random")
    g.add_argument("--tokenizer-pool-size", type=int, default=2,
                   help="router threads that tokenize prompts and render chat templates")
    g.add_argument("--served-model-name", nargs="+", default=[],
                   help="model name(s) the API answers to (default: the workers' --model)")


def add_metrics_key_arg(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--metrics-require-api-key", action="store_true",
                       help="/metrics needs the API key too (Prometheus then scrapes with a bearer token)")


def add_lifecycle_args(parser: argparse.ArgumentParser) -> None:
    """Shutdown and idle-stream behaviour (shared by `kvflow router` and `kvflow serve`)."""
    d = RouterConfig()
    g = parser.add_argument_group("shutdown and streaming")
    g.add_argument("--drain-timeout", type=float, default=d.drain_timeout_s,
                   help="seconds in-flight requests may still run after SIGTERM (new ones get 503); the rest are "
                        "then ended with finish_reason 'abort'. A drain that lets every request finish needs about "
                        "the longest remaining max_tokens times the inter-token latency: 400 tokens at 75 ms (a busy "
                        "2-core CPU host) is 30 s, at 20 ms (a GPU) 8 s. The drain's first log line says how many "
                        "generations it expects to cut and what timeout would fit. Keep it within the orchestrator's "
                        "grace period (Kubernetes: terminationGracePeriodSeconds, default 30)")
    g.add_argument("--sse-keepalive-s", type=float, default=d.sse_keepalive_s,
                   help="send an SSE comment on a stream silent for this many seconds (0: never)")


def add_disagg_args(parser: argparse.ArgumentParser) -> None:
    """Where prompts are prefilled and the pools (shared by `kvflow router` and `kvflow serve`)."""
    d = RouterConfig()
    g = parser.add_argument_group("disaggregation")
    g.add_argument("--disagg-policy", choices=DISAGG_POLICIES, default=d.disagg_policy,
                   help="adaptive: per request, prefill on a prefill-pool worker or locally on the decode worker, "
                        "whichever is cheaper now, and move role-free workers between the pools to meet the SLOs; "
                        "static: every request uses the prefill worker (the decode worker's "
                        "--disagg-min-prompt-tokens aside) and the pools never change")
    g.add_argument("--prefix-fetch", action=argparse.BooleanOptionalAction, default=d.prefix_fetch,
                   help="when another worker that serves Prefill caches more of a prompt than the planned prefiller "
                        "(device or host tier), prefill on it and pull its cached blocks to the decode worker "
                        "instead of recomputing them, when the cost model says that is faster")
    g.add_argument("--slo-ttft-ms", type=float, default=d.slo_ttft_ms,
                   help="time-to-first-token target the pool planner keeps the p90 under (adaptive)")
    g.add_argument("--slo-itl-ms", type=float, default=d.slo_itl_ms,
                   help="inter-token-gap target the pool planner keeps the p90 under (adaptive)")


def disagg_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """RouterConfig fields from the flags of `add_disagg_args`."""
    return {"disagg_policy": args.disagg_policy, "prefix_fetch": args.prefix_fetch, "slo_ttft_ms": args.slo_ttft_ms, "slo_itl_ms": args.slo_itl_ms}


def lifecycle_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """RouterConfig fields from the flags of `add_lifecycle_args`."""
    return {"drain_timeout_s": args.drain_timeout, "sse_keepalive_s": args.sse_keepalive_s}


def add_request_limit_args(parser: argparse.ArgumentParser) -> None:
    """Bounds on what one request may ask (shared by `kvflow router` and `kvflow serve`; vLLM names where vLLM has
    the flag)."""
    d = RouterConfig()
    g = parser.add_argument_group("request limits")
    g.add_argument("--max-n", type=int, default=d.max_n, help="largest n (and best_of) of one request")
    g.add_argument("--max-logprobs", type=int, default=d.max_logprobs, help="largest logprobs / top_logprobs")
    g.add_argument("--max-prompts-per-request", type=int, default=d.max_prompts_per_request,
                   help="largest list of prompts in one /v1/completions request")
    g.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes,
                   help="larger request bodies are refused with 413")
    g.add_argument("--request-body-timeout", type=float, default=d.request_body_timeout_s,
                   help="seconds to receive a request body (then 408)")
    g.add_argument("--request-header-timeout", type=float, default=d.request_header_timeout_s,
                   help="seconds to receive a request's headers, from its first byte (or from the connection, for "
                        "its first request); then 408 and the connection is closed (a client that trickles headers "
                        "or sends nothing cannot hold a connection)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a `chat_template` sent with a chat request (it renders in a child process of the "
                        "router, killed at --chat-template-timeout)")
    g.add_argument("--chat-template-timeout", type=float, default=d.chat_template_timeout_s,
                   help="seconds a chat template may take to render (then 400)")
    g.add_argument("--chat-template-workers", type=int, default=d.chat_template_workers,
                   help="child processes that render requests' own chat templates (with "
                        "--trust-request-chat-template; each holds a tokenizer, ~0.4 GB, and starts at the first one)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="allow tool_choice \"auto\" (needs --tool-call-parser), as in vLLM")
    g.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="how tool calls are found in a model's free text for tool_choice auto")
    g.add_argument("--expose-worker-addresses", action="store_true",
                   help="show worker addresses and ids in /v1/models and in /metrics worker labels (default: "
                        "opaque stable names; /metrics is open unless --metrics-require-api-key)")
    g.add_argument("--max-migrations", type=int, default=d.max_migrations,
                   help="times one request may move mid-stream to another decode worker when its worker fails "
                        "(0: the caller gets the error)")


def request_limit_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """RouterConfig fields from the flags of `add_request_limit_args`."""
    return {"max_n": args.max_n, "max_logprobs": args.max_logprobs,
            "max_prompts_per_request": args.max_prompts_per_request,
            "max_request_body_bytes": args.max_request_body_bytes,
            "request_body_timeout_s": args.request_body_timeout,
            "request_header_timeout_s": args.request_header_timeout,
            "trust_request_chat_template": args.trust_request_chat_template,
            "chat_template_timeout_s": args.chat_template_timeout,
            "chat_template_workers": args.chat_template_workers, "max_migrations": args.max_migrations,
            "enable_auto_tool_choice": args.enable_auto_tool_choice, "tool_call_parser": args.tool_call_parser,
            "expose_worker_addresses": args.expose_worker_addresses}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("router", help="prefix-aware router: OpenAI HTTP + gRPC in front of workers")
    add_router_args(parser)
    add_disagg_args(parser)
    parser.set_defaults(handler=run)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    config = RouterConfig(
        prefill=tuple(args.prefill), decode=tuple(args.decode), index=args.index, host=args.host, port=args.port,
        grpc_port=args.grpc_port, api_key=args.api_key or None, metrics_require_api_key=args.metrics_require_api_key,
        cluster=ClusterAuth.from_args(args), routing=args.routing, discovery=args.discovery,
        k8s_namespace=args.k8s_namespace, prefill_selector=args.prefill_selector,
        decode_selector=args.decode_selector, worker_selector=args.worker_selector,
        worker_grpc_port_name=args.worker_grpc_port_name,
        tokenizer=args.tokenizer, tokenizer_pool_size=args.tokenizer_pool_size,
        served_model_name=tuple(args.served_model_name), disable_log_requests=args.disable_log_requests,
        disable_log_stats=args.disable_log_stats, **request_limit_kwargs(args), **lifecycle_kwargs(args),
        **disagg_kwargs(args))
    config.validate()
    return config


def run(args: argparse.Namespace) -> int:
    from router.server import serve_router

    asyncio.run(serve_router(config_from_args(args), freeze_heap=True))  # this process is the router alone
    return 0
