"""An HTTP server in a subprocess, for benchmarks that drive one: `kvflow serve`, `kvflow router` (or another
server's command line), started on a free port, waited for until its health path answers 200, stopped with a
signal (also on leaving a `with` block).

Invariants: the process is started by the constructor and owned by this object; `wait_ready` fails (with the tail
of the server's log, when it has one) as soon as the process exits or the deadline passes, never returning a
server that does not answer; `stop` leaves no process behind (its signal, then a kill after `timeout_s`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from kvflow.launcher import free_port


class ServerProcess:
    def __init__(self, argv: list[str], port: int, env: dict[str, str] | None = None,
                 log_path: Path | None = None, stop_signal: int = signal.SIGTERM) -> None:
        self.port = port
        self.stop_signal = stop_signal
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        # Unbuffered: a log read after a crash holds the lines up to it.
        full_env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
        out = log_path.open("wb") if log_path is not None else subprocess.DEVNULL
        self.process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=full_env)
        if log_path is not None:
            out.close()  # the child holds its own descriptor

    @classmethod
    def kvflow(cls, command: str, *flags: str, env: dict[str, str] | None = None, log_path: Path | None = None,
               stop_signal: int = signal.SIGTERM) -> ServerProcess:
        """`python -m kvflow.cli <command> <flags>` on a free HTTP port (its gRPC front, if any, on port 0)."""
        port = free_port()
        argv = [sys.executable, "-m", "kvflow.cli", command, *flags, "--port", str(port), "--grpc-port", "0"]
        return cls(argv, port, env, log_path, stop_signal)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    def log_tail(self, chars: int = 3000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_ready(self, timeout_s: float, path: str = "/health") -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}{path}", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.url}{path} did not answer in {timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def stop(self, timeout_s: float = 60) -> None:
        if self.process.poll() is None:
            self.process.send_signal(self.stop_signal)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
