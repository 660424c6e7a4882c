"""A tensor- or pipeline-parallel rank > 0: `python -m engine.parallel.worker`, started by rank 0 (engine/parallel/executor.py).

It reads its setup (config, rank, rendezvous) as the first frame on stdin, joins the group, builds its shard and
then runs every step rank 0 sends, until stdin ends or says quit. It never schedules, samples for anyone or answers
requests: rank 0 does. Any error ends the process (rank 0 notices and stops serving).

An upper floor may run `run` with a `RankExtension` (its own `python -m` module): rank 0's extension frames
(`TPDriverRunner.tell`) reach it in order with the steps, on this main thread.

Stdin is read on a thread of its own (`FrameReader`), always, so rank 0 never blocks writing a frame while this
rank runs a step. Rank 0 may write while this rank waits for it: with pipeline stages it submits the next
micro-batch before it runs its own part of the one in flight (engine/parallel/batch_queue.py), and the other TP
ranks of its stage sit in that batch's collectives until it does. A step larger than the pipe's capacity (64 KiB:
a micro-batch of a few long prompts) then left rank 0 in its write and this rank in the collective for good (the
TP2 x PP2 hang on GPUs; gloo timed out).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import sys
import threading
from collections.abc import Callable
from typing import IO, Protocol

import torch

from engine.parallel import codec
from engine.parallel.executor import (
    MSG_EXTENSION,
    MSG_INIT_KV,
    MSG_QUIT,
    MSG_STEP,
    cpu_threads_per_rank,
    decode_config,
    rank_device,
    read_frame,
)
from engine.parallel.group import TPGroup
from engine.parallel.hang_report import HangWatch, hang_report_s
from engine.parallel.pipeline import ParallelWorld, describe_step
from engine.process.gc_heap import freeze_startup_heap
from engine.process.lifeline import die_with_parent_if_asked
from engine.runner.model_runner import ModelRunner

logger = logging.getLogger("kvflow.tp_worker")


class RankExtension(Protocol):
    def handle(self, body: bytes) -> None:
        """One frame from rank 0, on the main thread between steps."""
        ...

    def close(self) -> None:
        ...


# Built once the rank's runner exists (its KV cache is allocated later, by the first MSG_INIT_KV).
ExtensionFactory = Callable[[ModelRunner, TPGroup], RankExtension]


class FrameReader:
    """Rank 0's frames, read off `stream` by a daemon thread as soon as they arrive and handed out in order; None
    once the stream ends (or fails: the error is logged) or after a quit frame."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._frames: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._read, args=(stream,), name="rank-stdin", daemon=True)
        self._thread.start()

    def _read(self, stream: IO[bytes]) -> None:
        frame: bytes | None = None
        try:
            while True:
                frame = read_frame(stream)
                if frame is None or frame[:1] == MSG_QUIT:
                    break
                self._frames.put(frame)
        except (OSError, ValueError):
            logger.exception("reading rank 0's frames failed")
        finally:
            self._frames.put(None)

    def get(self) -> bytes | None:
        return self._frames.get()

    @property
    def pending(self) -> int:
        """Frames read but not yet taken (diagnostics)."""
        return self._frames.qsize()


def run(stdin: object, extension_factory: ExtensionFactory | None = None) -> int:
    setup = read_frame(stdin)  # type: ignore[arg-type]
    if setup is None:
        return 1
    doc = json.loads(setup)
    rank, size = int(doc["rank"]), int(doc["size"])
    config = decode_config(doc["config"])
    device = rank_device(config.device.device, rank)
    config = dataclasses.replace(config, device=dataclasses.replace(config.device, device=device))
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    else:
        torch.set_num_threads(cpu_threads_per_rank(size))
    world = ParallelWorld(doc["host"], int(doc["port"]), rank, config, torch.device(device), float(doc["timeout_s"]))
    failed = True
    runner: ModelRunner | None = None
    extension: RankExtension | None = None
    frames: FrameReader | None = None
    watch = HangWatch(world.where, hang_report_s(),
                      lambda: f"{frames.pending if frames is not None else 0} frames from rank 0 wait behind it")
    try:
        runner = ModelRunner(config, world.tp, world.link, leader=False)  # rank 0 samples for the engine
        extension = extension_factory(runner, world.group) if extension_factory is not None else None
        with watch.task("the memory profile and the KV block agreement", world.calls_since()):
            world.min_int(runner.determine_num_blocks())
        frames = FrameReader(stdin)  # type: ignore[arg-type]
        steps_in = codec.StepDecoder()  # rank 0's StepEncoder: every step frame, in order
        steps = 0
        while True:
            frame = frames.get()
            if frame is None:
                break
            kind, body = frame[:1], frame[1:]
            if kind == MSG_INIT_KV:
                num_blocks, num_swap = json.loads(body)
                with watch.task("the KV cache allocation and the warm-up", world.calls_since()):
                    runner.initialize_kv_cache(int(num_blocks), int(num_swap))
                freeze_startup_heap(f"rank {rank}")  # this process is the rank alone
            elif kind == MSG_STEP:
                so = steps_in.decode(body)
                with watch.task(lambda n=steps, so=so: describe_step(n, so), world.calls_since()):
                    runner.execute_model(so)
                steps += 1
            elif kind == MSG_EXTENSION and extension is not None:
                with watch.task("an extension frame", world.calls_since()):
                    extension.handle(body)
            else:
                raise ValueError(f"unknown message {kind!r} from rank 0")
        failed = False
    finally:
        watch.close()
        if extension is not None:
            extension.close()
        if runner is not None and not failed:
            runner.release_graphs()
        world.close(failed=failed)
    return 0


def main(extension_factory: ExtensionFactory | None = None) -> None:
    die_with_parent_if_asked()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s tp-rank %(name)s: %(message)s")
    try:
        code = run(sys.stdin.buffer, extension_factory)
    except Exception:
        logger.exception("tensor-parallel rank failed")
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
