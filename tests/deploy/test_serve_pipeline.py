"""`kvflow serve --pipeline-parallel-size 2` on CPU: one unified worker whose two stages are two processes answers
through the router (the worker builds its engine on a passing thread: the ranks must outlive it), and reports its
layout in /v1/models; P/D with pipeline-parallel workers is refused before any worker starts."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx

from kvflow.launcher import free_port
from tests.helpers.serve import wait_healthy

SERVE = [sys.executable, "-m", "kvflow.cli", "serve", "--model", "tiny", "--load-format", "dummy",
         "--kv-cache-memory-bytes", str(1 << 24), "--pipeline-parallel-size", "2"]


def test_serve_runs_a_pipeline_parallel_worker(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "serve.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([*SERVE, "--port", str(port), "--grpc-port", str(free_port())], stdout=out,
                                   stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url, log)
        models = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["parallel"]["workers"]
        assert [(w["role"], w["pipeline_parallel_size"], w["devices"], w["all_reduce"]) for w in models] == [
            ("decode", 2, ["cpu", "cpu"], "none")]  # one rank per stage: no all-reduce
        for _ in range(2):  # a second request: the ranks are still there after the first
            done = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": [1, 5, 9, 33, 7, 100], "max_tokens": 8, "temperature": 0,
                "ignore_eos": True})
            assert done.status_code == 200, done.text
            assert done.json()["usage"]["completion_tokens"] == 8
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


def test_serve_refuses_pipeline_parallel_prefill_workers() -> None:
    done = subprocess.run([*SERVE, "--prefill-workers", "1", "--port", "0"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    assert "--pipeline-parallel-size 2 with --prefill-workers 1" in done.stderr
    assert "started" not in done.stderr  # no worker was launched
