"""`kvflow serve`'s start and end on CPU: the engine config checked and each worker's memory printed before any
worker starts, the KV size handed to the workers, a worker that dies at startup named with its log (no traceback),
and the temporary log directory removed at a clean exit (kept when a worker died or --log-dir was given)."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.arg_utils import EngineArgs
from kvflow.launcher import (
    ClusterSpec,
    Placement,
    WorkerCluster,
    WorkerExited,
    WorkerProcess,
    free_port,
    preflight,
)
from tests.helpers.serve import wait_healthy

TINY = EngineArgs(model="tiny", load_format="dummy", device="cpu", max_model_len=256)


def test_preflight_sizes_cpu_workers_kv_unless_it_is_set() -> None:
    spec = preflight(ClusterSpec(TINY, prefill_workers=1, decode_workers=1))
    assert spec.engine_args.kv_cache_memory_bytes is not None and spec.engine_args.kv_cache_memory_bytes > 0
    fixed = ClusterSpec(EngineArgs(model="tiny", load_format="dummy", device="cpu", kv_cache_memory_bytes=1 << 24))
    assert preflight(fixed).engine_args.kv_cache_memory_bytes == 1 << 24
    with pytest.raises(ValueError, match="max_position_embeddings"):
        preflight(ClusterSpec(EngineArgs(model="tiny", load_format="dummy", device="cpu", max_model_len=10 ** 7)))


def _dead_worker(tmp_path: Path, code: int) -> WorkerProcess:
    log = tmp_path / "decode-0.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-c", f"print('model did not load'); raise SystemExit({code})"],
                                   stdout=out, stderr=subprocess.STDOUT)
    process.wait()
    return WorkerProcess("decode", "127.0.0.1:1", process, log, Placement("decode", None, None))


def test_a_worker_dying_at_startup_is_named_with_its_log(tmp_path: Path) -> None:
    cluster = WorkerCluster(ClusterSpec(TINY, log_dir=tmp_path))
    cluster.workers.append(_dead_worker(tmp_path, 3))
    with pytest.raises(WorkerExited) as caught:
        cluster.wait_ready(5, progress=False)
    message = str(caught.value)
    assert "exited with code 3" in message and str(tmp_path / "decode-0.log") in message
    assert "model did not load" in message


def test_the_temporary_log_dir_is_removed_unless_a_worker_died_or_it_was_given(tmp_path: Path) -> None:
    cluster = WorkerCluster(ClusterSpec(TINY))
    assert cluster.owns_log_dir and cluster.log_dir.is_dir()
    assert cluster.remove_logs() and not cluster.log_dir.exists()
    died = WorkerCluster(ClusterSpec(TINY))
    died.workers.append(_dead_worker(died.log_dir, 1))
    assert not died.remove_logs() and (died.log_dir / "decode-0.log").is_file()
    given = WorkerCluster(ClusterSpec(TINY, log_dir=tmp_path))
    assert not given.remove_logs() and tmp_path.is_dir()
    shutil.rmtree(died.log_dir)


def test_serve_prints_each_workers_memory_and_cleans_up_its_logs(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "kvflow.cli", "serve", "--model", "tiny", "--load-format",
                                    "dummy", "--device", "cpu", "--max-model-len", "256", "--port", str(port),
                                    "--grpc-port", "0"], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(process, f"http://127.0.0.1:{port}", log, timeout_s=240)
        # serve's own process freezes its start-up heap once the router has its tokenizer (engine/process/gc_heap.py)
        deadline = time.monotonic() + 60
        while not re.search(r"router: \d+ start-up objects frozen", log.read_text()) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert re.search(r"router: \d+ start-up objects frozen", text), text[-3000:]
    assert re.search(r"memory budget of each CPU worker process: [\d.]+ GiB \(weights .* KV cache .* tokens "
                     r"\+ runtime", text), text[-3000:]
    assert "memory budget of the 2 CPU worker process(es)" in text
    logs = Path(re.search(r"worker logs in (\S+)", text).group(1))  # type: ignore[union-attr]
    assert not logs.exists(), f"{logs} was left behind"
