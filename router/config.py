"""Frozen router configuration, built from the `kvflow router` command line."""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.auth import ClusterAuth
from cluster.routing.disagg import DISAGG_POLICIES
from cluster.routing.index import validate_index_url
from cluster.routing.planner import PlannerConfig
from cluster.routing.policy import POLICY_NAMES
from engine.sampling_params import MAX_LOGPROBS
from router.ownership import api_keys
from router.tool_calls import TOOL_CALL_PARSERS

DISCOVERY_KINDS = ("static", "redis", "kubernetes")


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    index: str = "memory"  # "memory" or a redis:// URL
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50051  # 0: no gRPC front
    api_key: str | None = field(default=None, repr=False)  # one key, or several separated by commas
    metrics_require_api_key: bool = False  # /metrics needs the API key too (else it is open, like /health)
    expose_worker_addresses: bool = False  # worker addresses and ids in /v1/models and /metrics labels (else opaque)
    cluster: ClusterAuth = ClusterAuth()  # the credential the router presents to workers
    routing: str = "prefix"
    disagg_policy: str = "adaptive"  # cluster/routing/disagg.py; "static": the pools and the split stay fixed
    prefix_fetch: bool = True  # pull a cached prefix from the worker holding it when cheaper (cluster/routing/disagg.py)
    slo_ttft_ms: float = 1000.0  # the pool planner's targets (cluster/routing/planner.py)
    slo_itl_ms: float = 40.0
    discovery: str = "static"
    discovery_redis: str | None = None  # registration registry for --discovery redis (defaults to --index)
    k8s_namespace: str = "default"
    prefill_selector: str = ""
    decode_selector: str = ""
    worker_selector: str = ""  # role-free workers (`kvflow worker`): they join the decode pool, as Redis registers them
    worker_grpc_port_name: str = "grpc"
    tokenizer: str | None = None
    tokenizer_pool_size: int = 2
    served_model_name: tuple[str, ...] = ()
    disable_log_requests: bool = False
    disable_log_stats: bool = False
    max_attempts: int = 3  # decode attempts per request (a failure before the first token moves on)
    max_migrations: int = 3  # mid-stream moves of one request to another decode worker (0: fail the request)
    request_timeout_s: float = 600.0
    drain_timeout_s: float = 30.0  # after SIGTERM: how long in-flight requests may still run
    sse_keepalive_s: float = 5.0  # an SSE stream silent this long gets a ": keep-alive" comment (0: never)
    # Request bounds (vLLM names where vLLM has the knob): what one request may ask of the cluster.
    max_n: int = 128  # n and best_of
    max_logprobs: int = 20  # logprobs / top_logprobs (at most the engine's MAX_LOGPROBS)
    max_prompts_per_request: int = 1024  # /v1/completions with a list of prompts
    max_request_body_bytes: int = 32 << 20  # larger bodies: 413
    request_body_timeout_s: float = 30.0  # a body still arriving after this: 408
    request_header_timeout_s: float = 10.0  # a request head still arriving after this: 408 and the connection closed
    trust_request_chat_template: bool = False  # accept a request's own `chat_template` (it runs on the router)
    chat_template_timeout_s: float = 5.0  # a chat template render running longer fails the request (400)
    chat_template_workers: int = 1  # child processes rendering requests' own templates (router/template_sandbox.py)
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (vLLM's flag); needs tool_call_parser
    tool_call_parser: str | None = None  # router.tool_calls.TOOL_CALL_PARSERS

    @property
    def accepted_keys(self) -> tuple[str, ...]:
        """The API keys a caller may present (none: no key needed)."""
        return api_keys(self.api_key)

    def planner_config(self) -> PlannerConfig:
        return PlannerConfig(slo_ttft_s=self.slo_ttft_ms / 1000, slo_itl_s=self.slo_itl_ms / 1000)

    def validate(self) -> None:
        if self.routing not in POLICY_NAMES:
            raise ValueError(f"--routing must be one of {', '.join(POLICY_NAMES)}, got {self.routing!r}")
        if self.disagg_policy not in DISAGG_POLICIES:
            raise ValueError(f"--disagg-policy must be one of {', '.join(DISAGG_POLICIES)}, got "
                             f"{self.disagg_policy!r}")
        self.planner_config().validate()
        if self.discovery not in DISCOVERY_KINDS:
            raise ValueError(f"--discovery must be one of {', '.join(DISCOVERY_KINDS)}, got {self.discovery!r}")
        if self.discovery == "static" and not self.decode:
            raise ValueError("--discovery static needs at least one --decode address")
        if self.discovery == "kubernetes" and not (self.decode_selector or self.worker_selector):
            raise ValueError("--discovery kubernetes needs --decode-selector (and usually --prefill-selector) or "
                             "--worker-selector")
        if self.discovery == "redis" and not (self.discovery_redis or self.index).startswith(("redis://",
                                                                                              "rediss://")):
            raise ValueError("--discovery redis needs --index redis://... (the registry lives there)")
        validate_index_url(self.index)
        if self.api_key is not None and not api_keys(self.api_key):
            raise ValueError("--api-key must name at least one non-empty key (several: KEY1,KEY2)")
        if self.metrics_require_api_key and not self.api_key:
            raise ValueError("--metrics-require-api-key needs --api-key (or KVFLOW_API_KEY)")
        if self.tokenizer_pool_size < 1:
            raise ValueError("--tokenizer-pool-size must be >= 1")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if self.max_migrations < 0:
            raise ValueError("--max-migrations must be >= 0")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                             f"{', '.join(TOOL_CALL_PARSERS)})")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got "
                             f"{self.tool_call_parser!r}")
        if self.max_n < 1:
            raise ValueError(f"--max-n must be >= 1, got {self.max_n}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"--max-logprobs must be in [0, {MAX_LOGPROBS}], got {self.max_logprobs}")
        if self.max_prompts_per_request < 1:
            raise ValueError(f"--max-prompts-per-request must be >= 1, got {self.max_prompts_per_request}")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"--max-request-body-bytes must be >= 1, got {self.max_request_body_bytes}")
        if not self.request_body_timeout_s > 0:
            raise ValueError(f"--request-body-timeout must be > 0, got {self.request_body_timeout_s}")
        if not self.request_header_timeout_s > 0:
            raise ValueError(f"--request-header-timeout must be > 0, got {self.request_header_timeout_s}")
        if not self.chat_template_timeout_s > 0:
            raise ValueError(f"--chat-template-timeout must be > 0, got {self.chat_template_timeout_s}")
        if self.chat_template_workers < 1:
            raise ValueError(f"--chat-template-workers must be >= 1, got {self.chat_template_workers}")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"--drain-timeout must be >= 0, got {self.drain_timeout_s}")
        if not self.sse_keepalive_s >= 0:
            raise ValueError(f"--sse-keepalive-s must be >= 0 (0: off), got {self.sse_keepalive_s}")
        for port in (self.port, self.grpc_port):
            if not 0 <= port < 65536:
                raise ValueError(f"port {port} is out of range")
