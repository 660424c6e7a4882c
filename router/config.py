"""Frozen router configuration, built from the `kvflow router` command line."""

from __future__ import annotations

from dataclasses import dataclass

from engine.routing.policy import POLICY_NAMES

DISCOVERY_KINDS = ("static", "redis", "kubernetes")


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    index: str = "memory"  # "memory" or a redis:// URL
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50051  # 0: no gRPC front
    api_key: str | None = None
    routing: str = "prefix"
    discovery: str = "static"
    discovery_redis: str | None = None  # registration registry for --discovery redis (defaults to --index)
    k8s_namespace: str = "default"
    prefill_selector: str = ""
    decode_selector: str = ""
    worker_grpc_port_name: str = "grpc"
    tokenizer: str | None = None
    tokenizer_pool_size: int = 2
    served_model_name: tuple[str, ...] = ()
    disable_log_requests: bool = False
    disable_log_stats: bool = False
    max_attempts: int = 3  # decode attempts per request (a failure before the first token moves on)
    request_timeout_s: float = 600.0

    def validate(self) -> None:
        if self.routing not in POLICY_NAMES:
            raise ValueError(f"--routing must be one of {', '.join(POLICY_NAMES)}, got {self.routing!r}")
        if self.discovery not in DISCOVERY_KINDS:
            raise ValueError(f"--discovery must be one of {', '.join(DISCOVERY_KINDS)}, got {self.discovery!r}")
        if self.discovery == "static" and not self.decode:
            raise ValueError("--discovery static needs at least one --decode address")
        if self.discovery == "kubernetes" and not self.decode_selector:
            raise ValueError("--discovery kubernetes needs --decode-selector (and usually --prefill-selector)")
        if self.discovery == "redis" and not (self.discovery_redis or self.index).startswith(("redis://",
                                                                                              "rediss://")):
            raise ValueError("--discovery redis needs --index redis://... (the registry lives there)")
        if self.index != "memory" and not self.index.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--index must be 'memory' or a redis:// URL, got {self.index!r}")
        if self.tokenizer_pool_size < 1:
            raise ValueError("--tokenizer-pool-size must be >= 1")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        for port in (self.port, self.grpc_port):
            if not 0 <= port < 65536:
                raise ValueError(f"port {port} is out of range")
