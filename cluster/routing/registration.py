"""Redis worker registration, the worker side of `--discovery redis`.

Contract (workers write, routers read): `kvflow:workers:<role>:<host:port>` = the worker's address, SET with a TTL
of `REGISTRATION_TTL_S` and refreshed every third of it, so a dead worker leaves within the TTL.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import redis

from cluster.routing.redis_index import redis_client

logger = logging.getLogger(__name__)

REGISTRATION_PREFIX = "kvflow:workers:"
REGISTRATION_TTL_S = 3.0
ROLES = ("prefill", "decode")


class WorkerRegistration:
    """Keeps the worker's registration key alive in Redis while the worker runs."""

    def __init__(self, url: str, role: str, address: str, ttl_s: float = REGISTRATION_TTL_S) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.key = f"{REGISTRATION_PREFIX}{role}:{address}"
        self.address = address
        self.ttl_ms = int(ttl_s * 1000)
        self._client = redis_client(url)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="redis-registration", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(redis.RedisError):  # the TTL removes it anyway
            self._client.delete(self.key)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._client.set(self.key, self.address, px=self.ttl_ms)
            except redis.RedisError as exc:
                logger.warning("cannot refresh worker registration %s: %s", self.key, exc)
            self._stop.wait(self.ttl_ms / 3000)
