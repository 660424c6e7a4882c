"""A parallel rank (engine/parallel/worker.py), started as `rank_module`, that misbehaves for the hang reports' tests
(tests/engine/test_pipeline_hang_report.py): its step number KVFLOW_TEST_SLOW_STEP first sleeps KVFLOW_TEST_SLOW_S
seconds (a rank stuck in a step), and with KVFLOW_TEST_READ_BETWEEN_STEPS=1 it reads rank 0's frames on its main
thread between steps, as ranks did before the pipe hang was fixed."""

from __future__ import annotations

import itertools
import os
import time

from engine.parallel import worker
from engine.parallel.executor import MSG_QUIT, read_frame
from engine.runner.model_runner import ModelRunner


class ReaderBetweenSteps:
    pending = 0

    def __init__(self, stream: object) -> None:
        self.stream = stream

    def get(self) -> bytes | None:
        frame = read_frame(self.stream)  # type: ignore[arg-type]
        return None if frame is None or frame[:1] == MSG_QUIT else frame


def main() -> None:
    slow_step, seconds = int(os.environ.get("KVFLOW_TEST_SLOW_STEP", "-1")), float(
        os.environ.get("KVFLOW_TEST_SLOW_S", "0"))
    execute, steps = ModelRunner.execute_model, itertools.count()

    def execute_slowly(self: ModelRunner, so: object) -> object:
        if next(steps) == slow_step:
            time.sleep(seconds)
        return execute(self, so)  # type: ignore[arg-type]

    ModelRunner.execute_model = execute_slowly  # type: ignore[method-assign, assignment]
    if os.environ.get("KVFLOW_TEST_READ_BETWEEN_STEPS") == "1":
        worker.FrameReader = ReaderBetweenSteps  # type: ignore[misc, assignment]
    worker.main()


if __name__ == "__main__":
    main()
