"""`kvflow bench startup`: how long `kvflow serve` takes to answer, and how much memory all its processes hold.

It starts `kvflow serve --model M <serve flags>` on a free port and samples the summed resident memory (VmRSS) of its
process tree every `SAMPLE_S`. It records the seconds to /health 200 and to the first chat answer, then sends a few
completions of growing length (the largest steps a first user makes) and stops the server with SIGTERM. Issue 28's
goals on SmolLM2: start-up ≤ 60 s and peak ≤ 4 GB.

Invariants: the server is stopped whatever happens; a sample never counts a process twice (one walk of the tree).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from kvflow.benchmarks.server import ServerProcess

SAMPLE_S = 0.2
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GROWING_PROMPTS = ("The capital of France is", "Write a short poem about the sea. " * 20, "Explain KV caches. " * 100)


def process_tree(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            with contextlib.suppress(OSError):  # the task ended meanwhile
                todo += [int(child) for child in (task / "children").read_text().split()]
    return found


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakMemory:
    """The largest summed RSS of a process tree, sampled on a thread until `stop`."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, sum(rss_bytes(pid) for pid in process_tree(self.pid)))
            self._stop.wait(SAMPLE_S)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run_startup(model: str, serve_flags: list[str], timeout_s: float, log_path: Path) -> dict[str, Any]:
    started = time.monotonic()
    with ServerProcess.kvflow("serve", "--model", model, *serve_flags, log_path=log_path) as server:
        memory = PeakMemory(server.process.pid)
        try:
            server.wait_ready(timeout_s)
            ready_s = time.monotonic() - started
            reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=timeout_s, json={
                "model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 16})
            reply.raise_for_status()
            answered_s = time.monotonic() - started
            peak_at_start = memory.peak
            for prompt in GROWING_PROMPTS:
                httpx.post(f"{server.url}/v1/completions", timeout=timeout_s, json={
                    "model": model, "prompt": prompt, "max_tokens": 64, "temperature": 0}).raise_for_status()
        finally:
            server.stop()
            peak = memory.stop()
    return {"model": model, "serve_flags": serve_flags, "ready_s": round(ready_s, 1),
            "first_answer_s": round(answered_s, 1), "answer": reply.json()["choices"][0]["message"]["content"],
            "peak_rss_gb_after_first_answer": round(peak_at_start / 1e9, 3), "peak_rss_gb": round(peak / 1e9, 3),
            "cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}


def format_line(record: dict[str, Any]) -> str:
    return (f"kvflow serve --model {record['model']}: healthy in {record['ready_s']} s, first answer in "
            f"{record['first_answer_s']} s, peak memory {record['peak_rss_gb']} GB over all processes")


def to_json(record: dict[str, Any]) -> str:
    return json.dumps(record)
