"""Host memory for the integrated-GPU slots, and the libcudart binding's search, without a GPU: registration in
1 GiB pieces only where the device keeps host addresses, cudaHostAlloc where registration is unsupported."""

from __future__ import annotations

import pytest
import torch

from tests.fake_cudart import FakeRuntime
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.tiers import host_memory
from vismmoe_edge.experts.tiers.host_memory import HostMemory
from vismmoe_edge.hardware import cudart

MAPPED = cudart.REGISTER_PORTABLE | cudart.REGISTER_MAPPED


def test_plain_memory_is_exact_page_aligned_and_viewable():
    mem = HostMemory(10_000)
    assert mem.nbytes == 12_288 and mem.address % 4096 == 0
    view = mem.cpu_view(4096, 8192)
    view.fill_(7)
    assert view.data_ptr() == mem.address + 4096 and int(mem.cpu_view(0, 8192)[4096:].sum()) == 7 * 4096
    with pytest.raises(ValueError, match="outside"):
        mem.cpu_view(8192, 8192)
    with pytest.raises(ValueError, match="no device view"):
        mem.device_view(0, 16, torch.device("cuda"))


def test_registration_goes_in_pieces_where_the_device_keeps_host_addresses(monkeypatch):
    monkeypatch.setattr(host_memory, "REGISTER_PIECE", 8192)
    rt = FakeRuntime()
    mem = HostMemory(5 * 4096, runtime=rt)  # type: ignore[arg-type]
    calls = [c for c in rt.calls if c[0] == "register"]
    assert [(c[1] - mem.address, c[2], c[3]) for c in calls] == [(0, 8192, MAPPED), (8192, 8192, MAPPED),
                                                                  (16384, 4096, MAPPED)]  # fmt: skip
    assert mem.device_address == mem.address
    mem.close()
    assert rt.registered == {}


def test_one_registration_where_registered_memory_moves_on_the_device(monkeypatch):
    monkeypatch.setattr(host_memory, "REGISTER_PIECE", 8192)
    rt = FakeRuntime({cudart.ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM: 0})
    mem = HostMemory(5 * 4096, runtime=rt)  # type: ignore[arg-type]
    assert [c[2] for c in rt.calls if c[0] == "register"] == [5 * 4096]
    mem.close()


def test_cuda_host_alloc_where_registration_is_unsupported():
    rt = FakeRuntime({cudart.ATTR_HOST_REGISTER_SUPPORTED: 0})
    mem = HostMemory(4096, runtime=rt)  # type: ignore[arg-type]
    assert [c[0] for c in rt.calls] == ["host_alloc"] and rt.calls[0][3] == cudart.ALLOC_PORTABLE | cudart.ALLOC_MAPPED
    view = mem.cpu_view(0, 4096)
    view.fill_(3)
    assert int(view.sum()) == 3 * 4096 and "cudaHostAlloc" in mem.how
    mem.close()
    assert rt.calls[-1][0] == "free_host"


def test_a_refused_registration_is_one_line():
    rt = FakeRuntime(refuse_flags=MAPPED)
    with pytest.raises(VismmoeError, match="cudaHostRegister of .* failed: operation not supported") as e:
        HostMemory(4096, runtime=rt)  # type: ignore[arg-type]
    assert "\n" not in str(e.value)


def test_libcudart_is_looked_for_where_torch_loaded_it_first():
    maps = (
        "7f00-7f10 r-xp 00000000 08:01 123 /opt/venv/lib/python3.11/site-packages/nvidia/cu13/lib/libcudart.so.13\n"
        "7f10-7f20 r--p 00000000 00:00 0\n"
    )
    first = next(cudart.library_candidates(maps))
    assert first.endswith("nvidia/cu13/lib/libcudart.so.13")


def test_no_libcudart_is_one_line(monkeypatch):
    monkeypatch.setattr(cudart, "_runtime", None)
    monkeypatch.setattr(cudart, "library_candidates", lambda maps=None: iter(["/nonexistent/libcudart.so.13"]))
    with pytest.raises(cudart.CudaRuntimeUnavailable, match="no usable libcudart: tried /nonexistent") as e:
        cudart.runtime()
    assert "\n" not in str(e.value)
