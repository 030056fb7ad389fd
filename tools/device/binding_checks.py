#!/usr/bin/env python3
"""GPU checks of hardware/cudart.py's two bindings, NVIDIA's cuda-bindings and the ctypes fallback, one JSON summary.

    python3 tools/device/binding_checks.py --out $OUT/binding.json      # < 1 min on an H200 (needs cuda-bindings)

Checks, each on its own (a failure is recorded with its error and the run goes on; exit status 1 if any failed):
- the binding: cuda-bindings imports, its version; our hand-typed attribute numbers and flags equal its named
  cudaDeviceAttr members and cudaHostRegister / cudaHostAlloc constants;
- the context: after torch initialised CUDA, the current context is the device's primary context (the one the
  runtime API, hence both bindings, works in);
- per binding (cuda-bindings, ctypes): every device attribute the tiers read, equal between the two; host
  registration of anonymous memory with PORTABLE | MAPPED flags, its mapped device pointer, a CUDA tensor at that
  pointer equal to the host data and a GPU reduction over it equal to the CPU's; cudaHostAlloc'd mapped memory the
  same way; READ_ONLY registration of a MAP_SHARED, PROT_READ file mapping (where attribute 113 is 1); a refused
  registration returns its error and leaves torch working; the product's own HostMemory (the integrated-GPU slot
  memory) built on that binding.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import json
import mmap
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.device.checks import Checks  # noqa: E402
from vismmoe_edge.experts.tiers.host_memory import DeviceArray, HostMemory  # noqa: E402
from vismmoe_edge.hardware import cudart  # noqa: E402

MIB = 1 << 20
ATTRIBUTES = {  # ours -> the binding's cudaDeviceAttr member
    "ATTR_INTEGRATED": "cudaDevAttrIntegrated",
    "ATTR_CAN_MAP_HOST_MEMORY": "cudaDevAttrCanMapHostMemory",
    "ATTR_PAGEABLE_MEMORY_ACCESS": "cudaDevAttrPageableMemoryAccess",
    "ATTR_CONCURRENT_MANAGED_ACCESS": "cudaDevAttrConcurrentManagedAccess",
    "ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM": "cudaDevAttrCanUseHostPointerForRegisteredMem",
    "ATTR_HOST_REGISTER_SUPPORTED": "cudaDevAttrHostRegisterSupported",
    "ATTR_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES": "cudaDevAttrPageableMemoryAccessUsesHostPageTables",
    "ATTR_READ_ONLY_HOST_REGISTER_SUPPORTED": "cudaDevAttrHostRegisterReadOnlySupported",
}
FLAGS = {  # ours -> the binding's module constant
    "REGISTER_PORTABLE": "cudaHostRegisterPortable",
    "REGISTER_MAPPED": "cudaHostRegisterMapped",
    "REGISTER_READ_ONLY": "cudaHostRegisterReadOnly",
    "ALLOC_PORTABLE": "cudaHostAllocPortable",
    "ALLOC_MAPPED": "cudaHostAllocMapped",
}


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def read_through(device_address: int, nbytes: int, owner: object) -> torch.Tensor:
    """A CUDA uint8 tensor at `device_address` (no copy), as the tiers make them."""
    view = torch.as_tensor(DeviceArray(device_address, nbytes, owner), device="cuda")
    assert view.data_ptr() == device_address, "torch copied instead of viewing"
    return view


def compare(view: torch.Tensor, host: torch.Tensor) -> dict[str, Any]:
    gpu_sum = int(view.to(torch.int64).sum().item())  # a kernel reading every byte through the mapping
    cpu_sum = int(host.to(torch.int64).sum().item())
    equal = bool(torch.equal(view.cpu(), host))
    return {"ok": equal and gpu_sum == cpu_sum, "equal": equal, "gpu_sum": gpu_sum, "cpu_sum": cpu_sum}


def check_binding() -> dict[str, Any]:
    from cuda.bindings import runtime as rt

    wrong = {ours: [getattr(cudart, ours), int(getattr(rt.cudaDeviceAttr, theirs))]
             for ours, theirs in ATTRIBUTES.items()
             if getattr(cudart, ours) != int(getattr(rt.cudaDeviceAttr, theirs))}  # fmt: skip
    missing = [theirs for theirs in FLAGS.values() if not hasattr(rt, theirs)]
    wrong |= {ours: [getattr(cudart, ours), int(getattr(rt, theirs))]
              for ours, theirs in FLAGS.items()
              if hasattr(rt, theirs) and getattr(cudart, ours) != int(getattr(rt, theirs))}  # fmt: skip
    return {"ok": not wrong, "version": importlib.metadata.version("cuda-bindings"), "differ": wrong,
            "flags_not_in_binding": missing}  # fmt: skip


def _handle(obj: Any) -> int:
    """A driver handle (CUcontext) as an int, whichever way this cuda-bindings version offers it."""
    try:
        return int(obj)
    except TypeError:
        return int(obj.getPtr())


def check_primary_context() -> dict[str, Any]:
    from cuda.bindings import driver

    torch.zeros(1, device="cuda")  # torch initialises CUDA
    err, current = driver.cuCtxGetCurrent()
    err2, device = driver.cuCtxGetDevice()
    err3, primary = driver.cuDevicePrimaryCtxRetain(device)
    same = _handle(current) == _handle(primary)
    driver.cuDevicePrimaryCtxRelease(device)
    return {"ok": same and not (int(err) or int(err2) or int(err3)), "current_is_primary": same}


def runtimes() -> dict[str, cudart.Runtime]:
    torch.zeros(1, device="cuda")  # the ctypes fallback binds the libcudart torch loaded
    found: dict[str, cudart.Runtime] = {"ctypes": cudart.ctypes_runtime()}
    binding = cudart.binding_runtime()
    if binding is not None:
        found["cuda-bindings"] = binding
    return found


def check_attributes(rts: dict[str, cudart.Runtime]) -> dict[str, Any]:
    values = {name: {ours: rt.attribute(getattr(cudart, ours), 0) for ours in ATTRIBUTES} for name, rt in rts.items()}
    agree = len({json.dumps(v, sort_keys=True) for v in values.values()}) == 1
    return {"ok": agree and None not in next(iter(values.values())).values(), "agree": agree, "values": values}


def check_registered(rt: cudart.Runtime) -> dict[str, Any]:
    nbytes = 64 * MIB
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    host = torch.frombuffer(mm, dtype=torch.uint8)
    host.copy_(pattern(nbytes, 1))
    address = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    flags = cudart.REGISTER_PORTABLE | cudart.REGISTER_MAPPED
    start = time.perf_counter()
    err = rt.host_register(address, nbytes, flags)
    register_s = time.perf_counter() - start
    if err:
        return {"ok": False, "register": rt.error_string(err)}
    try:
        err, device_address = rt.device_pointer(address)
        out = compare(read_through(device_address, nbytes, mm), host) if not err else {"ok": False}
        host[:4096].fill_(7)  # a host write after registration is what the GPU reads next (no copy anywhere)
        torch.cuda.synchronize()
        seen = read_through(device_address, 4096, mm)
        out["host_write_seen"] = bool((seen == 7).all().item())
        out["ok"] = out["ok"] and out["host_write_seen"]
        return out | {"device_pointer_err": err, "same_address": device_address == address,
                      "register_64mib_ms": round(register_s * 1e3, 2)}  # fmt: skip
    finally:
        torch.cuda.synchronize()
        unregister = rt.host_unregister(address)
        del host
        assert unregister == 0, rt.error_string(unregister)


def check_host_alloc(rt: cudart.Runtime) -> dict[str, Any]:
    nbytes = 16 * MIB
    err, address = rt.host_alloc(nbytes, cudart.ALLOC_PORTABLE | cudart.ALLOC_MAPPED)
    if err:
        return {"ok": False, "host_alloc": rt.error_string(err)}
    try:
        raw = (ctypes.c_uint8 * nbytes).from_address(address)
        host = torch.frombuffer(raw, dtype=torch.uint8)
        host.copy_(pattern(nbytes, 2))
        err, device_address = rt.device_pointer(address)
        return compare(read_through(device_address, nbytes, raw), host) | {"device_pointer_err": err}
    finally:
        torch.cuda.synchronize()
        rt.free_host(address)


def check_read_only_file(rt: cudart.Runtime, tmp: Path) -> dict[str, Any]:
    if rt.attribute(cudart.ATTR_READ_ONLY_HOST_REGISTER_SUPPORTED, 0) != 1:
        return {"skipped": "attribute 113 is 0 here"}
    nbytes = 16 * MIB
    data = pattern(nbytes, 3)
    path = tmp / "shard.bin"
    path.write_bytes(data.numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long)  # fmt: skip
    address = libc.mmap(None, nbytes, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    try:
        err = rt.host_register(address, nbytes, cudart.REGISTER_READ_ONLY)
        if err:
            return {"ok": False, "register": rt.error_string(err)}
        err, device_address = rt.device_pointer(address)
        out = compare(read_through(device_address, nbytes, path), data) | {"device_pointer_err": err}
        torch.cuda.synchronize()
        out["unregister"] = rt.host_unregister(address)
        return out
    finally:
        libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(nbytes))
        os.close(fd)


def check_refusal(rt: cudart.Runtime) -> dict[str, Any]:
    err = rt.host_register(0, 4096, cudart.REGISTER_MAPPED)  # no memory at address 0
    after = torch.ones(1024, device="cuda").sum().item()  # torch must not trip over our error
    return {"ok": err != 0 and after == 1024, "err": err, "message": rt.error_string(err) if err else ""}


def check_product_memory(rt: cudart.Runtime) -> dict[str, Any]:
    memory = HostMemory(32 * MIB, runtime=rt)
    data = pattern(memory.nbytes, 4)
    memory.cpu_view(0, memory.nbytes).copy_(data)
    out = compare(memory.device_view(0, memory.nbytes, torch.device("cuda")), data) | memory.describe()
    torch.cuda.synchronize()
    memory.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")) / "binding.json")
    args = ap.parse_args(argv)
    checks = Checks()
    start = time.perf_counter()
    checks.run("cuda-bindings: installed, numbers equal its named enums", check_binding)
    checks.run("torch works in the primary context", check_primary_context)
    rts = runtimes() if checks.cuda else {}
    if rts:
        checks.run("device attributes, both bindings", lambda: check_attributes(rts))
    with tempfile.TemporaryDirectory(prefix="binding-checks-") as tmp_name:
        for name, rt in rts.items():
            checks.run(f"{name}: registered host memory read by the GPU", lambda rt=rt: check_registered(rt))
            checks.run(f"{name}: cudaHostAlloc'd mapped memory read by the GPU", lambda rt=rt: check_host_alloc(rt))
            checks.run(f"{name}: READ_ONLY registration of a shared file mapping",
                       lambda rt=rt: check_read_only_file(rt, Path(tmp_name)))  # fmt: skip
            checks.run(f"{name}: a refused registration", lambda rt=rt: check_refusal(rt))
            checks.run(f"{name}: HostMemory (the slot memory) on it", lambda rt=rt: check_product_memory(rt))
    summary = {
        "machine": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": time.strftime("%Y-%m-%d"),
        "bindings": list(rts),
        "default_runtime": type(cudart.runtime()).__name__ if rts else None,
        "seconds": round(time.perf_counter() - start, 1),
        "passed": sum(r["status"] == "pass" for r in checks.results),
        "failed": [r["name"] for r in checks.results if r["status"] == "fail"],
        "checks": checks.results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps({k: v for k, v in summary.items() if k != "checks"}, indent=1))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
