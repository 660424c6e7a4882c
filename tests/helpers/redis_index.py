"""A RedisIndex on the tests' Redis (127.0.0.1:6379, db 13) under its own random key prefix, deleted afterwards."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis

from cluster.routing.redis_index import RedisIndex

REDIS_URL = "redis://127.0.0.1:6379/13"


@contextmanager
def scratch_redis_index(**kwargs: Any) -> Iterator[RedisIndex]:
    prefix = f"kvflow:test:{uuid.uuid4().hex[:8]}:"
    index = RedisIndex(REDIS_URL, prefix=prefix, **kwargs)
    assert index.ping(), "these tests need redis-server on 127.0.0.1:6379"
    try:
        yield index
    finally:
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=prefix + "*"))
        if keys:
            client.delete(*keys)
        index.close()
