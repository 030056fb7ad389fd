"""The CUDA runtime through ctypes: device attributes, host registration, mapped pinned memory.

torch.cuda.cudart() exposes cudaHostRegister/Unregister but neither cudaDeviceGetAttribute nor
cudaHostGetDevicePointer, so this binds the very libcudart that torch loaded (found in /proc/self/maps once
torch has initialised CUDA), which shares torch's primary context. Importing this module loads nothing.
Attribute numbers and flags: docs/platform-facts.md §2.1 and cuda_runtime_api.h.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

SUCCESS = 0
ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712

# cudaDeviceAttr
ATTR_INTEGRATED = 18
ATTR_CAN_MAP_HOST_MEMORY = 19
ATTR_PAGEABLE_MEMORY_ACCESS = 88
ATTR_CONCURRENT_MANAGED_ACCESS = 89
ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91
ATTR_HOST_REGISTER_SUPPORTED = 99
ATTR_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES = 100
ATTR_READ_ONLY_HOST_REGISTER_SUPPORTED = 113

# cudaHostRegister flags
REGISTER_PORTABLE = 0x01
REGISTER_MAPPED = 0x02
REGISTER_READ_ONLY = 0x08
# cudaHostAlloc flags
ALLOC_PORTABLE = 0x01
ALLOC_MAPPED = 0x02


class CudaRuntimeUnavailable(RuntimeError):
    """No libcudart could be bound: the message says where we looked."""


def library_candidates(maps: str | None = None) -> Iterator[str]:
    """Where libcudart may be, best first: the copy this process already mapped (torch's), then torch's wheel
    dependencies (nvidia/cu13/lib, nvidia/cuda_runtime/lib), then a system CUDA (JetPack: /usr/local/cuda)."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            maps = ""
    seen: set[str] = set()
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
        path = fields[5] if len(fields) == 6 else ""
        if "libcudart" in os.path.basename(path) and path not in seen:
            seen.add(path)
            yield path
    patterns = []
    for entry in sys.path:
        patterns += [f"{entry}/nvidia/cu*/lib/libcudart.so*", f"{entry}/nvidia/cuda_runtime/lib/libcudart.so*",
                     f"{entry}/torch/lib/libcudart*.so*"]  # fmt: skip
    patterns += ["/usr/local/cuda/lib64/libcudart.so*", "/usr/lib/aarch64-linux-gnu/libcudart.so*"]
    for pattern in patterns:
        for path in sorted(glob.glob(pattern), reverse=True):  # libcudart.so.13 before libcudart.so
            if path not in seen:
                seen.add(path)
                yield path


class CudaRuntime:
    """The few runtime calls the integrated-GPU tiers need. Every call returns the cudaError_t (0 = success) and
    clears the error it left: torch reads cudaGetLastError after its own launches and would raise ours."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.lib = lib
        self.path = path
        vp, i32, size = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        signatures = {
            "cudaDeviceGetAttribute": (ctypes.POINTER(i32), i32, i32),
            "cudaHostRegister": (vp, size, ctypes.c_uint),
            "cudaHostUnregister": (vp,),
            "cudaHostGetDevicePointer": (ctypes.POINTER(vp), vp, ctypes.c_uint),
            "cudaHostAlloc": (ctypes.POINTER(vp), size, ctypes.c_uint),
            "cudaFreeHost": (vp,),
            "cudaSetDevice": (i32,),
            "cudaGetLastError": (),
        }
        for name, args in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = i32
        lib.cudaGetErrorString.argtypes = (i32,)
        lib.cudaGetErrorString.restype = ctypes.c_char_p

    def _done(self, err: int) -> int:
        if err != SUCCESS:
            self.lib.cudaGetLastError()  # runtime errors are not sticky: reading one clears it
        return int(err)

    def error_string(self, err: int) -> str:
        text = self.lib.cudaGetErrorString(err)
        return f"{text.decode() if text else 'unknown error'} ({err})"

    def set_device(self, index: int) -> int:
        return self._done(self.lib.cudaSetDevice(index))

    def attribute(self, attr: int, device: int = 0) -> int | None:
        value = ctypes.c_int(0)
        err = self._done(self.lib.cudaDeviceGetAttribute(ctypes.byref(value), attr, device))
        return None if err else int(value.value)

    def host_register(self, address: int, nbytes: int, flags: int) -> int:
        return self._done(self.lib.cudaHostRegister(address, nbytes, flags))

    def host_unregister(self, address: int) -> int:
        return self._done(self.lib.cudaHostUnregister(address))

    def device_pointer(self, address: int) -> tuple[int, int]:
        """(error, the device address of registered or cudaHostAlloc'd host memory)."""
        out = ctypes.c_void_p(0)
        err = self._done(self.lib.cudaHostGetDevicePointer(ctypes.byref(out), address, 0))
        return err, int(out.value or 0)

    def host_alloc(self, nbytes: int, flags: int) -> tuple[int, int]:
        out = ctypes.c_void_p(0)
        err = self._done(self.lib.cudaHostAlloc(ctypes.byref(out), nbytes, flags))
        return err, int(out.value or 0)

    def free_host(self, address: int) -> int:
        return self._done(self.lib.cudaFreeHost(address))


_lock = threading.Lock()
_runtime: CudaRuntime | None = None


def runtime() -> CudaRuntime:
    """The bound runtime (one per process). Call after torch has initialised CUDA, so that the library torch
    loaded is the one found; CudaRuntimeUnavailable with the paths tried otherwise."""
    global _runtime
    with _lock:
        if _runtime is not None:
            return _runtime
        tried = []
        for path in library_candidates():
            try:
                lib = ctypes.CDLL(path)
                _runtime = CudaRuntime(lib, path)
                return _runtime
            except (OSError, AttributeError) as e:
                tried.append(f"{path} ({e})")
        where = "; ".join(tried) or "nothing in /proc/self/maps, the nvidia/* wheels or /usr/local/cuda"
        raise CudaRuntimeUnavailable(f"no usable libcudart: tried {where}")
