"""A parallel rank (engine/parallel/worker.py) whose step number KVFLOW_TEST_SLOW_STEP first sleeps
KVFLOW_TEST_SLOW_S seconds: a stand-in for a rank stuck in a step (the hang reports' test,
tests/engine/test_pipeline_hang_report.py). Started as `rank_module`."""

from __future__ import annotations

import itertools
import os
import time

from engine.parallel import worker
from engine.runner.model_runner import ModelRunner


def main() -> None:
    slow_step, seconds = int(os.environ["KVFLOW_TEST_SLOW_STEP"]), float(os.environ["KVFLOW_TEST_SLOW_S"])
    execute, steps = ModelRunner.execute_model, itertools.count()

    def execute_slowly(self: ModelRunner, so: object) -> object:
        if next(steps) == slow_step:
            time.sleep(seconds)
        return execute(self, so)  # type: ignore[arg-type]

    ModelRunner.execute_model = execute_slowly  # type: ignore[method-assign, assignment]
    worker.main()


if __name__ == "__main__":
    main()
