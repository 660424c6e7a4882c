"""Kubernetes worker discovery through EndpointSlices (``discovery.k8s.io/v1``).

The router learns its prefill and decode workers by listing, then watching,
the EndpointSlices of the workers' headless Services.  The selectors given
here (``--prefill-selector`` / ``--decode-selector`` / ``--worker-selector``
on the command line) are *EndpointSlice* label selectors, not pod selectors:
the EndpointSlice controller labels every slice with
``kubernetes.io/service-name``, so the Helm chart passes
``kubernetes.io/service-name=<fullname>-prefill`` (and ``...-decode``, or
``...-worker`` for role-free workers, which router/discovery.py merges into
the decode role), ``<fullname>`` being the chart's resource-name prefix.  The
Service's pod selector decides which pods are members; the endpoint
``conditions.ready`` flag (readiness probe passing, pod not terminating)
decides which of them receive traffic.

Semantics:

* An endpoint is routable when ``conditions.ready`` is true or absent (the API
  says a missing value means ready).  Addresses are ``ip:port`` (IPv6 as
  ``[ip]:port``), the port being the slice port named ``port_name``; they are
  deduplicated across slices and sorted.
* Each selector runs in its own daemon thread: list, then watch from the
  list's ``resourceVersion``, resuming from the last seen version whenever the
  server ends the watch.  A ``410 Gone`` relists at once; other errors relist
  after an exponential backoff, keeping the last known addresses meanwhile.
* Watch events apply immediately, so a worker that turns unready leaves the
  routing set as soon as the API server reports it.  Watches are short
  (``watch_timeout_s``, default 4 s) with a client read timeout just above it,
  so a silently dead connection is noticed within about 5 s as well.
* The watch is read as raw JSON lines (``_preload_content=False``) rather than
  through the client's model classes, because the API server encodes an empty
  slice as ``"endpoints": null``, which the generated models reject.

The router's ServiceAccount needs only ``list`` and ``watch`` on
``endpointslices`` in group ``discovery.k8s.io``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import kubernetes
from kubernetes.watch.watch import iter_resp_lines

log = logging.getLogger(__name__)

OnChange = Callable[[str, list[str]], None]


class _Gone(Exception):
    """The requested resourceVersion is too old: relist."""


def slice_addresses(obj: dict[str, Any], port_name: str) -> set[str]:
    """The ready ``ip:port`` addresses of one EndpointSlice object (a dict)."""
    if obj.get("addressType") not in ("IPv4", "IPv6"):
        return set()
    ports = [p.get("port") for p in obj.get("ports") or [] if (p.get("name") or "") == port_name]
    if not ports or ports[0] is None:
        return set()
    port = int(ports[0])
    out: set[str] = set()
    for ep in obj.get("endpoints") or []:
        if (ep.get("conditions") or {}).get("ready") is False:
            continue
        for ip in ep.get("addresses") or []:
            out.add(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
    return out


def _socket_of(resp: Any) -> socket.socket | None:
    """The socket under a streaming urllib3 response (kept by the connection, or by
    the response's file object once http.client detached it from the connection)."""
    sock = getattr(getattr(resp, "connection", None), "sock", None)
    if sock is None:
        raw = getattr(getattr(getattr(resp, "_fp", None), "fp", None), "raw", None)
        sock = getattr(raw, "_sock", None)
    return sock if isinstance(sock, socket.socket) else None


class KubernetesDiscovery:
    """Tracks ready worker addresses per role from EndpointSlice list/watch."""

    def __init__(
        self,
        namespace: str,
        selectors: dict[str, str],
        port_name: str = "grpc",
        on_change: OnChange | None = None,
        api_client: kubernetes.client.ApiClient | None = None,
        *,
        watch_timeout_s: int = 4,
        backoff_min_s: float = 0.2,
        backoff_max_s: float = 10.0,
    ) -> None:
        if api_client is None:
            kubernetes.config.load_incluster_config()
            api_client = kubernetes.client.ApiClient()
        self.namespace = namespace
        self.selectors = dict(selectors)
        self.port_name = port_name
        self.on_change = on_change
        self.watch_timeout_s = watch_timeout_s
        self.backoff_min_s = backoff_min_s
        self.backoff_max_s = backoff_max_s
        self._api = kubernetes.client.DiscoveryV1Api(api_client)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._slices: dict[str, dict[str, set[str]]] = {role: {} for role in self.selectors}
        self._current: dict[str, list[str] | None] = {role: None for role in self.selectors}
        self._synced = {role: threading.Event() for role in self.selectors}
        self._responses: dict[str, Any] = {}
        self._threads: list[threading.Thread] = []

    # -- public API ---------------------------------------------------------
    def start(self) -> None:
        """Start one list/watch thread per role."""
        self._stop.clear()
        for role, selector in self.selectors.items():
            t = threading.Thread(
                target=self._run, args=(role, selector), name=f"k8s-discovery-{role}", daemon=True
            )
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the watch threads, closing any open watch connection."""
        self._stop.set()
        with self._lock:
            responses = list(self._responses.values())
        for resp in responses:
            # shutdown() wakes a thread blocked in recv(); close() alone would wait for it.
            sock = _socket_of(resp)
            with contextlib.suppress(Exception):
                if sock is not None:
                    sock.shutdown(socket.SHUT_RDWR)
                resp.close()
        for t in self._threads:
            t.join(timeout)
        self._threads.clear()

    def addresses(self, role: str) -> list[str]:
        """Sorted ready ``ip:port`` addresses of ``role`` (empty before the first list)."""
        with self._lock:
            return list(self._current.get(role) or [])

    def wait_synced(self, timeout: float | None = None) -> bool:
        """Block until every role has completed its first list (``timeout`` in total)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for ev in self._synced.values():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not ev.wait(left):
                return False
        return True

    # -- internals ------------------------------------------------------------
    def _publish(self, role: str) -> None:
        with self._lock:
            merged = sorted(set().union(*self._slices[role].values()))
            changed = merged != self._current[role]
            self._current[role] = merged
        if changed:
            log.info("discovery: %s -> %s", role, merged)
            if self.on_change is not None:
                try:
                    self.on_change(role, list(merged))
                except Exception:
                    log.exception("discovery on_change callback failed")

    def _run(self, role: str, selector: str) -> None:
        backoff = self.backoff_min_s
        while not self._stop.is_set():
            try:
                rv = self._list(role, selector)
                self._synced[role].set()
                backoff = self.backoff_min_s
                while not self._stop.is_set():
                    rv = self._watch(role, selector, rv)
            except _Gone:
                log.info("discovery: %s watch expired, relisting", role)
            except Exception as exc:
                if self._stop.is_set():
                    return
                log.warning("discovery: %s list/watch failed (%s); retry in %.1fs", role, exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.backoff_max_s)

    def _list(self, role: str, selector: str) -> str:
        resp = self._api.list_namespaced_endpoint_slice(
            self.namespace,
            label_selector=selector,
            _preload_content=False,
            _request_timeout=(3.0, 10.0),
        )
        body = json.loads(resp.data)
        slices = {
            item["metadata"]["name"]: slice_addresses(item, self.port_name)
            for item in body.get("items") or []
        }
        with self._lock:
            self._slices[role] = slices
        self._publish(role)
        return str(body["metadata"]["resourceVersion"])

    def _events(self, role: str, selector: str, rv: str) -> Iterator[dict[str, Any]]:
        resp = self._api.list_namespaced_endpoint_slice(
            self.namespace,
            label_selector=selector,
            watch=True,
            resource_version=rv,
            allow_watch_bookmarks=True,
            timeout_seconds=self.watch_timeout_s,
            _preload_content=False,
            _request_timeout=(3.0, self.watch_timeout_s + 1.0),
        )
        with self._lock:
            self._responses[role] = resp
        try:
            if self._stop.is_set():  # stop() ran before it could see this response
                return
            for line in iter_resp_lines(resp):
                if line.strip():
                    yield json.loads(line)
        finally:
            with self._lock:
                self._responses.pop(role, None)
            resp.close()
            resp.release_conn()

    def _watch(self, role: str, selector: str, rv: str) -> str:
        """Apply one watch stream's events; returns the resourceVersion to resume from."""
        try:
            for event in self._events(role, selector, rv):
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise _Gone()
                    raise RuntimeError(f"watch error: {obj.get('reason')}: {obj.get('message')}")
                rv = str(obj.get("metadata", {}).get("resourceVersion") or rv)
                if kind == "BOOKMARK":
                    continue
                name = obj["metadata"]["name"]
                with self._lock:
                    if kind == "DELETED":
                        self._slices[role].pop(name, None)
                    else:
                        self._slices[role][name] = slice_addresses(obj, self.port_name)
                self._publish(role)
        except kubernetes.client.ApiException as exc:
            if exc.status == 410:
                raise _Gone() from exc
            raise
        return rv
