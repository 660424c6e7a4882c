"""KubernetesDiscovery against a local fake of the EndpointSlice list/watch API.

The fake API server listens on 127.0.0.1 only and speaks the real wire format
(list JSON, chunked watch streams of JSON events, 410 Gone as an ERROR event).
The ``kubernetes`` client is the real one, pointed at it through a
``kubernetes.client.Configuration``.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import kubernetes
import pytest

from router.discovery_k8s import KubernetesDiscovery, slice_addresses

NS = "serving"
PREFILL_SEL = "kubernetes.io/service-name=kv-prefill"
DECODE_SEL = "kubernetes.io/service-name=kv-decode"
PREFIX = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"


def make_slice(
    name: str,
    service: str,
    endpoints: list[tuple[str, bool | None]] | None,
    port: int = 50061,
    port_name: str = "grpc",
    address_type: str = "IPv4",
) -> dict[str, Any]:
    eps = None
    if endpoints is not None:
        eps = []
        for ip, ready in endpoints:
            ep: dict[str, Any] = {"addresses": [ip], "conditions": {}}
            if ready is not None:
                ep["conditions"]["ready"] = ready
            eps.append(ep)
    return {
        "kind": "EndpointSlice",
        "apiVersion": "discovery.k8s.io/v1",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": address_type,
        "endpoints": eps,
        "ports": [
            {"name": "metrics", "port": 9100, "protocol": "TCP"},
            {"name": port_name, "port": port, "protocol": "TCP"},
        ],
    }


class FakeApiServer:
    """Just enough of kube-apiserver for EndpointSlice list + watch."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.rv = 100
        self.oldest_rv = 0  # watches from an older resourceVersion get 410 Gone
        self.generation = 0  # bumping it ends every open watch
        self.stopping = False
        self.slices: dict[str, dict[str, Any]] = {}
        self.history: list[tuple[int, str, dict[str, Any]]] = []
        self.requests: list[dict[str, str]] = []
        self.fail_lists = 0
        self.send_connection_close = False  # kube-apiserver keeps the connection alive
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- mutations ------------------------------------------------------------
    def _apply_locked(self, kind: str, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.rv)
        name = obj["metadata"]["name"]
        if kind == "DELETED":
            self.slices.pop(name, None)
        else:
            if kind == "MODIFIED" and name not in self.slices:
                kind = "ADDED"
            self.slices[name] = obj
        self.history.append((self.rv, kind, obj))
        self.cond.notify_all()

    def put(self, obj: dict[str, Any]) -> None:
        with self.cond:
            self._apply_locked("MODIFIED", obj)

    def delete(self, name: str) -> None:
        with self.cond:
            self._apply_locked("DELETED", self.slices[name])

    def expire_and_put(self, obj: dict[str, Any]) -> None:
        """End open watches, compact history, then change a slice unseen by any watch."""
        with self.cond:
            self.generation += 1
            self.oldest_rv = self.rv + 1
            self._apply_locked("MODIFIED", obj)

    def count(self, watch: bool) -> int:
        with self.cond:
            return sum(1 for r in self.requests if (r.get("watch") == "true") == watch)

    # -- HTTP -------------------------------------------------------------------
    @staticmethod
    def _matches(obj: dict[str, Any], selector: str) -> bool:
        labels = obj["metadata"].get("labels", {})
        for term in filter(None, selector.split(",")):
            key, _, value = term.partition("=")
            if labels.get(key) != value:
                return False
        return True

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _json(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - http.server API
                url = urlparse(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                with fake.cond:
                    fake.requests.append({"path": url.path, **query})
                if url.path != PREFIX:
                    self._json(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
                    return
                selector = query.get("labelSelector", "")
                if query.get("watch") == "true":
                    self._watch(selector, int(query.get("resourceVersion", "0")), query)
                    return
                with fake.cond:
                    if fake.fail_lists > 0:
                        fake.fail_lists -= 1
                        failing = True
                    else:
                        failing = False
                        items = [copy.deepcopy(s) for s in fake.slices.values() if fake._matches(s, selector)]
                        rv = fake.rv
                if failing:
                    self._json(500, {"kind": "Status", "code": 500, "reason": "InternalError"})
                    return
                self._json(
                    200,
                    {
                        "kind": "EndpointSliceList",
                        "apiVersion": "discovery.k8s.io/v1",
                        "metadata": {"resourceVersion": str(rv)},
                        "items": items,
                    },
                )

            def _chunk(self, event: dict[str, Any]) -> None:
                data = json.dumps(event).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def _watch(self, selector: str, since: int, query: dict[str, str]) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                if fake.send_connection_close:
                    self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                deadline = time.monotonic() + float(query.get("timeoutSeconds", "30"))
                try:
                    with fake.cond:
                        generation = fake.generation
                        if since < fake.oldest_rv:
                            gone = {
                                "kind": "Status",
                                "apiVersion": "v1",
                                "status": "Failure",
                                "message": "too old resource version",
                                "reason": "Expired",
                                "code": 410,
                            }
                            self._chunk({"type": "ERROR", "object": gone})
                            return
                        cursor = since
                        while not fake.stopping and fake.generation == generation:
                            for rv, kind, obj in fake.history:
                                if rv > cursor and fake._matches(obj, selector):
                                    self._chunk({"type": kind, "object": obj})
                            cursor = max(cursor, fake.rv)
                            remaining = deadline - time.monotonic()
                            if remaining <= 0:
                                break
                            fake.cond.wait(remaining)
                finally:
                    try:
                        self.wfile.write(b"0\r\n\r\n")
                        self.wfile.flush()
                    except OSError:
                        pass

        return Handler


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    srv = FakeApiServer()
    srv.put(
        make_slice(
            "kv-prefill-a", "kv-prefill", [("10.0.0.2", True), ("10.0.0.1", None), ("10.0.0.9", False)]
        )
    )
    srv.put(make_slice("kv-prefill-b", "kv-prefill", [("10.0.0.1", True), ("10.0.0.3", True)]))
    srv.put(make_slice("kv-decode-a", "kv-decode", [("10.0.1.1", True)], port=50071))
    srv.put(make_slice("other-a", "other", [("10.9.9.9", True)]))
    srv.start()
    yield srv
    srv.close()


Recorder = list[tuple[str, list[str]]]


@pytest.fixture
def make_discovery(server: FakeApiServer) -> Iterator[Callable[..., tuple[KubernetesDiscovery, Recorder]]]:
    made: list[KubernetesDiscovery] = []

    def factory(**kwargs: Any) -> tuple[KubernetesDiscovery, Recorder]:
        cfg = kubernetes.client.Configuration()
        cfg.host = server.url
        calls: Recorder = []
        disc = KubernetesDiscovery(
            NS,
            {"prefill": PREFILL_SEL, "decode": DECODE_SEL},
            port_name="grpc",
            on_change=lambda role, addrs: calls.append((role, addrs)),
            api_client=kubernetes.client.ApiClient(cfg),
            **{"backoff_min_s": 0.05, "backoff_max_s": 0.2, **kwargs},
        )
        made.append(disc)
        disc.start()
        return disc, calls

    yield factory
    for disc in made:
        disc.stop()


def wait_for(pred: Callable[[], bool], timeout: float = 5.0) -> float:
    """Poll ``pred``; returns the seconds it took, fails after ``timeout``."""
    start = time.monotonic()
    while not pred():
        assert time.monotonic() - start < timeout, "condition not met in time"
        time.sleep(0.01)
    return time.monotonic() - start


def test_initial_list_filters_dedups_and_sorts(make_discovery: Callable[..., Any]) -> None:
    disc, calls = make_discovery()
    assert disc.wait_synced(5)
    assert disc.addresses("prefill") == ["10.0.0.1:50061", "10.0.0.2:50061", "10.0.0.3:50061"]
    assert disc.addresses("decode") == ["10.0.1.1:50071"]
    assert disc.addresses("unknown") == []
    assert ("prefill", ["10.0.0.1:50061", "10.0.0.2:50061", "10.0.0.3:50061"]) in calls
    assert ("decode", ["10.0.1.1:50071"]) in calls


def test_unready_worker_leaves_within_5s_and_changes_apply(
    server: FakeApiServer, make_discovery: Callable[..., Any]
) -> None:
    # A long server-side watch timeout: removal must come from the watch event itself.
    disc, calls = make_discovery(watch_timeout_s=30)
    assert disc.wait_synced(5)
    wait_for(lambda: server.count(watch=True) >= 2)
    server.put(make_slice("kv-prefill-b", "kv-prefill", [("10.0.0.1", True), ("10.0.0.3", False)]))
    took = wait_for(lambda: "10.0.0.3:50061" not in disc.addresses("prefill"))
    assert took < 5.0
    assert disc.addresses("prefill") == ["10.0.0.1:50061", "10.0.0.2:50061"]
    assert calls[-1] == ("prefill", ["10.0.0.1:50061", "10.0.0.2:50061"])
    # 10.0.0.1 is ready in slice a too, so losing it from b keeps it routable.
    server.put(make_slice("kv-prefill-b", "kv-prefill", [("10.0.0.3", True)]))
    wait_for(lambda: disc.addresses("prefill") == ["10.0.0.1:50061", "10.0.0.2:50061", "10.0.0.3:50061"])
    server.delete("kv-prefill-a")
    wait_for(lambda: disc.addresses("prefill") == ["10.0.0.3:50061"])
    # A new decode slice with no endpoints at all (the API server sends null).
    server.put(make_slice("kv-decode-b", "kv-decode", None, port=50071))
    server.put(make_slice("kv-decode-c", "kv-decode", [("10.0.1.2", None)], port=50071))
    wait_for(lambda: disc.addresses("decode") == ["10.0.1.1:50071", "10.0.1.2:50071"])
    # Slices of other services never leak in.
    server.put(make_slice("other-b", "other", [("10.9.9.8", True)]))
    time.sleep(0.2)
    assert all("10.9.9" not in a for role in ("prefill", "decode") for a in disc.addresses(role))
    assert server.count(watch=False) == 2  # one list per role, then only watches


def test_watch_timeout_resumes_without_relisting(
    server: FakeApiServer, make_discovery: Callable[..., Any]
) -> None:
    disc, _ = make_discovery(watch_timeout_s=1)
    assert disc.wait_synced(5)
    wait_for(lambda: server.count(watch=True) >= 4, timeout=6)
    assert server.count(watch=False) == 2
    with server.cond:
        rvs = [int(r["resourceVersion"]) for r in server.requests if r.get("watch") == "true"]
    assert min(rvs) > 100
    server.put(make_slice("kv-decode-a", "kv-decode", [("10.0.1.1", False)], port=50071))
    wait_for(lambda: disc.addresses("decode") == [])


def test_gone_relists(server: FakeApiServer, make_discovery: Callable[..., Any]) -> None:
    disc, _ = make_discovery(watch_timeout_s=30)
    assert disc.wait_synced(5)
    wait_for(lambda: server.count(watch=True) >= 2)
    server.expire_and_put(make_slice("kv-prefill-a", "kv-prefill", [("10.0.0.7", True)]))
    wait_for(lambda: disc.addresses("prefill") == ["10.0.0.1:50061", "10.0.0.3:50061", "10.0.0.7:50061"])
    assert server.count(watch=False) >= 3  # the prefill role listed again after 410 Gone


def test_list_errors_back_off_and_recover(server: FakeApiServer, make_discovery: Callable[..., Any]) -> None:
    server.fail_lists = 3
    disc, _ = make_discovery()
    assert disc.wait_synced(5)
    assert disc.addresses("decode") == ["10.0.1.1:50071"]
    assert server.count(watch=False) == 5


@pytest.mark.parametrize("connection_close", [False, True])
def test_stop_is_prompt_with_open_watch(
    server: FakeApiServer, make_discovery: Callable[..., Any], connection_close: bool
) -> None:
    server.send_connection_close = connection_close
    disc, _ = make_discovery(watch_timeout_s=30)
    assert disc.wait_synced(5)
    wait_for(lambda: server.count(watch=True) >= 2)
    start = time.monotonic()
    disc.stop()
    assert time.monotonic() - start < 2.0
    assert not any(t.is_alive() for t in threading.enumerate() if t.name.startswith("k8s-discovery"))


def test_slice_addresses_edge_cases() -> None:
    v6 = make_slice("s", "svc", [("fd00::1", True)], address_type="IPv6")
    assert slice_addresses(v6, "grpc") == {"[fd00::1]:50061"}
    assert (
        slice_addresses(make_slice("s", "svc", [("a.example", True)], address_type="FQDN"), "grpc") == set()
    )
    assert slice_addresses(make_slice("s", "svc", [("10.0.0.1", True)], port_name="http"), "grpc") == set()
    assert slice_addresses(make_slice("s", "svc", [("10.0.0.1", True)]), "metrics") == {"10.0.0.1:9100"}


def test_without_api_client_uses_incluster_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(kubernetes.config.ConfigException):
        KubernetesDiscovery(NS, {"prefill": PREFILL_SEL})


# --- role-free workers (--worker-selector) through router.discovery.make_discovery ---------------------------

WORKER_SEL = "kubernetes.io/service-name=kv-worker"


def router_config(**kwargs: Any) -> Any:
    from router.config import RouterConfig

    config = RouterConfig(discovery="kubernetes", k8s_namespace=NS, **kwargs)
    config.validate()
    return config


def test_role_free_workers_join_the_decode_pool_beside_pinned_ones(server: FakeApiServer) -> None:
    """As Redis registers a `kvflow worker` under "decode" (its Info then says UNIFIED), so does --worker-selector;
    the two sources of the decode role are merged, not overwritten by each other."""
    from router.discovery import make_discovery as router_discovery

    server.put(make_slice("kv-worker-a", "kv-worker", [("10.0.2.1", True), ("10.0.2.2", False)], port=50081))
    cfg = kubernetes.client.Configuration()
    cfg.host = server.url
    calls: Recorder = []
    disc = router_discovery(router_config(decode_selector=DECODE_SEL, worker_selector=WORKER_SEL),
                            lambda role, addrs: calls.append((role, addrs)), api_client=kubernetes.client.ApiClient(cfg))
    disc.start()
    try:
        assert disc.wait_synced(5)
        assert set(disc.selectors) == {"decode", "worker"}
        wait_for(lambda: bool(calls) and calls[-1] == ("decode", ["10.0.1.1:50071", "10.0.2.1:50081"]))
        server.put(make_slice("kv-worker-a", "kv-worker", [("10.0.2.2", True)], port=50081))
        wait_for(lambda: calls[-1] == ("decode", ["10.0.1.1:50071", "10.0.2.2:50081"]))
        server.delete("kv-decode-a")
        wait_for(lambda: calls[-1] == ("decode", ["10.0.2.2:50081"]))
        assert {role for role, _ in calls} == {"decode"}  # never a "worker" role the pool does not know
    finally:
        disc.stop()


def test_worker_selector_alone_is_a_kubernetes_cluster() -> None:
    from kvflow.cli import build_parser
    from kvflow.commands.router import config_from_args
    from router.discovery import kubernetes_selectors

    args = build_parser().parse_args(["router", "--discovery", "kubernetes", "--k8s-namespace", NS,
                                      "--worker-selector", WORKER_SEL, "--disagg-policy", "adaptive",
                                      "--slo-ttft-ms", "500", "--slo-itl-ms", "25"])
    config = config_from_args(args)
    assert config.worker_selector == WORKER_SEL and not config.decode_selector
    assert (config.disagg_policy, config.slo_ttft_ms, config.slo_itl_ms) == ("adaptive", 500.0, 25.0)
    assert kubernetes_selectors(config) == {"worker": WORKER_SEL}
    with pytest.raises(ValueError, match="--decode-selector .* or --worker-selector"):
        router_config(prefill_selector=PREFILL_SEL)


def test_merged_sources_publish_the_union_of_a_role() -> None:
    from router.discovery import MergedSources

    calls: Recorder = []
    merged = MergedSources(lambda role, addrs: calls.append((role, addrs)), {"worker": "decode"})
    merged("decode", ["b:1"])
    merged("worker", ["a:1", "b:1"])
    merged("prefill", ["p:1"])
    merged("decode", [])
    assert calls == [("decode", ["b:1"]), ("decode", ["a:1", "b:1"]), ("prefill", ["p:1"]), ("decode", ["a:1", "b:1"])]
