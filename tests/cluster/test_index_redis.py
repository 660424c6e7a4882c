"""The Redis prefix index against a real redis-server on 127.0.0.1:6379 (db 13, keys under a unique prefix)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from cluster.routing.events import AllBlocksCleared, BlocksRemoved, BlocksStored, EventBatch
from cluster.routing.index import IndexUnavailable
from cluster.routing.redis_index import RedisIndex, redact, redis_client
from engine.core.block_hash import BlockHasher
from tests.helpers.redis_index import REDIS_URL, scratch_redis_index

HASHER = BlockHasher.for_model("test-model", 4)
HASHES = HASHER.hash_blocks(list(range(40)))


def snapshot(worker: str, hashes: list[bytes], epoch: int = 1) -> EventBatch:
    return EventBatch(worker, epoch, 0, (AllBlocksCleared(), BlocksStored(tuple(hashes))))


@pytest.fixture()
def index() -> Iterator[RedisIndex]:
    with scratch_redis_index(liveness_ttl_s=0.5) as idx:
        yield idx


def test_longest_prefix_eviction_and_epochs(index: RedisIndex) -> None:
    assert index.apply(snapshot("a", HASHES[:6]))
    assert index.apply(snapshot("b", HASHES[:2]))
    assert index.match(HASHES, ["a", "b", "zz"]) == {"a": 6, "b": 2, "zz": 0}
    assert index.apply(EventBatch("a", 1, 1, (BlocksStored(tuple(HASHES[6:])), BlocksRemoved((HASHES[3],)))))
    assert index.match(HASHES, ["a"]) == {"a": 3}
    # a restart: the new epoch's snapshot hides every block of the old one
    assert index.apply(snapshot("a", HASHES[:1], epoch=2))
    assert index.match(HASHES, ["a", "b"]) == {"a": 1, "b": 2}


def test_dead_worker_expires_and_resync_is_required(index: RedisIndex) -> None:
    index.apply(snapshot("a", HASHES))
    index.apply(snapshot("b", HASHES))
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:  # only b keeps heartbeating
        assert index.apply(EventBatch("b", 1, 1))
        time.sleep(0.1)
    assert index.match(HASHES, ["a", "b"]) == {"a": 0, "b": 10}
    assert not index.apply(EventBatch("a", 1, 1))  # a's state expired: its subscriber must resubscribe
    index.forget_worker("b")
    assert index.match(HASHES, ["b"]) == {"b": 0}


def test_two_routers_share_the_index(index: RedisIndex) -> None:
    other = RedisIndex(REDIS_URL, prefix=index.prefix)
    index.apply(snapshot("a", HASHES[:4]))
    assert other.match(HASHES, ["a"]) == {"a": 4}
    other.close()


def test_unreachable_redis_raises_index_unavailable_fast() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    dead = RedisIndex(f"redis://127.0.0.1:{port}/0", timeout_s=0.2, retry_after_s=5.0)
    start = time.monotonic()
    with pytest.raises(IndexUnavailable):
        dead.match(HASHES, ["a"])
    with pytest.raises(IndexUnavailable):  # within retry_after_s: no new connection attempt
        dead.apply(snapshot("a", HASHES))
    assert time.monotonic() - start < 1.0


def test_password_from_env_and_redaction(monkeypatch: pytest.MonkeyPatch) -> None:
    assert redact("redis://:s3cret@host:6379/0") == "redis://host:6379/0"
    monkeypatch.setenv("KVFLOW_REDIS_PASSWORD", "p@ss/word")
    client = redis_client("redis://:p@ss/word@host:6379/0")
    kwargs = client.connection_pool.connection_kwargs
    assert kwargs["password"] == "p@ss/word" and kwargs["host"] == "host" and kwargs["db"] == 0
    with pytest.raises(ValueError, match="redis://"):
        redis_client("http://host")
