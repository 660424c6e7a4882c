"""`--discovery redis`: workers keep a TTL'd registration key alive; routers see them come and go."""

from __future__ import annotations

import threading
import time

import redis

from cluster.routing.registration import WorkerRegistration
from router.discovery import RedisDiscovery

URL = "redis://127.0.0.1:6379/13"


def test_registration_appears_and_leaves() -> None:
    redis.Redis.from_url(URL).flushdb()
    seen: dict[str, list[str]] = {}
    changed = threading.Event()

    def on_change(role: str, addresses: list[str]) -> None:
        seen[role] = addresses
        changed.set()

    discovery = RedisDiscovery(URL, on_change, poll_s=0.1)
    registration = WorkerRegistration(URL, "prefill", "10.0.0.7:50061", ttl_s=0.6)
    registration.start()
    discovery.start()
    try:
        deadline = time.monotonic() + 5
        while seen.get("prefill") != ["10.0.0.7:50061"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seen.get("prefill") == ["10.0.0.7:50061"]
        time.sleep(1.0)  # refreshed before the TTL runs out: still there
        assert seen.get("prefill") == ["10.0.0.7:50061"]
        registration.stop()
        deadline = time.monotonic() + 5
        while seen.get("prefill") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seen.get("prefill") == []
    finally:
        registration.stop()
        discovery.stop()
        redis.Redis.from_url(URL).flushdb()
