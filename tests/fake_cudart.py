"""A stand-in for hardware/cudart.CudaRuntime on machines without CUDA: it keeps the registrations the real
runtime would hold and refuses what the real one refuses (overlaps: error 712; flags a device lacks: 801)."""

from __future__ import annotations

import ctypes

from vismmoe_edge.hardware import cudart

NOT_SUPPORTED = 801


class FakeRuntime:
    path = "fake libcudart"

    def __init__(self, attributes: dict[int, int] | None = None, refuse_flags: int | None = None) -> None:
        self.attributes = {
            cudart.ATTR_HOST_REGISTER_SUPPORTED: 1,
            cudart.ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM: 1,
            cudart.ATTR_READ_ONLY_HOST_REGISTER_SUPPORTED: 1,
            **(attributes or {}),
        }
        self.refuse_flags = refuse_flags  # register calls with exactly these flags fail
        self.registered: dict[int, tuple[int, int]] = {}  # address -> (length, flags)
        self.calls: list[tuple[str, int, int, int]] = []
        self._allocs: list[ctypes.Array] = []

    def set_device(self, index: int) -> int:
        return 0

    def attribute(self, attr: int, device: int = 0) -> int | None:
        return self.attributes.get(attr, 0)

    def error_string(self, err: int) -> str:
        names = {712: "host memory already registered", NOT_SUPPORTED: "operation not supported"}
        return f"{names.get(err, '?')} ({err})"

    def host_register(self, address: int, nbytes: int, flags: int) -> int:
        self.calls.append(("register", address, nbytes, flags))
        if self.refuse_flags is not None and flags == self.refuse_flags:
            return NOT_SUPPORTED
        for start, (length, _) in self.registered.items():
            if address < start + length and start < address + nbytes:
                return cudart.ERROR_HOST_MEMORY_ALREADY_REGISTERED
        self.registered[address] = (nbytes, flags)
        return 0

    def host_unregister(self, address: int) -> int:
        self.calls.append(("unregister", address, 0, 0))
        return 0 if self.registered.pop(address, None) is not None else 1

    def device_pointer(self, address: int) -> tuple[int, int]:
        return 0, address

    def host_alloc(self, nbytes: int, flags: int) -> tuple[int, int]:
        buf = (ctypes.c_uint8 * nbytes)()
        self._allocs.append(buf)
        self.calls.append(("host_alloc", ctypes.addressof(buf), nbytes, flags))
        return 0, ctypes.addressof(buf)

    def free_host(self, address: int) -> int:
        self.calls.append(("free_host", address, 0, 0))
        return 0
