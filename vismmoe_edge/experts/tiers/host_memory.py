"""Page-aligned host memory that a CUDA device reads in place: the integrated-GPU slot pool's backing store.

An anonymous mapping of exactly the pool's size (torch's pinned allocator rounds every block up to a power of two,
which would waste up to half of a Jetson's DRAM), pinned and mapped for the GPU with cudaHostRegister in 1 GiB
pieces (one huge registration can take tens of seconds, as one huge cudaHostAlloc does; host_mirror.py). Where the
device keeps registered memory at its host address (attribute 91), the pieces form one device range at the same
address; otherwise the whole range is registered at once and its device address asked for. Where registration
is unsupported (attribute 99 = 0), cudaHostAlloc gives the memory instead. Without CUDA (`runtime=None`) it is
plain anonymous memory: the same slot-filling code runs on the CPU, in tests and on CPU-only hosts.

Views: `cpu_view` (a torch tensor over the mapping) and `device_view` (a CUDA tensor at the device address, made
through `__cuda_array_interface__`; measured on the H200 to keep the pointer and compute correctly:
tools/device/igpu_checks.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from typing import Any

import torch

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.page_ranges import PAGE_SIZE
from vismmoe_edge.hardware import cudart
from vismmoe_edge.units import format_bytes

REGISTER_PIECE = 1 << 30


class DeviceArray:
    """The one attribute torch.as_tensor reads to wrap device memory without copying it; holds its owner alive."""

    def __init__(self, address: int, nbytes: int, owner: object) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
        }
        self.owner = owner


class HostMemory:
    """`nbytes` (rounded up to pages) of zeroed host memory; `address` is its first byte on the CPU."""

    def __init__(self, nbytes: int, *, runtime: cudart.Runtime | None = None, device_index: int = 0) -> None:
        self.nbytes = max(PAGE_SIZE, nbytes + (-nbytes) % PAGE_SIZE)
        self.runtime = runtime
        self.device_index = device_index
        self.how = "anonymous memory"
        self._registered: list[int] = []
        self._host_alloc = 0
        self._mm: mmap.mmap | None = None
        self.device_address = 0
        if runtime is None:
            self._mm = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.address = _address_of(self._mm)
            return
        runtime.set_device(device_index)
        supported = runtime.attribute(cudart.ATTR_HOST_REGISTER_SUPPORTED, device_index)
        if supported == 0:
            self._allocate_pinned()
            return
        self._mm = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.address = _address_of(self._mm)
        same_address = runtime.attribute(cudart.ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, device_index) == 1
        piece = REGISTER_PIECE if same_address else self.nbytes
        flags = cudart.REGISTER_PORTABLE | cudart.REGISTER_MAPPED
        for start in range(0, self.nbytes, piece):
            err = runtime.host_register(self.address + start, min(piece, self.nbytes - start), flags)
            if err:
                self.close()
                raise VismmoeError(
                    f"cudaHostRegister of {format_bytes(self.nbytes)} for expert slots failed: "
                    f"{runtime.error_string(err)}; lower --memory-budget or use --tier gpu"
                )
            self._registered.append(self.address + start)
        err, self.device_address = runtime.device_pointer(self.address)
        if err or (len(self._registered) > 1 and self.device_address != self.address):
            self.close()
            raise VismmoeError(f"registered slots have no device address ({runtime.error_string(err)}); use --tier gpu")
        self.how = f"anonymous memory, cudaHostRegister'd in {len(self._registered)} piece(s)"

    def _allocate_pinned(self) -> None:
        rt = self.runtime
        assert rt is not None
        err, self._host_alloc = rt.host_alloc(self.nbytes, cudart.ALLOC_PORTABLE | cudart.ALLOC_MAPPED)
        if err:
            raise VismmoeError(
                f"cudaHostAlloc of {format_bytes(self.nbytes)} for expert slots failed: {rt.error_string(err)}; "
                "lower --memory-budget"
            )
        self.address = self._host_alloc
        ctypes.memset(self.address, 0, self.nbytes)
        err, self.device_address = rt.device_pointer(self.address)
        if err:
            self.close()
            raise VismmoeError(f"pinned slots have no device address ({rt.error_string(err)}); use --tier gpu")
        self.how = "cudaHostAlloc (host registration unsupported here)"

    def _check(self, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"[{offset}, {offset + nbytes}) is outside the {self.nbytes} bytes of host memory")

    def cpu_view(self, offset: int, nbytes: int) -> torch.Tensor:
        """uint8 CPU tensor over [offset, offset + nbytes); it keeps the memory alive."""
        self._check(offset, nbytes)
        if self._mm is not None:
            return torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes, offset=offset)
        raw = (ctypes.c_uint8 * nbytes).from_address(self.address + offset)
        view = torch.frombuffer(raw, dtype=torch.uint8)
        view._vismmoe_owner = self  # type: ignore[attr-defined]  # the ctypes array does not own the memory
        return view

    def device_view(self, offset: int, nbytes: int, device: torch.device) -> torch.Tensor:
        """uint8 CUDA tensor over the same bytes, no copy; it keeps the memory alive."""
        self._check(offset, nbytes)
        if self.runtime is None:
            raise ValueError("host memory without a CUDA runtime has no device view")
        address = self.device_address + offset
        view = torch.as_tensor(DeviceArray(address, nbytes, self), device=device)
        if view.data_ptr() != address:  # torch copies when it thinks the pointer is on another device
            raise VismmoeError(f"torch copied mapped host memory instead of viewing it on {device}; use --tier gpu")
        return view

    def view(self, offset: int, nbytes: int, device: torch.device) -> torch.Tensor:
        return self.device_view(offset, nbytes, device) if device.type == "cuda" else self.cpu_view(offset, nbytes)

    def contains(self, address: int, nbytes: int = 0) -> bool:
        return self.address <= address and address + nbytes <= self.address + self.nbytes

    def close(self) -> None:
        """Unregister and free; only once no view is in use (views keep this object alive, so a finalizer is)."""
        rt = self.runtime
        for address in self._registered:
            if rt is not None:
                rt.host_unregister(address)
        self._registered = []
        if self._host_alloc and rt is not None:
            rt.free_host(self._host_alloc)
            self._host_alloc = 0
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # CPU views still export it: it goes with the last of them
                self._mm.close()
            self._mm = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def describe(self) -> dict[str, Any]:
        return {"bytes": self.nbytes, "how": self.how, "same_address_on_device": self.device_address == self.address}


def _address_of(mm: mmap.mmap) -> int:
    holder = ctypes.c_char.from_buffer(mm)  # a writable mapping: ctypes can take its address
    address = ctypes.addressof(holder)
    del holder  # the export ends here, so the mapping can still be closed
    return address
