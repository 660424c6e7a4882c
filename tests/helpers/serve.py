"""One real `kvflow serve` on SmolLM2 (1 prefill + 1 decode worker, API key set) for the whole test session: the
OpenAI-front tests (test_openai_fidelity, test_serve_e2e) share it instead of starting a cluster each. Its policy is
`static`, so requests take the P/D path (on one host, `adaptive` prefills every prompt locally: shared compute).
test_serve_e2e SIGTERMs it (it checks the shutdown); tests/conftest.py runs that test last."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from cluster.auth import TOKEN_ENV
from kvflow.launcher import free_port

API_KEY = "test-key"
ENGINE = ["--kv-cache-memory-bytes", str(256 << 20), "--max-model-len", "1024"]


class Server:
    def __init__(self, process: subprocess.Popen, port: int, grpc_port: int, log: Path) -> None:
        self.process, self.port, self.grpc_port, self.log = process, port, grpc_port, log
        self.url = f"http://127.0.0.1:{port}"


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        text = (task / "children").read_text().split()
        out += [int(c) for c in text]
    return out


def wait_healthy(process: subprocess.Popen, url: str, log: Path, timeout_s: float = 300) -> None:
    """Until the `kvflow serve` at `url` answers /health with 200; fails with its log if it exits or never does."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, f"kvflow serve exited:\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"kvflow serve not healthy in time:\n{log.read_text()[-3000:]}"
        time.sleep(0.5)


def start_server(log: Path) -> Iterator[Server]:
    port, grpc_port = free_port(), free_port()
    env = {**os.environ, "KVFLOW_API_KEY": API_KEY}
    env.pop(TOKEN_ENV, None)  # serve makes its own
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "kvflow.cli", "serve", "--model", "smollm2", "--port",
                                    str(port), "--grpc-port", str(grpc_port), "--disagg-policy", "static", *ENGINE],
                                   stdout=out, stderr=subprocess.STDOUT, env=env)
    srv = Server(process, port, grpc_port, log)
    try:
        wait_healthy(process, srv.url, log)
        yield srv
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(30)
