"""Configurations run each in a fresh subprocess, so every engine starts on clean devices and a hang costs one
job, not the run: the scenario re-runs itself as `python -m <module> --one JSON`, the child prints one tagged
JSON line, the parent collects it.

Invariants: jobs of one call run side by side and are all waited for (or killed at the shared deadline); a job
that dies, hangs or prints no result yields {"error": ..., "stderr_tail": ...} in its place, never an exception."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULT_TAG = "BENCH_JOB_RESULT "
# NVLink multicast off in every process a GPU scenario starts (the lent machines' multicast is not usable).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def answer(result: dict[str, Any]) -> None:
    """In the child: hand `result` to the parent."""
    print(RESULT_TAG + json.dumps(result), flush=True)


def answer_job(raw: str, run: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """In the child: run the job its `--one` argument carried (JSON), hand the result to the parent. Its log keeps
    warnings only: it is the parent's stderr tail when the job fails."""
    logging.basicConfig(level=logging.WARNING)
    answer(run(json.loads(raw)))


def run_jobs(module: str, jobs: list[dict[str, Any]], timeout_s: float,
             env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Each job's result, in order. stderr goes to a file per job: a pipe nobody reads could block a rank whose
    peer is waiting for it in a collective."""
    deadline = time.monotonic() + timeout_s
    with tempfile.TemporaryDirectory(prefix="bench-jobs-") as tmp:
        logs = [Path(tmp) / f"job{i}.stderr" for i in range(len(jobs))]
        procs = []
        for job, log in zip(jobs, logs, strict=True):
            with log.open("w") as stderr:
                procs.append(subprocess.Popen([sys.executable, "-m", module, "--one", json.dumps(job)],
                                              stdout=subprocess.PIPE, stderr=stderr, text=True,
                                              env={**os.environ, **(env or {})}))
        return [_collect(proc, log, deadline, timeout_s) for proc, log in zip(procs, logs, strict=True)]


def _collect(proc: subprocess.Popen, log: Path, deadline: float, timeout_s: float) -> dict[str, Any]:
    try:
        stdout, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"error": f"timed out after {timeout_s:.0f} s", "stderr_tail": log.read_text()[-2000:]}
    line = next((ln for ln in stdout.splitlines() if ln.startswith(RESULT_TAG)), None)
    if line is None:
        return {"error": f"exit code {proc.returncode}", "stderr_tail": log.read_text()[-2000:]}
    return json.loads(line[len(RESULT_TAG):])
