"""Cluster-wide prefix-block index in Redis: every router reads it, lookups cost one round trip.

Layout (all keys under `prefix`):
  b:<hash hex>        SET of members "<worker_id>|<epoch>" caching that block (in any tier)
  h:<hash hex>        SET of those members holding it in their host tier only (a subset of b:)
  m:<member>          SET of the member's block hashes (to clear a worker without scanning)
  wm:<worker_id>      SET of the worker's members (old epochs are purged when a new one appears)
  hb:<worker_id>      the worker's live epoch, with a TTL refreshed by every batch (heartbeats every 500 ms)
A member only counts while `hb:<worker_id>` names its epoch, so a dead worker drops out when its TTL expires and
a restarted one the moment its first batch lands. Writes and lookups are Lua scripts: atomic, one round trip.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence

import redis

from cluster.routing.events import AllBlocksCleared, BlocksRemoved, BlocksStored, EventBatch, Tier
from cluster.routing.index import DEFAULT_LIVENESS_TTL_S, IndexUnavailable, TierMatch, validate_index_url

PASSWORD_ENV = "KVFLOW_REDIS_PASSWORD"

# A Lua function of both scripts below: drop member m from every block it lists, then its own set (`p`: the prefix).
_CLEAR_MEMBER = """
local function clear_member(m)
  local mkey = p .. 'm:' .. m
  for _, h in ipairs(redis.call('SMEMBERS', mkey)) do
    redis.call('SREM', p .. 'b:' .. h, m)
    redis.call('SREM', p .. 'h:' .. h, m)
  end
  redis.call('DEL', mkey)
end
"""

_APPLY = """
local p, wid, epoch, ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local member = wid .. '|' .. epoch
local hbkey = p .. 'hb:' .. wid
if redis.call('GET', hbkey) ~= epoch and ARGV[5] ~= 'C' then
  return 0
end
""" + _CLEAR_MEMBER + """local wmkey = p .. 'wm:' .. wid
for _, m in ipairs(redis.call('SMEMBERS', wmkey)) do
  if m ~= member then clear_member(m); redis.call('SREM', wmkey, m) end
end
redis.call('SADD', wmkey, member)
local mkey = p .. 'm:' .. member
local i = 5
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'C' then
    clear_member(member)
    i = i + 1
  else
    local n = tonumber(ARGV[i + 1])
    for j = i + 2, i + 1 + n do
      local h = ARGV[j]
      if op == 'R' then
        redis.call('SREM', p .. 'b:' .. h, member)
        redis.call('SREM', p .. 'h:' .. h, member)
        redis.call('SREM', mkey, h)
      else
        redis.call('SADD', p .. 'b:' .. h, member)
        redis.call('SADD', mkey, h)
        if op == 'H' then
          redis.call('SADD', p .. 'h:' .. h, member)
        else
          redis.call('SREM', p .. 'h:' .. h, member)
        end
      end
    end
    i = i + 2 + n
  end
end
redis.call('SET', hbkey, epoch, 'PX', ttl)
return 1
"""

# KEYS: b:<hash>, h:<hash> per block in prompt order. Returns per worker (leading blocks, of those on the host).
_MATCH = """
local p = ARGV[1]
local alive, n, result = {}, 0, {}
local w = #ARGV - 1
for i = 2, #ARGV do
  result[i - 1] = 0
  result[w + i - 1] = 0
  local epoch = redis.call('GET', p .. 'hb:' .. ARGV[i])
  if epoch then
    alive[ARGV[i] .. '|' .. epoch] = i - 1
    n = n + 1
  end
end
for k = 1, #KEYS / 2 do
  if n == 0 then break end
  local present, host = {}, {}
  for _, m in ipairs(redis.call('SMEMBERS', KEYS[2 * k - 1])) do present[m] = true end
  for _, m in ipairs(redis.call('SMEMBERS', KEYS[2 * k])) do host[m] = true end
  for m, idx in pairs(alive) do
    if present[m] then
      result[idx] = k
      if host[m] then result[w + idx] = result[w + idx] + 1 end
    else
      alive[m] = nil; n = n - 1
    end
  end
end
return result
"""

_FORGET = """
local p, wid = ARGV[1], ARGV[2]
redis.call('DEL', p .. 'hb:' .. wid)
""" + _CLEAR_MEMBER + """local wmkey = p .. 'wm:' .. wid
for _, m in ipairs(redis.call('SMEMBERS', wmkey)) do
  clear_member(m)
end
redis.call('DEL', wmkey)
return 1
"""


def _op(event: BlocksStored | BlocksRemoved) -> str:
    """The apply script's opcode: S stored on the device, H moved to the host tier, R removed."""
    if isinstance(event, BlocksRemoved):
        return "R"
    return "H" if event.tier is Tier.HOST else "S"


def redis_client(url: str, timeout_s: float = 0.5) -> redis.Redis:
    """A client for `url`; env KVFLOW_REDIS_PASSWORD, when set, replaces any password in the URL (so secrets
    with URL-special characters work)."""
    if url == "memory":
        raise ValueError("the embedded index ('memory') has no Redis client")
    validate_index_url(url)
    password = os.environ.get(PASSWORD_ENV)
    if password:
        scheme, _, rest = url.partition("://")
        url = f"{scheme}://{rest.rpartition('@')[2]}"  # the host part never holds '@'; a raw secret may
    return redis.Redis.from_url(url, password=password or None, socket_timeout=timeout_s,
                                socket_connect_timeout=timeout_s)


def redact(url: str) -> str:
    """The URL without its password, for logs and errors."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}"


class RedisIndex:
    """`PrefixIndex` in Redis. After a failure it stops trying for `retry_after_s`, so a dead Redis costs
    requests nothing but the fallback to load-only routing."""

    def __init__(self, url: str, prefix: str = "kvflow:idx:", liveness_ttl_s: float = DEFAULT_LIVENESS_TTL_S,
                 timeout_s: float = 0.5, retry_after_s: float = 1.0) -> None:
        self.url = redact(url)
        self.prefix = prefix
        self.ttl_ms = int(liveness_ttl_s * 1000)
        self.retry_after_s = retry_after_s
        self._client = redis_client(url, timeout_s)
        self._apply = self._client.register_script(_APPLY)
        self._match = self._client.register_script(_MATCH)
        self._forget = self._client.register_script(_FORGET)
        self._down_until = 0.0
        self._lock = threading.Lock()

    def apply(self, batch: EventBatch) -> bool:
        args: list[str | int] = [self.prefix, batch.worker_id, str(batch.epoch), self.ttl_ms]
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                args.append("C")
            elif isinstance(event, (BlocksStored, BlocksRemoved)) and event.block_hashes:
                args.append(_op(event))
                args.append(len(event.block_hashes))
                args.extend(h.hex() for h in event.block_hashes)
        return bool(self._call(self._apply, [], args))

    def match(self, block_hashes: Sequence[bytes], worker_ids: Sequence[str]) -> dict[str, int]:
        return {wid: m.blocks for wid, m in self.match_tiers(block_hashes, worker_ids).items()}

    def match_tiers(self, block_hashes: Sequence[bytes], worker_ids: Sequence[str]) -> dict[str, TierMatch]:
        if not worker_ids or not block_hashes:
            return dict.fromkeys(worker_ids, TierMatch())
        keys = [f"{self.prefix}{kind}:{h.hex()}" for h in block_hashes for kind in ("b", "h")]
        counts = [int(c) for c in self._call(self._match, keys, [self.prefix, *worker_ids])]
        n = len(worker_ids)
        return {wid: TierMatch(counts[i], counts[n + i]) for i, wid in enumerate(worker_ids)}

    def forget_worker(self, worker_id: str) -> None:
        self._call(self._forget, [], [self.prefix, worker_id])

    def ping(self) -> bool:
        try:
            return bool(self._client.ping())
        except redis.RedisError:
            return False

    def close(self) -> None:
        self._client.close()

    def _call(self, script: redis.commands.core.Script, keys: list[str], args: list) -> object:
        if time.monotonic() < self._down_until:
            raise IndexUnavailable(f"redis index {self.url} is unreachable (retrying soon)")
        try:
            return script(keys=keys, args=args)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            with self._lock:
                self._down_until = time.monotonic() + self.retry_after_s
            raise IndexUnavailable(f"redis index {self.url} is unreachable: {exc}") from exc
