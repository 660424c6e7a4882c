"""Tensor- and pipeline-parallel execution: one process per rank, the scheduler on rank 0 only.

Rank 0 is the engine's own process: `create_runner` starts ranks 1..N-1 (N = tp x pp) as child processes
(`python -m engine.parallel.worker`), joins them in process groups of their own (engine/parallel/pipeline.py:
NCCL between GPUs, gloo on CPUs; rendezvous through a c10d TCPStore on a free local port) and returns a
`TPDriverRunner`. With pipeline stages, rank 0 runs the last stage (it samples); the others run their stage's
layers and pass the activations on (engine/parallel/stages.py). Before each step the driver writes
the step's `SchedulerOutput` to every child's stdin (engine/parallel/codec.py: explicit JSON, length-prefixed
frames, no pickle); then every rank runs the same `ModelRunner.execute_model`, whose collectives (two all-reduces
per layer, the embedding's all-reduce and the logits' all-gather) keep them in lockstep. All ranks see the full
logits, so every rank samples identically (same seeds, same generators); only rank 0's result is used.

Failure: a child that exits, a closed pipe, a collective that fails, or a step or a frame written to a rank that
runs past KVFLOW_TP_TIMEOUT_S makes the driver raise `TensorParallelError` on this and every later step and the
health probe (`check_ranks`), and the worker's health turns NOT_SERVING. A watchdog thread aborts the
communicators as soon as a child dies or a step overruns, so a rank blocked in a collective fails at once (NCCL
kernels have no timeout of their own). Children exit when their stdin closes (the driver stopped) and die with the
process that started them (engine/process/lifeline.py). `shutdown` (or interpreter exit) stops them. Before any of
that, a task (a step, a frame written to a rank) that runs past KVFLOW_TP_HANG_REPORT_S is reported by every rank
in it: what it is, the calls the rank issued, every thread's stack (engine/parallel/hang_report.py).

A caller above the engine (the KV transport) may start the ranks under its own module (`rank_module`, which runs
`engine.parallel.worker.run` with a `RankExtension`), with environment of its own (`rank_env`: a credential, never
in argv) and `tell` them frames of its own: they go down the same pipe
as the steps, so each rank handles them in order with the steps (a KV import told before a step lands before it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from typing import IO, Any

import torch

from engine.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from engine.kv_port import KVRanks
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.parallel import codec
from engine.parallel.group import tp_timeout_s
from engine.parallel.hang_report import HangWatch, hang_report_s
from engine.parallel.layout import shard_for, validate_tp
from engine.parallel.nccl_env import set_nccl_env_defaults
from engine.parallel.pipeline import ParallelWorld, describe_step
from engine.parallel.stages import validate_pp
from engine.process.lifeline import lifeline_env
from engine.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

FRAME_HEADER = struct.Struct("<Q")
MSG_INIT_KV = b"I"
MSG_STEP = b"S"
MSG_QUIT = b"Q"
MSG_EXTENSION = b"X"  # a frame for the rank's extension (engine/parallel/worker.py)
DEFAULT_RANK_MODULE = "engine.parallel.worker"
WATCH_INTERVAL_S = 0.2
STOP_GRACE_S = 5.0


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died or a collective failed: this engine cannot run another step."""


# ---- framing and config (both sides) --------------------------------------------------------------------------
def write_frame(stream: IO[bytes], payload: bytes) -> None:
    stream.write(FRAME_HEADER.pack(len(payload)))
    stream.write(payload)
    stream.flush()


def read_frame(stream: IO[bytes]) -> bytes | None:
    """One frame, or None at end of stream."""
    header = stream.read(FRAME_HEADER.size)
    if len(header) < FRAME_HEADER.size:
        return None
    (length,) = FRAME_HEADER.unpack(header)
    payload = stream.read(length)
    if len(payload) < length:
        return None
    return payload


def encode_config(config: EngineConfig) -> dict[str, Any]:
    """What another rank needs to rebuild this config (the architecture is re-read from the model itself)."""
    model = config.model
    return {
        "model": {"model": model.model, "model_id": model.model_id, "model_path": model.model_path,
                  "tokenizer_path": model.tokenizer_path, "dtype": model.dtype, "max_model_len": model.max_model_len,
                  "load_format": model.load_format, "generation_config": model.generation_config,
                  "seed": model.seed},
        "cache": dataclasses.asdict(config.cache),
        "scheduler": dataclasses.asdict(config.scheduler),
        "device": dataclasses.asdict(config.device),
    }


def decode_config(doc: dict[str, Any]) -> EngineConfig:
    from engine.config import ModelConfig
    from engine.models.loader import resolve_model

    m = doc["model"]
    resolved = resolve_model(m["model"], "dummy" if m["load_format"] == "dummy" else "auto")
    model = ModelConfig(m["model"], m["model_id"], m["model_path"], m["tokenizer_path"], resolved.arch,
                        resolved.hf_config, m["dtype"], m["max_model_len"], m["load_format"],
                        m["generation_config"], m["seed"])
    device = dict(doc["device"])
    if device["cudagraph_capture_sizes"] is not None:
        device["cudagraph_capture_sizes"] = tuple(device["cudagraph_capture_sizes"])
    return EngineConfig(model, CacheConfig(**doc["cache"]), SchedulerConfig(**doc["scheduler"]),
                        DeviceConfig(**device))


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: CPU for every rank, else the r-th GPU after rank 0's (consecutive GPUs)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return device
    base = dev.index if dev.index is not None else torch.cuda.current_device()
    return f"cuda:{base + rank}"


def cpu_threads_per_rank(size: int) -> int:
    return max(1, (os.cpu_count() or 1) // size)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---- rank 0 ---------------------------------------------------------------------------------------------------
def create_runner(config: EngineConfig, rank_module: str = DEFAULT_RANK_MODULE,
                  rank_env: Mapping[str, str] | None = None) -> ModelRunner:
    """The engine's runner: a plain `ModelRunner` for one rank, else a `TPDriverRunner` with its ranks started
    (each `python -m rank_module`, with `rank_env` added to this process's environment)."""
    tp, pp = config.device.tensor_parallel_size, config.device.pipeline_parallel_size
    size = tp * pp
    if size == 1:
        return ModelRunner(config)
    validate_tp(config.model.arch, tp)
    validate_pp(config.model.arch.num_layers, pp)
    device = rank_device(config.device.device, 0)
    if device.startswith("cuda"):
        last = rank_device(device, size - 1)
        if torch.device(last).index >= torch.cuda.device_count():  # type: ignore[operator]
            raise ValueError(f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} on {device} needs GPUs up "
                             f"to {last}, but only "
                             f"{torch.cuda.device_count()} are visible")
    config = dataclasses.replace(config, device=dataclasses.replace(config.device, device=device))
    return TPDriverRunner(config, rank_module, rank_env)


def kv_ranks(runner: ModelRunner) -> KVRanks:
    """The engine's KV as a transport sees it across ranks: every rank's heads and, with several, the way to them."""
    group = runner.tp_group
    if group is None:
        return KVRanks.single(runner.shard.num_kv_heads)
    arch = runner.config.model.arch
    heads = tuple(shard_for(arch, rank, group.size).kv_heads for rank in range(group.size))
    if not isinstance(runner, TPDriverRunner):
        return KVRanks(heads, store=group.store)
    return KVRanks(heads, runner.tell, runner.check_ranks, group.store)


def _stop_children(procs: list[subprocess.Popen], keeper_done: threading.Event) -> None:
    """Close each child's stdin (it exits), make sure it is gone, then let the thread that started them end.
    Safe to call twice."""
    for proc in procs:
        with contextlib.suppress(Exception):
            if proc.stdin is not None and not proc.stdin.closed:
                write_frame(proc.stdin, MSG_QUIT)
                proc.stdin.close()
    for proc in procs:
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    keeper_done.set()


def _start_children(argv: list[str], env: dict[str, str], setups: list[bytes], procs: list[subprocess.Popen],
                    keeper_done: threading.Event) -> None:
    """Start one child per setup frame on a thread of their own that lives until `keeper_done`: PR_SET_PDEATHSIG
    (engine/process/lifeline.py) follows the thread that started a child, and the caller's may end first (a
    worker builds its engine on a passing thread, cluster/worker/threads.py), which would SIGTERM every rank."""
    started = threading.Event()
    errors: list[BaseException] = []

    def keep() -> None:
        try:
            for setup in setups:
                proc = subprocess.Popen(argv, stdin=subprocess.PIPE, env=env)
                procs.append(proc)
                assert proc.stdin is not None
                write_frame(proc.stdin, setup)
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
            errors.append(exc)
        finally:
            started.set()
        keeper_done.wait()

    threading.Thread(target=keep, name="parallel-ranks", daemon=True).start()
    started.wait()
    if errors:
        raise errors[0]


class TPDriverRunner(ModelRunner):
    """Rank 0's runner: starts and feeds the other ranks, then runs its own shard (and stage) of every step."""

    def __init__(self, config: EngineConfig, rank_module: str = DEFAULT_RANK_MODULE,
                 rank_env: Mapping[str, str] | None = None) -> None:
        size = config.device.tensor_parallel_size * config.device.pipeline_parallel_size
        timeout_s = tp_timeout_s()
        port = free_port()
        doc = {"config": encode_config(config), "size": size, "host": "127.0.0.1", "port": port,
               "timeout_s": timeout_s}
        # The ranks die with this process, even by SIGKILL, so no orphan keeps its GPU memory (started on a
        # thread that lives as long as they should: `_start_children`).
        env = {**os.environ, **(rank_env or {}), **lifeline_env()}
        set_nccl_env_defaults(env)
        self._procs: list[subprocess.Popen] = []
        self._pipe_lock = threading.Lock()  # the engine thread's steps and a transport's `tell` share the pipes
        self._failure: str | None = None
        self._stopped = threading.Event()
        self._timeout_s = timeout_s
        self._step_started: float | None = None  # monotonic start of the step in flight (the watchdog's clock)
        self._writing: tuple[int, float] | None = None  # (rank, monotonic start) of a frame being written
        self._encoder = codec.StepEncoder()  # block tables as deltas; every rank's StepDecoder reads every frame
        self._steps = 0  # steps collected (each rank numbers its steps the same way in its hang reports)
        self._hang = HangWatch("rank 0", 0.0)  # replaced once the group exists
        keeper_done = threading.Event()
        self._finalizer = weakref.finalize(self, _stop_children, self._procs, keeper_done)
        group: ParallelWorld | None = None
        try:
            _start_children([sys.executable, "-m", rank_module], env,
                            [json.dumps({**doc, "rank": rank}).encode() for rank in range(1, size)], self._procs,
                            keeper_done)
            if not config.device.device.startswith("cuda"):
                torch.set_num_threads(cpu_threads_per_rank(size))
            group = ParallelWorld("127.0.0.1", port, 0, config, torch.device(config.device.device), timeout_s)
            self._world = group
            self._hang = HangWatch(group.where, hang_report_s())
            self._watchdog = threading.Thread(target=self._watch, args=(group,), name="tp-watchdog", daemon=True)
            self._watchdog.start()
            super().__init__(config, group.tp, group.link)
        except BaseException as exc:
            self._stopped.set()
            self._hang.close()
            if group is not None:
                group.close(failed=True)
            dead = [(rank, proc.poll()) for rank, proc in enumerate(self._procs, start=1) if proc.poll() is not None]
            self._finalizer()
            if dead and isinstance(exc, Exception):  # say which rank failed rather than "store timed out"
                raise TensorParallelError(f"tensor-parallel rank {dead[0][0]} exited with code {dead[0][1]} during "
                                          "start-up (see its log above)") from exc
            raise
        logger.info("parallel: %d ranks, tensor %d x pipeline %d (%s, %s), all-reduce: %s", size,
                    config.device.tensor_parallel_size, config.device.pipeline_parallel_size, group.backend,
                    config.device.device, self.all_reduce_kind)

    # -- the engine's calls ------------------------------------------------------------------------------------
    def determine_num_blocks(self) -> int:
        with self._hang.task("the memory profile and the KV block agreement", self._world.calls_since()):
            return self._guard(lambda: self._world.min_int(super(TPDriverRunner, self).determine_num_blocks()))

    def initialize_kv_cache(self, num_blocks: int, num_swap_blocks: int) -> None:
        self._send(MSG_INIT_KV + json.dumps([num_blocks, num_swap_blocks]).encode())
        with self._hang.task("the KV cache allocation and the warm-up", self._world.calls_since()):
            self._guard(lambda: super(TPDriverRunner, self).initialize_kv_cache(num_blocks, num_swap_blocks))

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(so)
        return self.collect(so)

    def submit(self, so: SchedulerOutput) -> None:
        """Hand the step to the other ranks (stage 0 starts on it at once); `collect` runs this rank's part."""
        self._send(MSG_STEP + self._encoder.encode(so))

    def collect(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """This rank's part of a submitted step, in submission order (engine/parallel/batch_queue.py)."""
        self._step_started = time.monotonic()
        try:
            with self._hang.task(lambda n=self._steps: describe_step(n, so), self._world.calls_since()):
                return self._guard(lambda: super(TPDriverRunner, self).execute_model(so))
        finally:
            self._step_started = None
            self._steps += 1

    def tell(self, body: bytes) -> None:
        """Any thread: a frame for every other rank's extension, in order with the steps sent so far. Raises
        TensorParallelError if a rank is gone."""
        self._send(MSG_EXTENSION + body)

    def check_ranks(self) -> None:
        """Raise if any rank is gone (the worker's health probe)."""
        self._raise_if_failed()
        for rank, proc in enumerate(self._procs, start=1):
            code = proc.poll()
            if code is not None:
                self._fail(f"tensor-parallel rank {rank} exited with code {code}")
        self._raise_if_failed()

    def shutdown(self) -> None:
        self._stopped.set()
        self._hang.close()
        self._finalizer()
        if self._failure is None:  # after a failure the GPU may never finish: do not wait for it
            self.release_graphs()
        self._world.close(failed=self._failure is not None)

    # -- internals ---------------------------------------------------------------------------------------------
    def _send(self, payload: bytes) -> None:
        self.check_ranks()
        with self._pipe_lock:
            for rank, proc in enumerate(self._procs, start=1):
                self._writing = (rank, time.monotonic())
                try:
                    assert proc.stdin is not None
                    with self._hang.task(lambda n=len(payload), r=rank: f"writing a {n}-byte frame to rank {r}"):
                        write_frame(proc.stdin, payload)
                except (OSError, ValueError) as exc:
                    self._fail(f"tensor-parallel rank {rank} is unreachable: {exc}")
                finally:
                    self._writing = None
        self._raise_if_failed()

    def _guard(self, fn: Any) -> Any:
        """Run `fn` (this rank's part of a call); a failure the watchdog found meanwhile (a rank died, a step
        overran) fails the call even if `fn` returned: a one-shot all-reduce whose peer died returns wrong sums
        once it gives up waiting (kernels/peer_all_reduce.py), after the watchdog has noticed."""
        self._raise_if_failed()
        try:
            result = fn()
        except TensorParallelError:
            raise
        except (RuntimeError, OSError) as exc:  # a collective failed: a peer died or timed out
            self.check_ranks()
            self._fail(f"a tensor-parallel collective failed: {exc}")
            self._raise_if_failed()
            raise
        self._raise_if_failed()
        return result

    def _fail(self, reason: str) -> None:
        if self._failure is None:
            self._failure = reason
            logger.error("%s; this engine stops serving", reason)

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise TensorParallelError(self._failure)

    def _watch(self, group: ParallelWorld) -> None:
        """Abort the communicators as soon as a child dies or a step overruns, so a rank blocked in a collective
        fails now."""
        while not self._stopped.wait(WATCH_INTERVAL_S):
            for rank, proc in enumerate(self._procs, start=1):
                code = proc.poll()
                if code is not None:
                    self._fail(f"tensor-parallel rank {rank} exited with code {code}")
                    group.close(failed=True)
                    return
            started = self._step_started
            if started is not None and time.monotonic() - started > self._timeout_s:
                self._fail(f"a tensor-parallel step ran past KVFLOW_TP_TIMEOUT_S={self._timeout_s:g} s (a rank is "
                           "stuck in a collective)")
                group.close(failed=True)
                return
            writing = self._writing
            if writing is not None and time.monotonic() - writing[1] > self._timeout_s:
                rank = writing[0]
                self._fail(f"writing a frame to tensor-parallel rank {rank} ran past KVFLOW_TP_TIMEOUT_S="
                           f"{self._timeout_s:g} s (the rank reads no more: it is stuck in a step)")
                group.close(failed=True)
                with contextlib.suppress(Exception):  # the write fails now (broken pipe) instead of waiting forever
                    self._procs[rank - 1].kill()
                return
