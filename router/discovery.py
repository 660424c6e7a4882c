"""Worker discovery: static lists, Redis registration with heartbeats, or Kubernetes EndpointSlices.

Each source calls `on_change(role, addresses)` with the full current list of a role.
Redis registration contract (workers write, routers read):
  kvflow:workers:<role>:<host:port>  = the worker's address, SET with a TTL (`REGISTRATION_TTL_S`), refreshed
                                       every `REGISTRATION_TTL_S / 3` by the worker; `WorkerRegistration` does it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import redis

from cluster.routing.redis_index import redact, redis_client
from cluster.routing.registration import REGISTRATION_PREFIX, REGISTRATION_TTL_S, ROLES, WorkerRegistration
from router.config import RouterConfig

if TYPE_CHECKING:
    import kubernetes

logger = logging.getLogger(__name__)

OnChange = Callable[[str, list[str]], None]
__all__ = ["REGISTRATION_TTL_S", "WorkerRegistration", "make_discovery"]


class Discovery(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...


class StaticDiscovery:
    def __init__(self, addresses: dict[str, list[str]], on_change: OnChange) -> None:
        self.addresses = addresses
        self.on_change = on_change

    def start(self) -> None:
        for role, addresses in self.addresses.items():
            self.on_change(role, list(addresses))

    def stop(self) -> None:
        pass


class RedisDiscovery:
    """Polls the registration keys every `poll_s`; a worker whose key expired leaves the set."""

    def __init__(self, url: str, on_change: OnChange, poll_s: float = 1.0) -> None:
        self.url = url
        self.on_change = on_change
        self.poll_s = poll_s
        self._client = redis_client(url)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="redis-discovery", daemon=True)
        self._last: dict[str, list[str]] = {}
        self._failing = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for role in ROLES:
                    keys = self._client.scan_iter(match=f"{REGISTRATION_PREFIX}{role}:*", count=500)
                    found = sorted(k.decode().split(":", 3)[3] for k in keys)
                    if found != self._last.get(role):
                        self._last[role] = found
                        self.on_change(role, found)
                self._failing = False
            except redis.RedisError as exc:
                if not self._failing:  # keep the last known workers while the registry is down
                    logger.error("worker registry %s unreachable: %s", redact(self.url), exc)
                self._failing = True
            self._stop.wait(self.poll_s)


class MergedSources:
    """Feeds several discovery sources into one role each: `on_change(role, addresses)` gets the union of the role's
    sources. Role-free workers (the "worker" source) join the decode pool beside pinned decode workers, as Redis
    registration lists them ("decode"); their `Info` (WORKER_ROLE_UNIFIED) then lets the planner move them."""

    def __init__(self, on_change: OnChange, roles: dict[str, str]) -> None:
        self.on_change = on_change
        self.roles = dict(roles)  # source -> role
        self._found: dict[str, list[str]] = {}
        self._lock = threading.Lock()

    def __call__(self, source: str, addresses: list[str]) -> None:
        role = self.roles.get(source, source)
        # Under the lock: two sources of one role must not publish their unions out of order.
        with self._lock:
            self._found[source] = list(addresses)
            merged = sorted({a for s, found in self._found.items() if self.roles.get(s, s) == role for a in found})
            self.on_change(role, merged)


def kubernetes_selectors(config: RouterConfig) -> dict[str, str]:
    """EndpointSlice selector per discovery source (a role, or "worker" for role-free workers)."""
    named = {"prefill": config.prefill_selector, "decode": config.decode_selector, "worker": config.worker_selector}
    return {source: selector for source, selector in named.items() if selector}


def make_discovery(config: RouterConfig, on_change: OnChange, api_client: kubernetes.client.ApiClient | None = None) -> Discovery:
    """The discovery source of `config`; `api_client` (a kubernetes ApiClient) replaces the in-cluster one."""
    if config.discovery == "static":
        return StaticDiscovery({"prefill": list(config.prefill), "decode": list(config.decode)}, on_change)
    if config.discovery == "redis":
        return RedisDiscovery(config.discovery_redis or config.index, on_change)
    from router.discovery_k8s import KubernetesDiscovery

    merged = MergedSources(on_change, {"worker": "decode"})
    return KubernetesDiscovery(config.k8s_namespace, selectors=kubernetes_selectors(config),
                               port_name=config.worker_grpc_port_name, on_change=merged,
                               api_client=api_client)
