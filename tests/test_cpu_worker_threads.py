"""CPU workers and OpenMP: the model loads on a thread that ends with it (so the engine thread holds the process's
only OpenMP pool and libgomp keeps spinning between its parallel regions), and `kvflow serve` shortens that spin
when several CPU workers share the cores."""

from __future__ import annotations

import asyncio
import subprocess
import threading
from pathlib import Path

import pytest

from engine.config import EngineArgs
from kvflow import launcher
from kvflow.launcher import (
    SHARED_CORES_GOMP_SPINCOUNT,
    ClusterSpec,
    Placement,
    WorkerCluster,
    shared_cores_openmp_env,
)
from kvflow.worker.runtime import in_passing_thread


def test_in_passing_thread_returns_raises_and_its_thread_ends() -> None:
    seen: list[threading.Thread] = []

    def work(x: int) -> int:
        seen.append(threading.current_thread())
        return x * 2

    def fail() -> None:
        raise ValueError("bad model")

    async def main() -> None:
        assert await in_passing_thread(work, 21) == 42
        with pytest.raises(ValueError, match="bad model"):
            await in_passing_thread(fail)

    asyncio.run(main())
    assert seen[0] is not threading.main_thread()
    seen[0].join(5)
    assert not seen[0].is_alive()


def test_shared_cores_spin_count_respects_the_callers_openmp_settings() -> None:
    assert shared_cores_openmp_env({}) == {"GOMP_SPINCOUNT": SHARED_CORES_GOMP_SPINCOUNT}
    assert shared_cores_openmp_env({"GOMP_SPINCOUNT": "50000"}) == {}
    assert shared_cores_openmp_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {}


@pytest.mark.parametrize("cpu_workers,expected", [(2, SHARED_CORES_GOMP_SPINCOUNT), (1, None)])
def test_cpu_workers_sharing_the_cores_get_the_short_spin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          cpu_workers: int, expected: str | None) -> None:
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    envs: list[dict[str, str]] = []

    class FakePopen:
        def __init__(self, argv: list[str], **kwargs: object) -> None:
            envs.append(kwargs["env"])  # type: ignore[arg-type]

    monkeypatch.setattr(launcher, "tcmalloc_preload", lambda env: None)  # its library lookup runs a subprocess
    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    cluster = WorkerCluster(ClusterSpec(EngineArgs(model="smollm2", device="cpu"), cpu_workers - 1, 1,
                                        log_dir=tmp_path))
    cluster._cpu_workers = cpu_workers  # what start() counts from the placements
    cluster._popen(Placement("decode", None, None), 0, 1234, tmp_path / "decode.log", "wb")
    assert envs[0].get("GOMP_SPINCOUNT") == expected
