"""CPU workers and OpenMP: the model loads, and the decode worker's gRPC KV writes run, on threads that end with
them (so the engine thread holds the process's only long-lived OpenMP pool and libgomp keeps spinning between its
parallel regions), and CPU workers get libgomp's short spin (engine/process/openmp.py) unless the caller chose."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest
import torch

from cluster.transfer.backends import BACKEND_ENUMS
from cluster.transfer.contract import PullJob, PullResult, tensor_bytes
from cluster.transfer.grpc.recv import GrpcReceiver
from cluster.wire import layout_to_proto
from cluster.worker.channels import ChannelPool
from cluster.worker.threads import in_passing_thread
from engine.arg_utils import EngineArgs
from engine.kv_layout import KVSlice
from engine.kv_port import KVPort
from engine.process.openmp import SHARED_CORES_GOMP_SPINCOUNT, apply_openmp_policy, openmp_env
from engine.sampling_params import SamplingParams
from kvflow import launcher
from kvflow.launcher import ClusterSpec, Placement, WorkerCluster
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc


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


def test_the_short_spin_respects_the_callers_openmp_settings() -> None:
    assert openmp_env({}) == {"GOMP_SPINCOUNT": SHARED_CORES_GOMP_SPINCOUNT}
    assert openmp_env({"GOMP_SPINCOUNT": "50000"}) == {}
    assert openmp_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {}
    # This process loaded libgomp with torch: too late to set a policy, so it keeps what it started with.
    assert apply_openmp_policy({}) is False
    assert apply_openmp_policy({"GOMP_SPINCOUNT": "1000"}) is True


@pytest.mark.parametrize("caller_env,expected", [({}, SHARED_CORES_GOMP_SPINCOUNT), ({"GOMP_SPINCOUNT": "7"}, "7")])
def test_cpu_workers_get_the_short_spin_unless_the_caller_chose(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                caller_env: dict[str, str], expected: str) -> None:
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    for name, value in caller_env.items():
        monkeypatch.setenv(name, value)
    envs: list[dict[str, str]] = []

    class FakePopen:
        def __init__(self, argv: list[str], **kwargs: object) -> None:
            envs.append(kwargs["env"])  # type: ignore[arg-type]

    monkeypatch.setattr(launcher, "tcmalloc_preload", lambda env: None)  # its library lookup runs a subprocess
    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    cluster = WorkerCluster(ClusterSpec(EngineArgs(model="smollm2", device="cpu"), 0, 1, log_dir=tmp_path))
    cluster._popen(Placement("decode", None, None), 0, 1234, tmp_path / "decode.log", "wb")
    assert envs[0].get("GOMP_SPINCOUNT") == expected


@pytest.mark.parametrize("entry", [
    "import kvflow; kvflow.SamplingParams",  # the package's lazy names: LLM's way in
    "from kvflow.cli import main\ntry:\n    main(['no-such-command'])\nexcept SystemExit:\n    pass",
])
def test_entry_points_set_the_spin_before_torch_loads_libgomp(entry: str) -> None:
    probe = f"import os, sys\n{entry}\nprint(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.split()[:2] == [SHARED_CORES_GOMP_SPINCOUNT, "True"], done.stdout + done.stderr


# ---- the decode worker's gRPC KV writes ----------------------------------------------------------------------
def _kv_port(num_blocks: int, fill: float | None = None) -> KVPort:
    shape = (num_blocks, 4, 2, 8)  # blocks, block size, KV heads, head dim
    caches = [(torch.randn(shape), torch.randn(shape)) if fill is None else
              (torch.full(shape, fill), torch.full(shape, fill)) for _ in range(2)]
    return KVPort(caches, "float32")


class _FakePrefill(kvflow_pb2_grpc.PrefillServicer):
    """Streams a header, one KV chunk per block (the source port's blocks 0..n-1) and PrefillDone."""

    def __init__(self, source: KVPort, num_blocks: int) -> None:
        self.source = source
        self.num_blocks = num_blocks

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[pb.PrefillResponse]:
        layout = self.source.layout
        yield pb.PrefillResponse(header=pb.KVHeader(layout=layout_to_proto(layout), num_blocks=self.num_blocks,
                                                    first_block=0, backend=BACKEND_ENUMS["grpc"]))
        for block in range(self.num_blocks):
            part = KVSlice(block, 1, 0, layout.num_layers)
            data = tensor_bytes(self.source.export([block], part).tensor)
            yield pb.PrefillResponse(kv=pb.KVChunk(first_block=block, num_blocks=1, first_layer=0,
                                                   num_layers=layout.num_layers, data=data))
        yield pb.PrefillResponse(done=pb.PrefillDone(first_token_id=7))


async def _pull_from_fake(dest: KVPort, source: KVPort, num_blocks: int, block_ids: list[int],
                          run: Callable[[Callable[[], Awaitable[PullResult]]], Awaitable[PullResult]]) -> PullResult:
    server = grpc.aio.server()
    kvflow_pb2_grpc.add_PrefillServicer_to_server(_FakePrefill(source, num_blocks), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channels = ChannelPool()
    transport = GrpcReceiver(dest, "decode-test", channels)
    job = PullJob("r1", list(range(num_blocks * 4)), SamplingParams(max_tokens=1), block_ids, 0, ())
    try:
        return await run(lambda: transport.pull(f"127.0.0.1:{port}", job))
    finally:
        await transport.close()
        await channels.close()
        await server.stop(None)


def test_grpc_kv_writes_land_and_run_on_threads_that_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each write runs on a thread that ends with it: a long-lived writer thread would keep an OpenMP pool beside
    the engine thread's (bench/CPU_PROFILE.md)."""
    source, dest = _kv_port(3), _kv_port(8, fill=0.0)
    writers: list[threading.Thread] = []
    import_ = dest.import_

    def recording_import(*args: object) -> object:
        writers.append(threading.current_thread())
        return import_(*args)

    monkeypatch.setattr(dest, "import_", recording_import)
    block_ids = [5, 2, 6]
    result = asyncio.run(_pull_from_fake(dest, source, 3, block_ids, lambda pull: pull()))
    assert result.first_token_id == 7 and result.num_blocks_received == 3
    for (src_k, src_v), (dst_k, dst_v) in zip(source._caches, dest._caches, strict=True):
        assert torch.equal(dst_k[block_ids], src_k[:3]) and torch.equal(dst_v[block_ids], src_v[:3])
    assert len(writers) == 3 and len(set(writers)) == 3
    for thread in writers:
        assert thread is not threading.main_thread()
        thread.join(5)
        assert not thread.is_alive()


def test_cancelled_grpc_pull_ends_only_after_its_running_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """When the pull ends, for any reason, no write into its blocks is still running."""
    source, dest = _kv_port(2), _kv_port(4, fill=0.0)
    started, release, finished = threading.Event(), threading.Event(), threading.Event()
    import_ = dest.import_

    def slow_import(*args: object) -> object:
        started.set()
        release.wait(10)
        out = import_(*args)
        finished.set()
        return out

    monkeypatch.setattr(dest, "import_", slow_import)

    async def cancel_mid_write(pull: Callable[[], Awaitable[PullResult]]) -> PullResult:
        task = asyncio.ensure_future(pull())
        while not started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.sleep(0.2)
        assert not task.done()  # the write still runs: the pull waits for it
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished.is_set()
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(_pull_from_fake(dest, source, 2, [1, 3], cancel_mid_write))
