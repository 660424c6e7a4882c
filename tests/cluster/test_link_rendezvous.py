"""The KV link's rendezvous store listens on the worker's own address, not on every interface (issue 27)."""

from __future__ import annotations

import datetime

import psutil
import torch.distributed as dist

from cluster.transfer.link.group import serve_store


def test_the_rendezvous_store_listens_on_the_workers_address_alone() -> None:
    store = serve_store("127.0.0.1")
    listening = [c.laddr.ip for c in psutil.net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port]
    assert listening == ["127.0.0.1"], listening
    store.set("kvflow/link/x/a", "1")
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    assert client.get("kvflow/link/x/a") == b"1"
