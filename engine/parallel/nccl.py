"""NCCL called directly (ctypes), for the tensor-parallel collectives on GPUs.

Why not torch's ProcessGroupNCCL: every c10d collective runs on the process group's own stream, joined to the
caller's by events, and returns a Work object that a watchdog thread polls; in decode steps replayed from CUDA
graphs that bookkeeping cost 45-55 µs per eager call and the captured graphs hung on replay (bench/results/
tp_check_h200.json). A bare `ncclAllReduce` on the caller's current stream is what vLLM (pynccl) and SGLang do: it
is captured into a graph like any kernel and costs only the NCCL kernel.

The library is the one torch itself loaded (read from /proc/self/maps), so the process never holds two NCCL
versions; KVFLOW_NCCL_SO_PATH overrides it.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import torch

NCCL_UNIQUE_ID_BYTES = 128
# ncclDataType_t and ncclRedOp_t values from nccl.h (stable since NCCL 2.x).
_DTYPES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6, torch.float32: 7,
           torch.float64: 8, torch.bfloat16: 9}
NCCL_SUM = 0
CLOSE_WAIT_S = 10.0


class NcclError(RuntimeError):
    """An NCCL call failed (a peer died, the communicator was aborted, or a bad argument)."""


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * NCCL_UNIQUE_ID_BYTES)]


def nccl_library_path() -> str:
    """KVFLOW_NCCL_SO_PATH, else the libnccl this process already mapped (torch's), else the loader's choice."""
    override = os.environ.get("KVFLOW_NCCL_SO_PATH")
    if override:
        return override
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            if "libnccl" in Path(path).name:
                return path
    except OSError:
        pass
    return "libnccl.so.2"


class NcclLibrary:
    """The few NCCL entry points the tensor-parallel model needs, with argument types declared."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path or nccl_library_path()
        lib = ctypes.CDLL(self.path)
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetErrorString.argtypes = [ctypes.c_int]
        lib.ncclGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(_UniqueId)]
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, _UniqueId, ctypes.c_int]
        lib.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_void_p, ctypes.c_void_p]
        lib.ncclAllGather.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                      ctypes.c_void_p, ctypes.c_void_p]
        # ncclSend(sendbuff, count, datatype, peer, comm, stream) and ncclRecv(recvbuff, ...): pipeline stages
        lib.ncclSend.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                 ctypes.c_void_p]
        lib.ncclRecv.argtypes = lib.ncclSend.argtypes
        lib.ncclCommAbort.argtypes = [ctypes.c_void_p]
        lib.ncclCommDestroy.argtypes = [ctypes.c_void_p]
        for name in ("ncclGetVersion", "ncclGetUniqueId", "ncclCommInitRank", "ncclAllReduce", "ncclAllGather",
                     "ncclSend", "ncclRecv", "ncclCommAbort", "ncclCommDestroy"):
            getattr(lib, name).restype = ctypes.c_int
        self.lib = lib

    def check(self, result: int, what: str) -> None:
        if result != 0:
            raise NcclError(f"{what} failed: {self.lib.ncclGetErrorString(result).decode()} (ncclResult {result})")

    def version(self) -> str:
        raw = ctypes.c_int()
        self.check(self.lib.ncclGetVersion(ctypes.byref(raw)), "ncclGetVersion")
        code = raw.value  # e.g. 22703 = 2.27.3
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"

    def unique_id(self) -> bytes:
        uid = _UniqueId()
        self.check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(uid.internal)


class NcclCommunicator:
    """One rank of an NCCL communicator on `device`; collectives run on the caller's current CUDA stream (so they
    are captured into CUDA graphs in place). `unique_id` comes from rank 0's `NcclLibrary.unique_id()`."""

    def __init__(self, library: NcclLibrary, unique_id: bytes, rank: int, size: int, device: torch.device) -> None:
        if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id has {NCCL_UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        self.library, self.rank, self.size, self.device = library, rank, size, device
        uid = _UniqueId()
        ctypes.memmove(uid.internal, unique_id, NCCL_UNIQUE_ID_BYTES)
        comm = ctypes.c_void_p()
        with torch.cuda.device(device):
            library.check(library.lib.ncclCommInitRank(ctypes.byref(comm), size, uid, rank), "ncclCommInitRank")
        self.comm: ctypes.c_void_p | None = comm

    def _handle(self) -> ctypes.c_void_p:
        if self.comm is None:
            raise NcclError("the NCCL communicator was closed")
        return self.comm

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` (contiguous, on this rank's GPU) in place across ranks."""
        dtype = _nccl_dtype(tensor)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self.library.check(self.library.lib.ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                                                          dtype, NCCL_SUM, self._handle(), stream), "ncclAllReduce")
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """[size, *tensor.shape]: every rank's `tensor`, in rank order."""
        dtype = _nccl_dtype(tensor)
        out = torch.empty((self.size, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self.library.check(self.library.lib.ncclAllGather(tensor.data_ptr(), out.data_ptr(), tensor.numel(), dtype,
                                                          self._handle(), stream), "ncclAllGather")
        return out

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        """`tensor` (contiguous, on this rank's GPU) to rank `peer`, on the current stream."""
        dtype = _nccl_dtype(tensor)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self.library.check(self.library.lib.ncclSend(tensor.data_ptr(), tensor.numel(), dtype, peer,
                                                     self._handle(), stream), "ncclSend")

    def recv(self, tensor: torch.Tensor, peer: int) -> torch.Tensor:
        """Fill `tensor` (contiguous, on this rank's GPU) from rank `peer`, on the current stream."""
        dtype = _nccl_dtype(tensor)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self.library.check(self.library.lib.ncclRecv(tensor.data_ptr(), tensor.numel(), dtype, peer,
                                                     self._handle(), stream), "ncclRecv")
        return tensor

    def close(self, abort: bool, wait_s: float = CLOSE_WAIT_S) -> bool:
        """Abort (pending kernels stop; peers may be gone) or destroy (every rank finished); safe to call twice.
        The call runs on a daemon thread and is waited for `wait_s` at most: a communicator that a live CUDA graph
        still references (or whose peer is wedged) can block in NCCL forever, and closing must never hang the
        process's exit. False: it did not finish in time (the process exiting releases it)."""
        comm, self.comm = self.comm, None
        if comm is None:
            return True
        call = self.library.lib.ncclCommAbort if abort else self.library.lib.ncclCommDestroy
        worker = threading.Thread(target=call, args=(comm,), name="nccl-close", daemon=True)
        worker.start()
        worker.join(wait_s)
        return not worker.is_alive()


def _nccl_dtype(tensor: torch.Tensor) -> int:
    if not tensor.is_contiguous():
        raise ValueError("NCCL collectives need a contiguous tensor")
    try:
        return _DTYPES[tensor.dtype]
    except KeyError:
        raise ValueError(f"NCCL collectives here do not take {tensor.dtype}") from None
