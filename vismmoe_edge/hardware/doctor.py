"""`vismmoe-edge doctor`: one line per fact the runtime depends on, each failure with a one-line fix.

Checks never raise: a check that breaks becomes a failed line. ``required`` separates what stops the
runtime (Python, torch, transformers, ...) from what only limits it (no GPU, no jtop, an old kernel),
so a healthy CPU-only host exits 0.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.hardware import system
from vismmoe_edge.hardware.system import GIB, JetsonBoard
from vismmoe_edge.transformers_version import REQUIREMENT
from vismmoe_edge.transformers_version import check_transformers as check_version

# Wheels for JetPack 6 (CUDA 12.6): torch and onnxruntime-gpu have no aarch64 CUDA builds on PyPI
# (docs/platform-facts.md §3.5, microsoft/onnxruntime #20503).
JETSON_AI_LAB_JP6_INDEX = "https://pypi.jetson-ai-lab.io/jp6/cu126"
JETSON_ZOO_ONNXRUNTIME = "https://elinux.org/Jetson_Zoo#ONNX_Runtime"
MIN_PYTHON = (3, 10)
# The pinned tier (dense weights, prefix layers) is gigabytes: below this, mlock fails and the runtime
# falls back to pageable memory.
MEMLOCK_WANTED_BYTES = GIB

STATUS_WIDTH = len("missing ")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True  # a failed required check makes the doctor exit non-zero
    status: str = ""  # "ok", "info", "warn", "missing" or "FAIL"; derived from ok/required if empty

    def __post_init__(self) -> None:
        if not self.status:
            self.status = "ok" if self.ok else ("FAIL" if self.required else "warn")


def healthy(checks: list[Check]) -> bool:
    """True when every required check passed: the CLI's exit status 0."""
    return all(check.ok or not check.required for check in checks)


def format_checks(checks: list[Check]) -> str:
    """One aligned plain-text line per check.

    ``ok      torch 2.13.0+cpu`` for a pass, ``missing jtop: <detail> -> fix: <fix>`` otherwise.
    """
    lines = []
    for check in checks:
        detail = " ".join(check.detail.split())
        if check.ok:
            line = f"{check.name} {detail}"
        else:
            line = f"{check.name}: {detail}"
            if check.fix:
                line += f" -> fix: {' '.join(check.fix.split())}"
        lines.append(f"{check.status:<{STATUS_WIDTH}}{line}".rstrip())
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def _gib(n_bytes: int) -> str:
    return f"{n_bytes / GIB:.1f} GiB"


def _import(name: str) -> ModuleType:
    """Import an optional module, swallowing anything it prints (jtop prints on import)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return importlib.import_module(name)


def _version(module: ModuleType) -> str:
    return str(getattr(module, "__version__", "unknown version"))


def _torch_fix(board: JetsonBoard | None) -> str:
    if board is None:
        return "pip install 'torch>=2.4'"
    if board.jetpack_major == 6:
        return f"pip install torch --index-url {JETSON_AI_LAB_JP6_INDEX}"
    return f"install a CUDA build of torch made for JetPack {board.jetpack_major or '(unknown)'}"


# --------------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------------


def check_python() -> Check:
    version = ".".join(map(str, sys.version_info[:3]))
    if sys.version_info[:2] >= MIN_PYTHON:
        return Check("python", True, version)
    return Check(
        "python",
        False,
        f"{version} is older than {'.'.join(map(str, MIN_PYTHON))}",
        fix="use Python 3.10 or newer (JetPack 6's system python3 is 3.10)",
    )


def check_torch(board: JetsonBoard | None) -> Check:
    try:
        torch = _import("torch")
    except Exception as exc:
        return Check("torch", False, f"not importable ({type(exc).__name__}: {exc})", fix=_torch_fix(board))
    return Check("torch", True, _version(torch))


def check_transformers() -> Check:
    fix = f"pip install '{REQUIREMENT}'"
    try:
        transformers = _import("transformers")
    except Exception as exc:
        return Check("transformers", False, f"not importable ({type(exc).__name__}: {exc})", fix=fix)
    try:
        transformers.Qwen3VLMoeForConditionalGeneration  # noqa: B018 - the lazy import is the check
    except Exception as exc:
        return Check(
            "transformers",
            False,
            f"{_version(transformers)} lacks Qwen3VLMoeForConditionalGeneration ({type(exc).__name__})",
            fix=fix,
        )
    try:
        check_version(transformers.__version__)
    except VismmoeError:
        return Check("transformers", False, f"{_version(transformers)}: outside the supported range", fix=fix)
    return Check("transformers", True, f"{_version(transformers)} (Qwen3VLMoeForConditionalGeneration ok)")


def check_safetensors() -> Check:
    try:
        safetensors = _import("safetensors")
    except Exception as exc:
        return Check(
            "safetensors",
            False,
            f"not importable ({type(exc).__name__})",
            fix="pip install 'safetensors>=0.4'",
        )
    return Check("safetensors", True, _version(safetensors))


def check_cuda(board: JetsonBoard | None) -> Check:
    info = system.cuda_info()
    if info["torch"] is None:
        return Check("cuda", True, "unknown: torch is not importable", required=False, status="info")
    devices = info["devices"]
    if devices:
        names = ", ".join(f"{d['name']} ({_gib(d['total_memory'])})" for d in devices)
        return Check("cuda", True, f"{len(devices)} device(s): {names}; CUDA {info['cuda_version']}")
    why = f" ({info['error']})" if info["error"] else ""
    if board is None:
        # A desktop without a GPU is a supported, if slow, configuration: informational only.
        return Check(
            "cuda",
            True,
            f"CPU only: torch {info['torch']} sees no CUDA device{why}",
            required=False,
            status="info",
        )
    return Check(
        "cuda",
        False,
        f"torch {info['torch']} sees no CUDA device on this Jetson{why}",
        fix=_torch_fix(board),
        required=False,
    )


def check_gpu_access(board: JetsonBoard | None) -> Check:
    """The device attributes the integrated-GPU tiers rest on (hardware/gpu_access.py), and what they allow."""
    from vismmoe_edge.hardware import gpu_access

    access = gpu_access.probe(0) if system.cuda_info()["device_count"] else None
    if access is None:
        return Check("gpu access", True, "no CUDA device: experts are computed on the CPU", required=False,
                     status="info")  # fmt: skip
    slots, registration = access.slot_refusal(), access.registration_refusal()
    verdict = (
        f"--tier unified on cuda: slots {f'refused ({slots})' if slots else 'ok'}, registered shard ranges "
        f"{f'refused ({registration})' if registration else 'ok'}"
    )
    if slots is not None and board is not None:
        fix = "update JetPack (the iGPU must map pinned host memory); meanwhile pass --device cpu"
        return Check("gpu access", False, f"{access.describe()}; {verdict}", fix=fix, required=False)
    return Check("gpu access", True, f"{access.describe()}; {verdict}", required=False)


def check_jetson(board: JetsonBoard | None, detection_error: str = "") -> Check:
    if detection_error:
        return Check(
            "jetson",
            False,
            f"board detection crashed: {detection_error}",
            fix="report this with /proc/device-tree/model and /etc/nv_tegra_release attached",
            required=False,
        )
    if board is None:
        return Check(
            "jetson",
            True,
            "not a Jetson (no Jetson device-tree model or /etc/nv_tegra_release)",
            required=False,
            status="info",
        )
    if board.l4t is None:
        return Check(
            "jetson",
            False,
            f"{board.describe()}: /etc/nv_tegra_release is missing, so L4T/JetPack are unknown",
            fix="in a container, mount it: -v /etc/nv_tegra_release:/etc/nv_tegra_release:ro",
            required=False,
        )
    if board.jetpack_major is not None and board.jetpack_major < 5:
        return Check(
            "jetson",
            False,
            f"{board.describe()}: JetPack 4 kernels (4.9) lack the madvise calls the pager uses",
            fix="flash JetPack 6 (L4T r36)",
            required=False,
        )
    return Check("jetson", True, board.describe())


def check_jtop(root: Path, board: JetsonBoard | None) -> Check:
    try:
        jtop = _import("jtop")
    except (Exception, SystemExit) as exc:  # jtop is optional: whatever its import does, report it
        absent = isinstance(exc, ModuleNotFoundError) and exc.name == "jtop"
        why = "not installed" if absent else f"import failed ({type(exc).__name__}: {exc})"
        where = "telemetry falls back to sysfs and /proc/meminfo" if board else "only useful on a Jetson"
        return Check(
            "jtop",
            False,
            f"{why}; {where}",
            fix="pip install 'jetson-stats>=4.2' (the service itself: sudo pip3 install -U jetson-stats)",
            required=False,
            status="missing" if absent else "warn",
        )
    version = _version(jtop)
    socket = root / "run/jtop.sock"  # the jtop.service endpoint: mode 660, group jtop (docs/platform-facts.md §3.4)
    if not socket.exists():
        return Check(
            "jtop",
            False,
            f"{version} installed, but jtop.service is not running ({socket} is absent)",
            fix="sudo systemctl start jtop.service (if the unit is missing: sudo jtop --install-service)",
            required=False,
        )
    if not os.access(socket, os.R_OK | os.W_OK):
        return Check(
            "jtop",
            False,
            f"{version} installed, but this user cannot open {socket}",
            fix="sudo usermod -aG jtop $USER, then log out and back in (units: SupplementaryGroups=jtop)",
            required=False,
        )
    return Check("jtop", True, f"{version}, jtop.service socket reachable")


def check_onnxruntime(board: JetsonBoard | None) -> Check:
    if board is not None and board.jetpack_major == 6:
        gpu_hint = f"onnxruntime-gpu comes from the Jetson AI Lab index: {JETSON_AI_LAB_JP6_INDEX}"
    elif board is not None:
        gpu_hint = f"onnxruntime-gpu for this JetPack comes from the Jetson Zoo: {JETSON_ZOO_ONNXRUNTIME}"
    else:
        gpu_hint = "pip install onnxruntime-gpu for the CUDA provider"
    try:
        ort = _import("onnxruntime")
        providers = list(ort.get_available_providers())
    except Exception as exc:
        return Check(
            "onnxruntime",
            False,
            f"not importable ({type(exc).__name__}: {exc})",
            fix="pip install 'onnxruntime>=1.17'" + (f" (GPU: {gpu_hint})" if board else ""),
        )
    has_cuda = "CUDAExecutionProvider" in providers
    detail = f"{_version(ort)}, providers: {', '.join(providers)}"
    if not has_cuda:
        # The predictor runs on the CPU provider by default; a GPU provider is optional (docs/platform-facts.md §3.5).
        detail += f"; no CUDA provider (the predictor uses CPU; {gpu_hint})"
    return Check("onnxruntime", True, detail)


def check_kernel(root: Path) -> Check:
    release = system.kernel_release(root)
    version = system.kernel_version(release)
    if version < (5, 10, 0):
        return Check(
            "kernel",
            False,
            f"{release}: older than JetPack 5's 5.10",
            fix="upgrade to a 5.15+ kernel (JetPack 6)",
            required=False,
        )
    return Check("kernel", True, release)


def check_madvise(root: Path) -> list[Check]:
    version = system.kernel_version(system.kernel_release(root))
    supported = system.madvise_features(version)
    in_mmap = system.mmap_madvise_constants()
    probe_host = root == Path("/")  # a fixture tree describes another kernel: do not ask this one
    checks = []
    for advice in system.MADVISE_ADVICE:
        since = None if advice.since is None else ".".join(map(str, advice.since[:2]))
        constant = "mmap has the constant" if in_mmap[advice.name] else f"mmap lacks it: pass {advice.value}"
        ok = supported[advice.name]
        source = f"kernel {version[0]}.{version[1]}"
        if probe_host and (probed := system.probe_madvise(advice.value)) is not None:
            ok, source = probed, f"kernel {version[0]}.{version[1]} (probed)"
        name = f"madvise {advice.name}"
        if ok:
            since_text = "always" if since is None else f"since {since}"
            checks.append(Check(name, True, f"{advice.value}, {since_text}, {source}; {constant}"))
        else:
            checks.append(
                Check(
                    name,
                    False,
                    f"{advice.value} needs {since}, {source} refuses it; used to {advice.use}",
                    fix="upgrade to JetPack 6 (kernel 5.15); meanwhile the pager uses WILLNEED + pread",
                    required=False,
                )
            )
    return checks


def check_memlock(root: Path) -> Check:
    import resource

    soft, hard = system.memlock_limit()

    def show(limit: int) -> str:
        if limit == resource.RLIM_INFINITY:
            return "unlimited"
        return _gib(limit) if limit >= GIB else f"{limit >> 10} KiB"

    detail = f"soft {show(soft)}, hard {show(hard)}"
    if soft == resource.RLIM_INFINITY or soft >= MEMLOCK_WANTED_BYTES:
        return Check("RLIMIT_MEMLOCK", True, detail)
    if root == Path("/") and system.has_cap_ipc_lock(root):
        return Check("RLIMIT_MEMLOCK", True, f"{detail}; CAP_IPC_LOCK lifts it")
    return Check(
        "RLIMIT_MEMLOCK",
        False,
        f"{detail}: too small to mlock the pinned tier, which then stays pageable",
        fix="set LimitMEMLOCK=infinity in the systemd unit (in a shell: ulimit -l unlimited)",
        required=False,
    )


def check_mem_available(root: Path) -> Check:
    try:
        available = system.mem_available_bytes(root)
        total = system.mem_total_bytes(root)
    except (OSError, ValueError) as exc:
        return Check("MemAvailable", False, f"unreadable ({exc})", fix="run on Linux 3.14 or newer", required=False)
    return Check("MemAvailable", True, f"{_gib(available)} of {_gib(total)}")


# --------------------------------------------------------------------------------------------------
# Runner
# --------------------------------------------------------------------------------------------------


def _madvise_names() -> list[str]:
    return [f"madvise {advice.name}" for advice in system.MADVISE_ADVICE]


def run_checks(root: Path = Path("/")) -> list[Check]:
    """Every check, in a fixed order. Never raises: a check that crashes becomes a failed line."""
    try:
        board = system.detect_jetson(root)
        board_error = ""
    except Exception as exc:
        board, board_error = None, f"{type(exc).__name__}: {exc}"

    plan: list[tuple[list[str], Callable[[], Check | list[Check]]]] = [
        (["python"], check_python),
        (["torch"], lambda: check_torch(board)),
        (["transformers"], check_transformers),
        (["safetensors"], check_safetensors),
        (["cuda"], lambda: check_cuda(board)),
        (["gpu access"], lambda: check_gpu_access(board)),
        (["jetson"], lambda: check_jetson(board, board_error)),
        (["jtop"], lambda: check_jtop(root, board)),
        (["onnxruntime"], lambda: check_onnxruntime(board)),
        (["kernel"], lambda: check_kernel(root)),
        (_madvise_names(), lambda: check_madvise(root)),
        (["RLIMIT_MEMLOCK"], lambda: check_memlock(root)),
        (["MemAvailable"], lambda: check_mem_available(root)),
    ]
    checks: list[Check] = []
    for names, run in plan:
        try:
            result = run()
            checks.extend(result if isinstance(result, list) else [result])
        except Exception as exc:
            for name in names:
                checks.append(
                    Check(
                        name,
                        False,
                        f"the check itself crashed: {type(exc).__name__}: {exc}",
                        fix="report this with the output of `vismmoe-edge doctor`",
                        required=False,
                    )
                )
    return checks
