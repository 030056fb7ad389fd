"""The CUDA runtime calls the integrated-GPU tiers need: device attributes, host registration, mapped pinned memory.

torch.cuda.cudart() exposes cudaHostRegister/Unregister but neither cudaDeviceGetAttribute nor
cudaHostGetDevicePointer. Two bindings give them, behind one interface (`runtime()` picks):
- NVIDIA's cuda-bindings (`cuda.bindings.runtime`, part of cuda-python; the `jetson-gpu` extra), preferred: it is
  NVIDIA's own, maintained binding with named enums instead of numbers typed in here, it ships x86-64 and aarch64
  wheels (cuda-bindings 12.x for JetPack 6's CUDA 12, 13.x for CUDA 13), and, being the runtime API, it works in
  the device's primary context, the one torch uses, so pointers and registrations are shared with torch. pycuda
  (the other candidate) makes its own context unless told to use the primary one (pycuda.autoprimaryctx), and PyPI
  has only its source: it compiles against the CUDA toolkit on each Jetson.
- ctypes on the very libcudart that torch loaded (found in /proc/self/maps once torch has initialised CUDA), the
  fallback when cuda-bindings is not installed; same primary context.
Importing this module loads nothing. Attribute numbers and flags: docs/platform-facts.md §2.1 (the CUDA Runtime
API's cudaDeviceAttr and cudaHostRegister flags); tools/device/binding_checks.py compares them with the binding's
named enums.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


class BindingRuntime:
    """The same calls through NVIDIA's cuda-bindings (`cuda.bindings.runtime`): every binding call returns a tuple
    whose first item is the cudaError_t; attributes are passed as its named cudaDeviceAttr members."""

    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self.path = f"cuda.bindings.runtime ({getattr(rt, '__file__', 'cuda-bindings')})"

    def _done(self, result: Any) -> tuple[int, Any]:
        err = int(result[0])
        if err != SUCCESS:
            self.rt.cudaGetLastError()  # as the ctypes path: leave no error for torch to read
        return err, result[1] if len(result) > 1 else None

    def error_string(self, err: int) -> str:
        _, text = self.rt.cudaGetErrorString(self.rt.cudaError_t(err))
        return f"{text.decode() if isinstance(text, bytes) else text or 'unknown error'} ({err})"

    def set_device(self, index: int) -> int:
        return self._done(self.rt.cudaSetDevice(index))[0]

    def attribute(self, attr: int, device: int = 0) -> int | None:
        err, value = self._done(self.rt.cudaDeviceGetAttribute(self.rt.cudaDeviceAttr(attr), device))
        return None if err else int(value)

    def host_register(self, address: int, nbytes: int, flags: int) -> int:
        return self._done(self.rt.cudaHostRegister(address, nbytes, flags))[0]

    def host_unregister(self, address: int) -> int:
        return self._done(self.rt.cudaHostUnregister(address))[0]

    def device_pointer(self, address: int) -> tuple[int, int]:
        err, pointer = self._done(self.rt.cudaHostGetDevicePointer(address, 0))
        return err, int(pointer or 0)

    def host_alloc(self, nbytes: int, flags: int) -> tuple[int, int]:
        err, pointer = self._done(self.rt.cudaHostAlloc(nbytes, flags))
        return err, int(pointer or 0)

    def free_host(self, address: int) -> int:
        return self._done(self.rt.cudaFreeHost(address))[0]


Runtime = CudaRuntime | BindingRuntime

_lock = threading.Lock()
_runtime: Runtime | None = None


def binding_runtime() -> BindingRuntime | None:
    """cuda-bindings' runtime, or None where it is not installed (the CPU venv, a JetPack without the extra)."""
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        return None
    return BindingRuntime(rt)


def ctypes_runtime() -> CudaRuntime:
    """libcudart through ctypes: the first candidate that loads; CudaRuntimeUnavailable with the paths tried."""
    tried = []
    for path in library_candidates():
        try:
            return CudaRuntime(ctypes.CDLL(path), path)
        except (OSError, AttributeError) as e:
            tried.append(f"{path} ({e})")
    where = "; ".join(tried) or "nothing in /proc/self/maps, the nvidia/* wheels or /usr/local/cuda"
    raise CudaRuntimeUnavailable(f"no usable libcudart: tried {where} (or install cuda-bindings)")


def runtime() -> Runtime:
    """The bound runtime (one per process): cuda-bindings where installed, else ctypes on torch's libcudart. Call
    after torch has initialised CUDA, so that the ctypes fallback finds the library torch loaded."""
    global _runtime
    with _lock:
        if _runtime is None:
            _runtime = binding_runtime() or ctypes_runtime()
        return _runtime
