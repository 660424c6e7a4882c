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
from typing import Protocol

import redis

from cluster.routing.redis_index import redact, redis_client
from cluster.routing.registration import REGISTRATION_PREFIX, REGISTRATION_TTL_S, ROLES, WorkerRegistration
from router.config import RouterConfig

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


def make_discovery(config: RouterConfig, on_change: OnChange) -> Discovery:
    if config.discovery == "static":
        return StaticDiscovery({"prefill": list(config.prefill), "decode": list(config.decode)}, on_change)
    if config.discovery == "redis":
        return RedisDiscovery(config.discovery_redis or config.index, on_change)
    from router.discovery_k8s import KubernetesDiscovery

    selectors = {"decode": config.decode_selector}
    if config.prefill_selector:
        selectors["prefill"] = config.prefill_selector
    k8s = KubernetesDiscovery(config.k8s_namespace, selectors=selectors, port_name=config.worker_grpc_port_name,
                              on_change=on_change)
    return k8s
