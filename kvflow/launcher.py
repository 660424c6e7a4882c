"""Start a one-machine cluster: worker subprocesses (`kvflow prefill` / `kvflow decode` on free ports) and, in
the calling process, the router. Children die with the launcher (PR_SET_PDEATHSIG) and are terminated, then
killed, on shutdown, so no orphan is left behind.

GPU placement (kvflow/placement.py): each worker owns one GPU (`--device cuda:N`), from `--prefill-gpus` /
`--decode-gpus` or, by default, spread over the visible GPUs in order (prefill workers first).
Workers share a GPU when there are fewer GPUs than workers; their default memory shares then split vLLM's 0.9
(0.45 each for two), and they start one after another, so each one's memory profile sees only itself.

Credentials: the spec's `ClusterAuth` is the workers' (the token in their environment only, never in argv; TLS
files as flags), and decode workers may pull KV only from the prefill workers started here
(`--prefill-allowlist`): every port is chosen before the first worker starts.

Supervision (`WorkerCluster.supervise`, run by `kvflow serve`): a worker that dies is started again with the same
role, port, worker id and GPU placement, after a backoff (`RestartBackoff`: 1 s doubling to 30 s, back to 1 s once a
worker stayed up a minute); the router, which keeps following the address, takes it back when it answers. Workers
run in their own session, so a Ctrl-C at the terminal reaches the launcher only, which stops them in order (router
drain first, then workers).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from tqdm.auto import tqdm

from cluster.auth import TOKEN_ENV, ClusterAuth
from engine.arg_utils import EngineArgs
from engine.config import GiB
from engine.process.cpu_memory import tcmalloc_preload
from engine.process.lifeline import lifeline_env
from engine.process.memory_budget import WorkerMemory
from engine.process.openmp import openmp_env
from kvflow.cluster_spec import ClusterSpec
from kvflow.placement import DEFAULT_GPU_MEMORY_UTILIZATION as DEFAULT_GPU_MEMORY_UTILIZATION
from kvflow.placement import Placement, place_workers, visible_gpus
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc

logger = logging.getLogger(__name__)

# Flags with BooleanOptionalAction in EngineArgs.add_cli_args: False is spelled --no-<flag>.
_NEGATABLE = {"enable_prefix_caching", "enable_chunked_prefill"}
# disable_log_stats: workers log stats unless told (spawned with the flag); usage_context: set in code.
# device / gpu_memory_utilization: chosen per worker by the placement.
_NOT_FORWARDED = {"disable_log_stats", "usage_context", "device", "gpu_memory_utilization"}


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
        elif isinstance(value, dict):  # JSON flags (--override-generation-config, --speculative-config)
            out += [flag, json.dumps(value)]
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):  # a config object (EngineArgs built in code)
            out += [flag, json.dumps(dataclasses.asdict(value))]
        elif value is not None:
            out += [flag, str(value)]
    return out


@dataclass
class WorkerProcess:
    role: str
    address: str
    process: subprocess.Popen
    log_path: Path
    placement: Placement
    ready: bool = False
    index: int = 0  # among all workers, prefill first (names its log and worker id)
    started_at: float = field(default_factory=time.monotonic)
    restarts: int = 0
    backoff_s: float | None = None  # the last restart delay (None: no restart yet in this streak)
    died_at: float | None = None  # set while it is dead or restarting, until it answers again
    restart_at: float | None = None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class WorkerExited(RuntimeError):
    """A worker died while the cluster started; the message names its log and ends with the log's tail."""


@dataclass(frozen=True)
class RestartBackoff:
    """The delay before a dead worker is started again: `initial_s`, doubling per quick death up to `max_s`; a worker
    that ran `reset_after_s` before dying starts the streak over."""

    initial_s: float = 1.0
    max_s: float = 30.0
    reset_after_s: float = 60.0

    def delay(self, previous_s: float | None, uptime_s: float) -> float:
        if previous_s is None or uptime_s >= self.reset_after_s:
            return self.initial_s
        return min(previous_s * 2, self.max_s)


PREFLIGHT_TIMEOUT_S = 600.0  # a first run may convert a GGUF model


def preflight(spec: ClusterSpec, timeout_s: float = PREFLIGHT_TIMEOUT_S) -> ClusterSpec:
    """Check the workers' engine config before any starts (engine/process/preflight.py, in a child process), so that a bad
    one is refused in one line (ValueError), and size CPU workers' KV caches from the host's memory
    (engine/process/memory_budget.py) unless --kv-cache-memory-bytes / --num-gpu-blocks-override is set. Returns the spec
    the workers start with."""
    args = spec.engine_args
    processes = spec.prefill_workers * spec.ranks_per_worker("prefill") + \
        spec.decode_workers * spec.ranks_per_worker("decode")
    roles = [role for role, count in (("prefill", spec.prefill_workers), ("decode", spec.decode_workers)) if count]
    # One check per distinct tensor-parallel size (each role's config must be valid); the smaller KV budget wins.
    sizes = sorted({spec.tensor_parallel_size(role) for role in roles}) or [args.tensor_parallel_size]
    results = [_preflight_check(dataclasses.replace(args, tensor_parallel_size=size), processes, timeout_s)
               for size in sizes]
    if any("worker" not in result for result in results):
        return spec  # GPU workers: each sizes its KV cache from its share of the GPU
    worker = min((WorkerMemory(**result["worker"]) for result in results), key=lambda w: w.kv_cache)
    log_cpu_budget(worker, processes, results[0]["available"])
    if args.kv_cache_memory_bytes is not None or args.num_gpu_blocks_override is not None:
        return spec
    return dataclasses.replace(spec, engine_args=dataclasses.replace(args, kv_cache_memory_bytes=worker.kv_cache))


def _preflight_check(args: EngineArgs, processes: int, timeout_s: float) -> dict:
    argv = [sys.executable, "-m", "engine.process.preflight", "--processes", str(processes), *engine_argv(args),
            "--model", args.model, "--device", args.device]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL,
                          env={**os.environ, **lifeline_env()})
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"the engine config check exited with code {done.returncode}:\n{tail}")
    result = json.loads(lines[-1])
    if "error" in result:
        raise ValueError(result["error"])
    return result


def log_cpu_budget(worker: WorkerMemory, processes: int, available: int | None) -> None:
    where = "unknown available memory" if available is None else f"{available / GiB:.1f} GiB available"
    logger.info("memory budget of each CPU worker process: %s", worker.describe())
    logger.info("memory budget of the %d CPU worker process(es): %.2f GiB of %s (MemAvailable); "
                "--kv-cache-memory-bytes sets the KV cache", processes, processes * worker.total / GiB, where)


class WorkerCluster:
    """The worker subprocesses of a `kvflow serve`; use as a context manager."""

    def __init__(self, spec: ClusterSpec) -> None:
        if spec.prefill_workers < 0 or spec.decode_workers < 1:
            raise ValueError("need --decode-workers >= 1 and --prefill-workers >= 0")
        self.spec = spec
        self.log_dir = spec.log_dir or Path(tempfile.mkdtemp(prefix="kvflow-serve-"))
        self.owns_log_dir = spec.log_dir is None  # a temporary directory: removed by `remove_logs`
        self.workers: list[WorkerProcess] = []
        self._pending: list[tuple[int, Placement]] = []
        self._gpu_ids: list[str] = []
        self._ports: dict[int, int] = {}  # worker index -> its gRPC port, chosen up front
        self._prefill_addresses: list[str] = []

    def addresses(self, role: str) -> list[str]:
        return [w.address for w in self.workers if w.role == role]

    def start(self) -> None:
        """Start every worker whose GPU has no other worker still starting; `wait_ready` starts the rest."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        gpu_ids = visible_gpus() if self.spec.engine_args.device in ("auto", "cuda") else []
        self._gpu_ids = gpu_ids
        self._pending = list(enumerate(place_workers(self.spec, len(gpu_ids))))
        if any(placement.gpu is None for _, placement in self._pending):
            # Built here, once and in parallel, rather than by each worker's engine at load (silent, one at a time).
            # Imported here: a router-only process never loads kernels/ (tests/deploy/test_floor_plan.py).
            from kernels.cpu_build import build_all

            build_all(echo=logger.info)
        self._ports = {index: free_port(self.spec.host) for index, _ in self._pending}
        # Where decode workers may pull KV from: the prefill workers, or, role-free, every worker (any may be moved
        # into the prefill pool).
        self._prefill_addresses = [f"{self.spec.host}:{self._ports[index]}" for index, placement in self._pending
                                   if placement.role == "prefill" or self.spec.role_free]
        self._start_unblocked()

    def _start_unblocked(self) -> None:
        starting: set[int] = set()
        for worker in self.workers:
            if not worker.ready:
                starting |= worker.placement.gpus
        for item in list(self._pending):
            index, placement = item
            if placement.gpus & starting:
                continue  # one start at a time per GPU: its memory profile must see only workers that are up
            self._pending.remove(item)
            self._spawn(index, placement)
            starting |= placement.gpus

    def _spawn(self, index: int, placement: Placement) -> None:
        port = self._ports[index]
        log_path = self.log_dir / f"{placement.role}-{index}.log"
        process = self._popen(placement, index, port, log_path, "wb")
        self.workers.append(WorkerProcess(placement.role, f"{self.spec.host}:{port}", process, log_path, placement,
                                          index=index))
        where = "CPU" if placement.gpu is None else "GPU " + ",".join(self._gpu_ids[g] for g in sorted(placement.gpus))
        logger.info("started %s worker %d on port %d, %s (log %s)", placement.role, index, port, where, log_path)

    def _popen(self, placement: Placement, index: int, port: int, log_path: Path, log_mode: str) -> subprocess.Popen:
        argv = self.worker_argv(index, placement, port)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop(TOKEN_ENV, None)  # the spec's credential only
        env.update(self.spec.auth.env())
        env.update(lifeline_env())  # the child dies with us (engine/process/lifeline.py: why not a preexec_fn)
        preload = tcmalloc_preload(env) if placement.gpu is None else None
        if preload is not None:  # CPU workers: tcmalloc when installed (engine/process/cpu_memory.py)
            env["LD_PRELOAD"] = preload
        if placement.gpu is None:  # its CLI would choose the same; a caller's OpenMP settings win
            env.update(openmp_env(env))
        with open(log_path, log_mode) as log:  # own session: a terminal's Ctrl-C goes to the launcher only
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)

    def worker_argv(self, index: int, placement: Placement, port: int) -> list[str]:
        """The command line of one worker (its engine flags, placement and role options)."""
        spec = self.spec
        role = placement.role
        # Speculation is a decode worker's: a prefill worker stops at the first token.
        decodes = role == "decode" or spec.role_free
        args = spec.role_engine_args(role)
        args = args if decodes else args.without_speculation()
        command = "worker" if spec.role_free else role
        argv = [sys.executable, "-m", "kvflow.cli", command, "--port", str(port), *engine_argv(args),
                "--model", spec.engine_args.model, "--index", spec.index, "--host", spec.host,
                "--worker-id", f"{role}-{index}-{port}", "--kv-transfer-backend", spec.kv_transfer_backend,
                *spec.worker_extra_args]
        if spec.auth.tls is not None:
            argv += spec.auth.tls.argv()
        if placement.gpu is not None:
            # Every worker sees all the GPUs and selects its own: hiding the others (CUDA_VISIBLE_DEVICES) would
            # keep NCCL from using CUDA IPC / NVLink between two workers' GPUs.
            argv += ["--device", f"cuda:{placement.gpu}", "--gpu-memory-utilization",
                     str(placement.gpu_memory_utilization)]
        elif spec.engine_args.device != "auto":
            argv += ["--device", spec.engine_args.device]
        if spec.engine_args.disable_log_stats:
            argv.append("--disable-log-stats")
        if spec.drain_timeout_s is not None:
            argv += ["--drain-timeout", str(spec.drain_timeout_s)]
        if decodes:
            argv += list(spec.decode_extra_args)
            if self._prefill_addresses:
                argv += ["--prefill-allowlist", *self._prefill_addresses]
            if spec.disagg_min_prompt_tokens is not None:
                argv += ["--disagg-min-prompt-tokens", str(spec.disagg_min_prompt_tokens)]
        return argv

    def wait_ready(self, timeout_s: float = 600.0, progress: bool = True) -> None:
        """Block until every worker answers Info (the model is loaded), starting the ones that waited for their
        GPU, with a progress bar."""
        deadline = time.monotonic() + timeout_s
        total = len(self.workers) + len(self._pending)
        bar = tqdm(total=total, desc=f"Loading {self.spec.engine_args.model} on workers", unit="worker",
                   disable=not progress, file=sys.stderr)
        try:
            while True:
                pending = [w for w in self.workers if not w.ready]
                if not pending and not self._pending:
                    return
                for worker in pending:
                    if worker.process.poll() is not None:
                        raise WorkerExited(f"{worker.role} worker {worker.index} on {worker.address} exited with "
                                           f"code {worker.process.returncode} during startup; its log "
                                           f"({worker.log_path}) ends with:\n{worker.log_tail()}")
                    if _answers_info(worker, self.spec.auth):
                        worker.ready = True
                        bar.update(1)
                        self._start_unblocked()
                if time.monotonic() > deadline:
                    waiting = [w.address for w in self.workers if not w.ready]
                    raise TimeoutError(f"workers not ready after {timeout_s:.0f} s: {', '.join(waiting)} "
                                       f"({len(self._pending)} not started; logs in {self.log_dir})")
                time.sleep(0.25)
        finally:
            bar.close()

    async def supervise(self, on_restart: Callable[[WorkerProcess], None], active: Callable[[], bool],
                        backoff: RestartBackoff = RestartBackoff(), poll_s: float = 0.5) -> None:
        """Restart dead workers (same role, port and placement) after `backoff`, until cancelled; `on_restart`
        runs at each restart, and nothing restarts while `active()` is false (the cluster is stopping).

        Must run on the main thread's event loop: PR_SET_PDEATHSIG follows the thread that started a child."""
        while True:
            now = time.monotonic()
            for worker in self.workers:
                if worker.process.poll() is None:
                    if worker.died_at is not None and await asyncio.to_thread(_answers_info, worker, self.spec.auth):
                        logger.info("%s worker %d on %s is serving again, %.1f s after it died", worker.role,
                                    worker.index, worker.address, time.monotonic() - worker.died_at)
                        worker.ready, worker.died_at = True, None
                    continue
                if worker.restart_at is None:
                    worker.ready = False
                    worker.died_at = worker.died_at or now
                    worker.backoff_s = backoff.delay(worker.backoff_s, now - worker.started_at)
                    worker.restart_at = now + worker.backoff_s
                    logger.error("%s worker %d on %s exited with code %s; restarting it in %.0f s; its log (%s) "
                                 "ends with:\n%s", worker.role, worker.index, worker.address,
                                 worker.process.returncode, worker.backoff_s, worker.log_path, worker.log_tail())
                elif now >= worker.restart_at and active() and not self._gpu_busy(worker):
                    self._restart(worker)
                    on_restart(worker)
            await asyncio.sleep(poll_s)

    def _gpu_busy(self, worker: WorkerProcess) -> bool:
        """Another worker on its GPU is starting: its memory profile must not see two starting workers."""
        gpus = worker.placement.gpus
        return bool(gpus) and any(w is not worker and w.placement.gpus & gpus and not w.ready
                                  and w.process.poll() is None for w in self.workers)

    def _restart(self, worker: WorkerProcess) -> None:
        port = int(worker.address.rsplit(":", 1)[1])
        worker.restarts += 1
        worker.restart_at = None
        worker.started_at = time.monotonic()
        # the log keeps the previous run's end
        worker.process = self._popen(worker.placement, worker.index, port, worker.log_path, "ab")
        logger.warning("restarted %s worker %d on %s (restart %d, pid %d)", worker.role, worker.index,
                       worker.address, worker.restarts, worker.process.pid)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every worker (each drains), wait up to `grace_s`, then kill those left."""
        for worker in self.workers:
            if worker.process.poll() is None:
                worker.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for worker in self.workers:
            try:
                worker.process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                logger.warning("%s worker %d on %s did not stop within %.0f s: killed", worker.role, worker.index,
                               worker.address, grace_s)
                worker.process.kill()
                worker.process.wait()

    def remove_logs(self) -> bool:
        """Remove the temporary log directory (never a --log-dir), unless a worker died: its log is then kept for
        reading, and where it is said once more. True if removed."""
        if not self.owns_log_dir:
            return False
        if any(w.restarts or w.died_at is not None or (w.process.returncode or 0) > 0 for w in self.workers):
            logger.warning("worker logs kept in %s (a worker died while serving)", self.log_dir)
            return False
        shutil.rmtree(self.log_dir, ignore_errors=True)
        return True

    def __enter__(self) -> WorkerCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _answers_info(worker: WorkerProcess, auth: ClusterAuth) -> bool:
    channel = auth.channel(worker.address)
    try:
        stub = kvflow_pb2_grpc.GenerationStub(channel) if worker.role == "decode" else \
            kvflow_pb2_grpc.PrefillStub(channel)
        stub.Info(pb.InfoRequest(), timeout=1.0)
        return True
    except grpc.RpcError:
        return False
    finally:
        channel.close()
