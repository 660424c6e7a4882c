"""The few CUDA driver calls that share device memory between processes (ctypes over libcuda, which every machine
with an NVIDIA driver has): allocate outside torch's caching allocator (so the IPC handle names the allocation's
base), export a handle, open a peer's handle (peer access enabled lazily), close and free.

Handles are 64 opaque bytes: they travel between ranks as bytes through the group's store, never pickled.
"""

from __future__ import annotations

import ctypes

IPC_HANDLE_BYTES = 64
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed."""


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_byte * IPC_HANDLE_BYTES)]


class CudaDriver:
    """libcuda's allocation and IPC entry points, with argument types declared. Calls act on the calling thread's
    current context: torch's primary context of the device, once torch has touched it (`torch.cuda.device`)."""

    def __init__(self, path: str = "libcuda.so.1") -> None:
        lib = ctypes.CDLL(path)
        self.lib = lib
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
        lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]
        lib.cuMemsetD32_v2.argtypes = [ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t]
        lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcMemHandle), ctypes.c_uint64]
        self._open = getattr(lib, "cuIpcOpenMemHandle_v2", None) or lib.cuIpcOpenMemHandle
        self._open.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcMemHandle, ctypes.c_uint]
        lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
        lib.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
        for fn in (lib.cuGetErrorString, lib.cuMemAlloc_v2, lib.cuMemFree_v2, lib.cuMemsetD32_v2, lib.cuMemcpyDtoH_v2,
                   lib.cuIpcGetMemHandle, self._open, lib.cuIpcCloseMemHandle):
            fn.restype = ctypes.c_int

    def check(self, result: int, what: str) -> None:
        if result != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(result, ctypes.byref(text))
            raise CudaDriverError(f"{what} failed: {(text.value or b'?').decode()} (CUresult {result})")

    def alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        self.check(self.lib.cuMemAlloc_v2(ctypes.byref(ptr), nbytes), "cuMemAlloc")
        return ptr.value

    def free(self, ptr: int) -> None:
        self.check(self.lib.cuMemFree_v2(ptr), "cuMemFree")

    def zero(self, ptr: int, nbytes: int) -> None:
        """Synchronous (the legacy stream): done before anything else touches the memory."""
        self.check(self.lib.cuMemsetD32_v2(ptr, 0, nbytes // 4), "cuMemsetD32")

    def read_int32(self, ptr: int) -> int:
        """One int32 of device memory (synchronous)."""
        value = ctypes.c_int32()
        self.check(self.lib.cuMemcpyDtoH_v2(ctypes.byref(value), ptr, 4), "cuMemcpyDtoH")
        return value.value

    def export(self, ptr: int) -> bytes:
        handle = _IpcMemHandle()
        self.check(self.lib.cuIpcGetMemHandle(ctypes.byref(handle), ptr), "cuIpcGetMemHandle")
        return bytes(handle.reserved)

    def open(self, handle: bytes) -> int:
        """A peer's exported allocation, mapped into this process (its address here)."""
        if len(handle) != IPC_HANDLE_BYTES:
            raise ValueError(f"a CUDA IPC handle has {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
        raw = _IpcMemHandle()
        ctypes.memmove(raw.reserved, handle, IPC_HANDLE_BYTES)
        ptr = ctypes.c_uint64()
        self.check(self._open(ctypes.byref(ptr), raw, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
        return ptr.value

    def close(self, ptr: int) -> None:
        self.check(self.lib.cuIpcCloseMemHandle(ptr), "cuIpcCloseMemHandle")
