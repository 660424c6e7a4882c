"""The tensor-parallel group's small-message all-reduce: one-shot over peer GPU memory (kernels/peer_all_reduce.py),
NCCL above `max_bytes` and wherever peer memory is not available.

Set-up is collective and all-or-nothing: every rank allocates its buffer and exports a CUDA IPC handle, then opens
every peer's, and says after each phase whether it could, through the group's store. If any rank could not (no
peer access, another host, an IPC failure), every rank keeps NCCL for all sizes, so the ranks never disagree on
which collective a call runs. The reason is logged and `describe()` tells it (the worker's Info, `all_reduce`).

Why not torch's symmetric memory: its ops resolve a c10d process group by name, and the engine keeps its groups
off torch's global registry (engine/parallel/group.py); the one attempt to register one failed on the lent
GPUs' torch (bench/results/tp_allreduce_h200.json).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from engine.parallel.cuda_ipc import CudaDriver
from kernels.peer_all_reduce import peer_all_reduce, signal_words

logger = logging.getLogger(__name__)

# One-shot reads every peer's whole message; each program streams its slice, so the program count sets the
# bandwidth, and each call reads (ranks - 1) x the message from peers, so the size where NCCL catches up falls with
# the rank count. In CUDA graphs, 128 programs (bench/results/tp_peer_allreduce_h200.json, tp_allreduce_tp4.json):
# - 2 x H200: 5.3 us at 8-64 KB, 14.7 / 24.8 us at 2 / 4 MB against NCCL's 38.9 / 44.6: one-shot up to 4 MB;
# - 4 x H200: 9-10 us at 8-64 KB against NCCL's 21-22, 33.6 vs 42.7 us at 2 MB, 58.8 vs 52.7 at 4 MB: up to 2 MB.
# A decode batch of 256 rows of Llama-8B is 2 MB. Beyond 4 ranks nothing is measured: 1 MB, a guess (opt-in only).
# 128 programs stay co-resident on any H100/H200 (132 SMs), which the per-program barrier needs: a program spins
# until the same program on each peer has arrived.
MAX_BYTES_BY_RANKS = {2: 4 * 1024 * 1024, 4: 2 * 1024 * 1024}
UNMEASURED_MAX_BYTES = 1024 * 1024
DEFAULT_PROGRAMS = 128
SIGNAL_BYTES = 64 * 1024  # the signal area, rounded up; the two buffer halves follow it
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def default_max_bytes(ranks: int) -> int:
    """The largest message one-shot beats NCCL on at `ranks` ranks, as measured (MAX_BYTES_BY_RANKS)."""
    return MAX_BYTES_BY_RANKS.get(ranks, UNMEASURED_MAX_BYTES)


class PeerAllReduce:
    """One rank's side once every rank has mapped every peer's buffer. Use `setup`, which decides collectively."""

    def __init__(self, driver: CudaDriver, base: int, peers: list[int], rank: int, device: torch.device,
                 max_bytes: int, programs: int, timeout_s: float) -> None:
        """`peers`: each rank's allocation base as mapped in this process (this rank's own `base` at `rank`)."""
        self.driver, self.base, self.rank, self.device = driver, base, rank, device
        self.world, self.max_bytes, self.programs = len(peers), max_bytes, programs
        # twice the group's timeout: rank 0's watchdog (engine/parallel/executor.py) fails the engine on a dead rank
        # or an overrun step first, so the wrong sums of a call that gave up are never used
        self.timeout_ns = int(2 * timeout_s * 1e9)
        self._opened = [addr for r, addr in enumerate(peers) if r != rank]
        self.signal_addrs = torch.tensor(peers, dtype=torch.int64, device=device)
        self.buffer_addrs = torch.tensor([addr + SIGNAL_BYTES for addr in peers], dtype=torch.int64, device=device)
        self._error_word = base + 4 * (signal_words(programs, self.world) - 1)

    @classmethod
    def setup(cls, store: Any, rank: int, size: int, device: torch.device, timeout_s: float,
              max_bytes: int | None = None, programs: int = DEFAULT_PROGRAMS
              ) -> tuple[PeerAllReduce | None, str]:
        """Collective over `store` (every rank of the group calls it with the same arguments): the rank's
        PeerAllReduce, or None and why not (the same outcome on every rank). `max_bytes`: the largest message sent
        one-shot, by default `default_max_bytes(size)`."""
        max_bytes = default_max_bytes(size) if max_bytes is None else max_bytes
        if 4 * signal_words(programs, size) > SIGNAL_BYTES:
            raise ValueError(f"{programs} programs x {size} ranks do not fit the {SIGNAL_BYTES}-byte signal area")
        driver: CudaDriver | None = None
        base = 0
        opened: list[int] = []
        try:
            try:
                driver = CudaDriver()
                with torch.cuda.device(device):
                    torch.zeros(1, device=device)  # the primary context exists and is current
                    base = driver.alloc(SIGNAL_BYTES + 2 * max_bytes)
                    driver.zero(base, SIGNAL_BYTES)
                    torch.cuda.synchronize(device)  # zeroed before any peer can raise a flag in it
                    mine: dict[str, Any] = {"ok": True, "uuid": _uuid(device), "handle": driver.export(base).hex()}
            except Exception as exc:  # any failure here means NCCL for every rank, not a crash
                mine = {"ok": False, "why": f"rank {rank}: {exc}"}
            ranks = _exchange(store, "peer-ar-export", rank, size, mine)
            why = _first_failure(ranks)
            if why:
                return None, why
            peers: list[int] = []
            try:
                with torch.cuda.device(device):
                    for r, doc in enumerate(ranks):
                        if r == rank:
                            peers.append(base)
                            continue
                        _check_peer_access(device, doc["uuid"], r)
                        opened.append(driver.open(bytes.fromhex(doc["handle"])))  # type: ignore[union-attr]
                        peers.append(opened[-1])
                mapped: dict[str, Any] = {"ok": True}
            except Exception as exc:
                mapped = {"ok": False, "why": f"rank {rank}: {exc}"}
            why = _first_failure(_exchange(store, "peer-ar-open", rank, size, mapped))
            if why:
                return None, why
            if driver is None:  # unreachable: this rank exported, so it has a driver
                raise RuntimeError("peer all-reduce set-up lost its CUDA driver")
            result = cls(driver, base, peers, rank, device, max_bytes, programs, timeout_s)
            base, opened = 0, []  # owned by `result` now
            return result, ""
        finally:
            _release(driver, base, opened)

    def fits(self, tensor: torch.Tensor) -> bool:
        """Whether this call goes one-shot (the same answer on every rank for the same call)."""
        nbytes = tensor.numel() * tensor.element_size()
        return tensor.dtype in DTYPES and tensor.is_contiguous() and 0 < nbytes <= self.max_bytes

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` in place across the ranks (callers check `fits` first)."""
        return peer_all_reduce(tensor, self.buffer_addrs, self.signal_addrs, self.rank, self.world,
                               self.max_bytes // tensor.element_size(), self.programs, self.timeout_ns)

    def failed(self) -> bool:
        """A call gave up waiting for a peer (its result was wrong; the peer is presumably gone). Synchronizes
        with the device: for checks after the fact (the benchmark), never on the engine's step path, where a
        device read per step cost the host its lead over the GPU (0.5 ms a token)."""
        with torch.cuda.device(self.device):
            return self.driver.read_int32(self._error_word) != 0

    def describe(self) -> str:
        return f"peer one-shot up to {self.max_bytes // 1024} KiB ({self.world} ranks), nccl above"

    def close(self) -> None:
        """Unmap the peers' buffers and free this rank's (after the graphs that used them are released)."""
        opened, self._opened = self._opened, []
        base, self.base = self.base, 0
        with torch.cuda.device(self.device):
            _release(self.driver, base, opened)


def _uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _check_peer_access(device: torch.device, peer_uuid: str, peer_rank: int) -> None:
    """The peer's GPU is visible here and this GPU can read its memory directly."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    for other in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(other).uuid) == peer_uuid:
            if other != index and not torch.cuda.can_device_access_peer(index, other):
                raise RuntimeError(f"no peer access from cuda:{index} to rank {peer_rank}'s GPU (cuda:{other})")
            return
    raise RuntimeError(f"rank {peer_rank}'s GPU ({peer_uuid}) is not visible here (another host?)")


def _exchange(store: Any, phase: str, rank: int, size: int, mine: dict[str, Any]) -> list[dict[str, Any]]:
    """Publish this rank's JSON document for `phase` and read every rank's (blocking, under the store's
    timeout)."""
    store.set(f"{phase}/{rank}", json.dumps(mine))
    return [json.loads(store.get(f"{phase}/{r}")) for r in range(size)]


def _first_failure(ranks: list[dict[str, Any]]) -> str:
    return next((doc["why"] for doc in ranks if not doc.get("ok")), "")


def _release(driver: CudaDriver | None, base: int, opened: list[int]) -> None:
    """Best effort: a failed unmap or free is logged, never raised (set-up failures and shutdown call it)."""
    if driver is None:
        return
    for addr in opened:
        try:
            driver.close(addr)
        except Exception as exc:
            logger.warning("unmapping a peer's all-reduce buffer failed: %s", exc)
    if base:
        try:
            driver.free(base)
        except Exception as exc:
            logger.warning("freeing the all-reduce buffer failed: %s", exc)
