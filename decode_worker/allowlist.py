"""Which prefill workers a decode worker may pull KV from (`--prefill-allowlist host:port ...`).

A decode worker dials the `prefill_address` a request names with its cluster credential, so a request must not be
able to send that credential to an arbitrary address. Rules:
- An entry is `host:port`. An address is allowed when it equals an entry (host compared case-insensitively), or
  when its host is an IP address that the entry's host resolves to and the ports match. A headless Service's DNS
  name (Kubernetes) thus allows exactly its ready pods, whose IPs are what discovery hands the router.
- A name is resolved again on a miss at most once per `RESOLVE_RETRY_S`, and always once its answer is older than
  `RESOLVE_TTL_S` (pods come and go). A failed lookup keeps the previous answer.
- A name a request gives is never resolved here: it must be listed literally.
- No entries: every address is allowed if the worker holds no cluster token (plain local dev, as before); with a
  token, none is (every request is prefilled locally) until an allowlist is configured.
A refused address is the caller's `KVTransferError("prefill_not_allowed")`: the request falls back to local
prefill and is counted in kvflow:disagg_fallback_total{reason="prefill_not_allowed"}.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

RESOLVE_RETRY_S = 1.0
RESOLVE_TTL_S = 10.0


def split_host_port(address: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` -> (host, port). Raises ValueError."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, got {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host.lower(), int(port)


def _ip(host: str) -> str | None:
    try:
        return ipaddress.ip_address(host).compressed
    except ValueError:
        return None


@dataclass
class _Entry:
    host: str
    port: int
    addresses: frozenset[str] = frozenset()  # what `host` resolved to (itself when it is an IP)
    resolved_at: float = -math.inf
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def is_name(self) -> bool:
        return _ip(self.host) is None


class PrefillAllowlist:
    def __init__(self, entries: Sequence[str], holds_token: bool) -> None:
        self._entries = []
        for text in entries:
            host, port = split_host_port(text)  # a malformed entry fails the worker's start
            ip = _ip(host)
            self._entries.append(_Entry(ip or host, port, frozenset({ip}) if ip else frozenset()))
        self.open = not self._entries and not holds_token
        if not self._entries and holds_token:
            logger.warning("this worker holds a cluster token but has no --prefill-allowlist: it pulls KV from no "
                           "prefill worker (every prompt is prefilled here)")

    def __repr__(self) -> str:
        return f"PrefillAllowlist({[f'{e.host}:{e.port}' for e in self._entries]}, open={self.open})"

    async def allows(self, address: str) -> bool:
        if self.open:
            return True
        try:
            host, port = split_host_port(address)
        except ValueError:
            return False
        ip = _ip(host)
        host = ip or host
        candidates = [e for e in self._entries if e.port == port]
        if any(e.host == host for e in candidates):
            return True
        if ip is None:
            return False
        for entry in (e for e in candidates if e.is_name):
            await self._refresh(entry, stale_after=RESOLVE_TTL_S)
            if ip not in entry.addresses:
                await self._refresh(entry, stale_after=RESOLVE_RETRY_S)
            if ip in entry.addresses:
                return True
        return False

    @staticmethod
    async def _refresh(entry: _Entry, stale_after: float) -> None:
        async with entry.lock:  # one lookup at a time per name; waiters see its answer
            if time.monotonic() - entry.resolved_at < stale_after:
                return
            entry.resolved_at = time.monotonic()
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(entry.host, entry.port,
                                                                     type=socket.SOCK_STREAM)
            except OSError as exc:
                logger.warning("--prefill-allowlist: cannot resolve %s (%s); keeping %d known addresses",
                               entry.host, exc, len(entry.addresses))
                return
            resolved = {_ip(str(info[4][0]).split("%", 1)[0]) for info in infos}
            entry.addresses = frozenset(a for a in resolved if a is not None)
