"""Start a one-machine cluster: worker subprocesses (`kvflow prefill` / `kvflow decode` on free ports) and, in
the calling process, the router. Children die with the launcher (PR_SET_PDEATHSIG) and are terminated, then
killed, on shutdown, so no orphan is left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from tqdm.auto import tqdm

from engine.config import EngineArgs
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc

logger = logging.getLogger(__name__)

# Flags with BooleanOptionalAction in EngineArgs.add_cli_args: False is spelled --no-<flag>.
_NEGATABLE = {"enable_prefix_caching", "enable_chunked_prefill"}
# disable_log_stats: a worker-local logging choice; usage_context: set in code (workers are servers), no flag.
_NOT_FORWARDED = {"disable_log_stats", "usage_context"}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def engine_argv(args: EngineArgs) -> list[str]:
    """Command-line flags that reproduce `args` (only those differing from the defaults)."""
    default = EngineArgs()
    out: list[str] = []
    for f in dataclasses.fields(EngineArgs):
        value = getattr(args, f.name)
        if f.name in _NOT_FORWARDED or value == getattr(default, f.name):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            if f.name in _NEGATABLE:
                out.append(flag if value else f"--no-{flag[2:]}")
            elif value:
                out.append(flag)
        elif isinstance(value, (list, tuple)):
            out += [flag, *map(str, value)]
        elif value is not None:
            out += [flag, str(value)]
    return out


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM the child if the launcher dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


@dataclass
class WorkerProcess:
    role: str
    address: str
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass(frozen=True)
class ClusterSpec:
    engine_args: EngineArgs
    prefill_workers: int = 1
    decode_workers: int = 1
    index: str = "memory"
    host: str = "127.0.0.1"
    disagg_min_prompt_tokens: int | None = None
    log_dir: Path | None = None
    worker_extra_args: tuple[str, ...] = ()
    decode_extra_args: tuple[str, ...] = ()  # e.g. a smaller KV pool on decode workers


class WorkerCluster:
    """The worker subprocesses of a `kvflow serve`; use as a context manager."""

    def __init__(self, spec: ClusterSpec) -> None:
        if spec.prefill_workers < 0 or spec.decode_workers < 1:
            raise ValueError("need --decode-workers >= 1 and --prefill-workers >= 0")
        self.spec = spec
        self.log_dir = spec.log_dir or Path(tempfile.mkdtemp(prefix="kvflow-serve-"))
        self.workers: list[WorkerProcess] = []

    def addresses(self, role: str) -> list[str]:
        return [w.address for w in self.workers if w.role == role]

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        common = [*engine_argv(self.spec.engine_args), "--model", self.spec.engine_args.model, "--index",
                  self.spec.index, "--host", self.spec.host]
        roles = ["prefill"] * self.spec.prefill_workers + ["decode"] * self.spec.decode_workers
        for i, role in enumerate(roles):
            port = free_port(self.spec.host)
            argv = [sys.executable, "-m", "kvflow.cli", role, "--port", str(port), *common,
                    "--worker-id", f"{role}-{i}-{port}", *self.spec.worker_extra_args]
            if role == "decode":
                argv += list(self.spec.decode_extra_args)
                if self.spec.disagg_min_prompt_tokens is not None:
                    argv += ["--disagg-min-prompt-tokens", str(self.spec.disagg_min_prompt_tokens)]
            log_path = self.log_dir / f"{role}-{i}.log"
            with open(log_path, "wb") as log:
                process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           preexec_fn=_die_with_parent, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            self.workers.append(WorkerProcess(role, f"{self.spec.host}:{port}", process, log_path))
            logger.debug("started %s worker pid %d on port %d (log %s)", role, process.pid, port, log_path)

    def wait_ready(self, timeout_s: float = 600.0, progress: bool = True) -> None:
        """Block until every worker answers Info (the model is loaded), showing a progress bar."""
        pending = list(self.workers)
        deadline = time.monotonic() + timeout_s
        bar = tqdm(total=len(pending), desc=f"Loading {self.spec.engine_args.model} on workers", unit="worker",
                   disable=not progress, file=sys.stderr)
        try:
            while pending:
                for worker in list(pending):
                    if worker.process.poll() is not None:
                        raise RuntimeError(f"{worker.role} worker on {worker.address} exited with code "
                                           f"{worker.process.returncode} during startup; its log "
                                           f"({worker.log_path}) ends with:\n{worker.log_tail()}")
                    if _answers_info(worker):
                        pending.remove(worker)
                        bar.update(1)
                if pending:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"workers not ready after {timeout_s:.0f} s: "
                                           f"{', '.join(w.address for w in pending)} (logs in {self.log_dir})")
                    time.sleep(0.25)
        finally:
            bar.close()

    def check_alive(self) -> list[WorkerProcess]:
        return [w for w in self.workers if w.process.poll() is not None]

    def stop(self, grace_s: float = 10.0) -> None:
        for worker in self.workers:
            if worker.process.poll() is None:
                worker.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for worker in self.workers:
            try:
                worker.process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()

    def __enter__(self) -> WorkerCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _answers_info(worker: WorkerProcess) -> bool:
    channel = grpc.insecure_channel(worker.address)
    try:
        stub = kvflow_pb2_grpc.GenerationStub(channel) if worker.role == "decode" else \
            kvflow_pb2_grpc.PrefillStub(channel)
        stub.Info(pb.InfoRequest(), timeout=1.0)
        return True
    except grpc.RpcError:
        return False
    finally:
        channel.close()
