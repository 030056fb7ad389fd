"""hardware/cudart.runtime(): NVIDIA's cuda-bindings where installed, ctypes on torch's libcudart otherwise.

This machine has neither CUDA nor cuda-bindings: the binding's wrapper is exercised against a stand-in module with
cuda-bindings' calling convention (tuples led by a cudaError_t, named enums), and the import guard by hiding the
package. tools/device/binding_checks.py runs both paths on a real GPU.
"""

from __future__ import annotations

import enum
import sys
import types

import pytest

from vismmoe_edge.hardware import cudart


class FakeBindingModule(types.ModuleType):
    """cuda.bindings.runtime's shape: every call returns a tuple whose first item is the error."""

    class cudaError_t(enum.IntEnum):  # noqa: N801 - the binding's name
        cudaSuccess = 0
        cudaErrorInvalidValue = 1

    class cudaDeviceAttr(enum.IntEnum):  # noqa: N801
        cudaDevAttrIntegrated = cudart.ATTR_INTEGRATED
        cudaDevAttrHostRegisterSupported = cudart.ATTR_HOST_REGISTER_SUPPORTED

    def __init__(self) -> None:
        super().__init__("cuda.bindings.runtime")
        self.calls: list[tuple] = []
        self.registered: dict[int, tuple[int, int]] = {}

    def _log(self, *call: object) -> None:
        self.calls.append(call)

    def cudaDeviceGetAttribute(self, attr, device):  # noqa: N802
        self._log("attribute", attr, device)
        assert isinstance(attr, self.cudaDeviceAttr)  # named members, not bare ints
        return self.cudaError_t.cudaSuccess, {18: 1, 99: 1}[int(attr)]

    def cudaHostRegister(self, address, nbytes, flags):  # noqa: N802
        self._log("register", address, nbytes, flags)
        if nbytes == 0:
            return (self.cudaError_t.cudaErrorInvalidValue,)
        self.registered[address] = (nbytes, flags)
        return (self.cudaError_t.cudaSuccess,)

    def cudaHostUnregister(self, address):  # noqa: N802
        self._log("unregister", address)
        return (self.cudaError_t.cudaSuccess if self.registered.pop(address, None) else 1,)

    def cudaHostGetDevicePointer(self, address, flags):  # noqa: N802
        return self.cudaError_t.cudaSuccess, address + 0x1000

    def cudaHostAlloc(self, nbytes, flags):  # noqa: N802
        return self.cudaError_t.cudaSuccess, 0x7000

    def cudaFreeHost(self, address):  # noqa: N802
        return (self.cudaError_t.cudaSuccess,)

    def cudaSetDevice(self, index):  # noqa: N802
        return (self.cudaError_t.cudaSuccess,)

    def cudaGetLastError(self):  # noqa: N802
        self._log("get_last_error")
        return (self.cudaError_t.cudaSuccess,)

    def cudaGetErrorString(self, err):  # noqa: N802
        return self.cudaError_t.cudaSuccess, b"invalid argument"


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cudart, "_runtime", None)


def install_binding(monkeypatch: pytest.MonkeyPatch, module: types.ModuleType | None) -> None:
    """Make `from cuda.bindings import runtime` find `module` (None: fail as if not installed)."""
    if module is None:
        monkeypatch.setitem(sys.modules, "cuda", None)
        monkeypatch.setitem(sys.modules, "cuda.bindings", None)
        return
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime = module  # type: ignore[attr-defined]
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cuda", cuda)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", module)


def test_without_cuda_bindings_the_ctypes_fallback_is_used(monkeypatch: pytest.MonkeyPatch, fresh: None) -> None:
    install_binding(monkeypatch, None)
    assert cudart.binding_runtime() is None
    monkeypatch.setattr(cudart, "library_candidates", lambda: iter(["/nonexistent/libcudart.so.13"]))
    with pytest.raises(cudart.CudaRuntimeUnavailable, match="libcudart.so.13.*or install cuda-bindings"):
        cudart.runtime()


def test_cuda_bindings_is_preferred_and_speaks_the_same_interface(monkeypatch: pytest.MonkeyPatch, fresh: None) -> None:
    fake = FakeBindingModule()
    install_binding(monkeypatch, fake)
    rt = cudart.runtime()
    assert isinstance(rt, cudart.BindingRuntime) and cudart.runtime() is rt  # one per process
    assert rt.attribute(cudart.ATTR_INTEGRATED) == 1 and rt.attribute(cudart.ATTR_HOST_REGISTER_SUPPORTED, 0) == 1
    flags = cudart.REGISTER_PORTABLE | cudart.REGISTER_MAPPED
    assert rt.host_register(0x5000, 4096, flags) == cudart.SUCCESS and fake.registered == {0x5000: (4096, flags)}
    assert rt.device_pointer(0x5000) == (0, 0x6000)
    assert rt.host_alloc(64, cudart.ALLOC_MAPPED) == (0, 0x7000) and rt.free_host(0x7000) == 0
    assert rt.host_unregister(0x5000) == 0 and rt.set_device(0) == 0
    assert ("get_last_error",) not in fake.calls  # nothing failed, nothing to clear


def test_a_binding_error_is_returned_and_cleared(monkeypatch: pytest.MonkeyPatch, fresh: None) -> None:
    fake = FakeBindingModule()
    install_binding(monkeypatch, fake)
    rt = cudart.runtime()
    err = rt.host_register(0x5000, 0, cudart.REGISTER_READ_ONLY)
    assert err == 1 and fake.calls[-1] == ("get_last_error",)  # torch must not read our error after its launches
    assert rt.error_string(err) == "invalid argument (1)"
