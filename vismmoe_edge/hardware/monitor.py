"""Telemetry samplers behind one interface, and a background thread that samples them into rows.

- `JtopSampler`: Jetson power rails, temperatures, GPU load and clock, RAM, swap, EMC, through the jtop
  client (jetson-stats). Optional: not installed, or its root service down (docs/platform-facts.md §3.4), is
  reported once and the run goes on without it.
- `PsutilSampler`: process CPU and RSS, system memory and swap; psutil when importable, else /proc.
- `NvmlSampler`: a discrete NVIDIA GPU's utilisation, memory, power and SM clock through pynvml
  (the `nvidia-ml-py` package).

Every optional package is imported inside a constructor, so importing this module costs nothing.
A row is a flat dict: `time` (Unix seconds), `elapsed_s`, then each sampler's fields. Units are in the
field names (`_bytes`, `_mw`, `_mhz`, `_percent`, `_c`).
"""

from __future__ import annotations

import csv
import os
import re
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TextIO

from vismmoe_edge.hardware import system

Row = dict[str, float]

_notices: set[str] = set()


def notice_once(key: str, message: str, stream: TextIO | None = None) -> bool:
    """Print `message` to stderr the first time `key` is seen in this process; True if it was printed."""
    if key in _notices:
        return False
    _notices.add(key)
    print(f"note: {message}", file=stream or sys.stderr, flush=True)
    return True


class SamplerUnavailable(Exception):
    """A sampler cannot run here; the message says why and how to fix it."""


class Sampler:
    """One telemetry source. `sample()` returns this instant's fields; it may omit what it cannot read."""

    name = "sampler"

    def sample(self) -> Row:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _key(name: str) -> str:
    """A CSV-friendly field name: 'VDD_CPU_GPU_CV' -> 'vdd_cpu_gpu_cv', 'CPU-therm' -> 'cpu_therm'."""
    return re.sub(r"[^0-9a-z]+", "_", name.lower()).strip("_")


# --------------------------------------------------------------------------------------------------
# jtop (Jetson)
# --------------------------------------------------------------------------------------------------

JTOP_FIX = "pip install 'jetson-stats>=4.2' and sudo jtop --install-service; the service user needs group jtop"


class JtopSampler(Sampler):
    """Reads the jtop client's latest values; the client's own thread refreshes them every `interval` s."""

    name = "jtop"

    def __init__(self, interval: float = 0.5) -> None:
        try:
            from jtop import JtopException, jtop
        except (Exception, SystemExit) as exc:  # jtop's import may print or exit on odd hosts
            absent = isinstance(exc, ModuleNotFoundError) and exc.name == "jtop"
            why = "jtop is not installed" if absent else f"jtop failed to import ({type(exc).__name__}: {exc})"
            raise SamplerUnavailable(why) from None
        self._exception = JtopException
        self._jetson = jtop(interval=interval)
        try:
            self._jetson.start()  # off-Jetson or service down: JtopException within ~0.01 s (platform-facts.md §3.4)
        except Exception as exc:
            text = " ".join(str(exc).split())  # jtop's texts contain newlines
            raise SamplerUnavailable(f"jtop is installed but unusable: {text}") from None

    def sample(self) -> Row:
        jetson = self._jetson
        jetson.ok(spin=True)  # non-blocking; re-raises an error of the client thread (lost connection)
        row: Row = {}
        power = jetson.power or {}
        total = power.get("tot", {}).get("power")
        if total is not None:
            row["power_total_mw"] = float(total)
        for rail, values in power.get("rail", {}).items():
            if values.get("online", True) and values.get("power") is not None:
                row[f"power_{_key(rail)}_mw"] = float(values["power"])
        for name, values in (jetson.temperature or {}).items():
            if values.get("online", True) and values.get("temp", -256) > -256:  # -256: sensor offline
                row[f"temp_{_key(name)}_c"] = float(values["temp"])
        for gpu in (jetson.gpu or {}).values():  # Orin has one integrated GPU
            load = gpu.get("status", {}).get("load")
            cur_khz = gpu.get("freq", {}).get("cur")
            if load is not None:
                row["gpu_util_percent"] = float(load)
            if cur_khz is not None:
                row["gpu_clock_mhz"] = cur_khz / 1000
            break
        memory = jetson.memory or {}
        ram, swap, emc = memory.get("RAM", {}), memory.get("SWAP", {}), memory.get("EMC", {})
        for field, source, key in (
            ("ram_total_bytes", ram, "tot"),
            ("ram_used_bytes", ram, "used"),
            ("ram_gpu_shared_bytes", ram, "shared"),  # NvMap memory the GPU holds
            ("jtop_swap_used_bytes", swap, "used"),
        ):
            if source.get(key) is not None:
                row[field] = float(source[key]) * 1024  # jtop reports KB
        if emc.get("online", True) and emc.get("val") is not None:
            row["emc_util_percent"] = float(emc["val"])
            if emc.get("cur") is not None:
                row["emc_clock_mhz"] = emc["cur"] / 1000
        return row

    def close(self) -> None:
        try:
            self._jetson.close()
        except Exception:
            pass


# --------------------------------------------------------------------------------------------------
# psutil, or /proc
# --------------------------------------------------------------------------------------------------


def _proc_cpu_ticks(pid: int) -> int:
    """utime + stime of `pid` in clock ticks (/proc/PID/stat fields 14 and 15)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()  # comm may contain spaces and parentheses
    return int(fields[11]) + int(fields[12])


def _proc_rss_bytes(pid: int) -> int:
    resident_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def _system_cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies over all CPUs from the first line of /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    total = sum(values[:8])  # guest time is already inside user/nice
    return total - idle, total


class PsutilSampler(Sampler):
    """CPU % and RSS of one process (default: this one), system memory and swap.

    psutil is optional: without it the same fields come from /proc (`backend` and `name` say which ran).
    cpu_percent is per CPU (200 = two cores busy), as top shows it.
    """

    name = "psutil"

    def __init__(self, pid: int | None = None, *, use_psutil: bool = True) -> None:
        self.pid = pid or os.getpid()
        self._psutil = None
        if use_psutil:
            try:
                import psutil

                self._psutil = psutil
            except ImportError:
                pass
        self.backend = "psutil" if self._psutil is not None else "proc"
        self.name = self.backend  # reported as the sampler that ran
        if self._psutil is not None:
            self._process = self._psutil.Process(self.pid)
            self._process.cpu_percent(None)  # the first call only primes the counters
            self._psutil.cpu_percent(None)
        else:
            self._last = (time.monotonic(), _proc_cpu_ticks(self.pid), *_system_cpu_times())
        self._ticks_per_s = os.sysconf("SC_CLK_TCK")

    def sample(self) -> Row:
        if self._psutil is not None:
            vm, swap = self._psutil.virtual_memory(), self._psutil.swap_memory()
            return {
                "cpu_percent": self._process.cpu_percent(None),
                "rss_bytes": float(self._process.memory_info().rss),
                "sys_cpu_percent": self._psutil.cpu_percent(None),
                "mem_total_bytes": float(vm.total),
                "mem_available_bytes": float(vm.available),
                "mem_used_bytes": float(vm.total - vm.available),
                "swap_used_bytes": float(swap.used),
            }
        now, ticks, busy, total = time.monotonic(), _proc_cpu_ticks(self.pid), *_system_cpu_times()
        last_now, last_ticks, last_busy, last_total = self._last
        self._last = (now, ticks, busy, total)
        wall = now - last_now
        cpu = 100.0 * (ticks - last_ticks) / self._ticks_per_s / wall if wall > 0 else 0.0
        sys_cpu = 100.0 * (busy - last_busy) / (total - last_total) if total > last_total else 0.0
        meminfo = system.read_meminfo()
        mem_total, available = meminfo["MemTotal"], meminfo.get("MemAvailable", meminfo.get("MemFree", 0))
        return {
            "cpu_percent": cpu,
            "rss_bytes": float(_proc_rss_bytes(self.pid)),
            "sys_cpu_percent": sys_cpu,
            "mem_total_bytes": float(mem_total),
            "mem_available_bytes": float(available),
            "mem_used_bytes": float(mem_total - available),
            "swap_used_bytes": float(meminfo.get("SwapTotal", 0) - meminfo.get("SwapFree", 0)),
        }


# --------------------------------------------------------------------------------------------------
# NVML (discrete NVIDIA GPUs)
# --------------------------------------------------------------------------------------------------


def has_nvidia_gpu() -> bool:
    """A discrete NVIDIA GPU driven by nvidia.ko (Jetson's nvgpu has no NVML): cheap, without CUDA init."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return (gpus.is_dir() and any(gpus.iterdir())) or Path("/dev/nvidia0").exists()


class NvmlSampler(Sampler):
    """GPU `index` in NVML's numbering (PCI order; it ignores CUDA_VISIBLE_DEVICES)."""

    name = "nvml"

    def __init__(self, index: int = 0) -> None:
        try:
            import pynvml
        except ImportError:
            raise SamplerUnavailable("pynvml is not installed (pip install nvidia-ml-py)") from None
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except pynvml.NVMLError as exc:
            raise SamplerUnavailable(f"NVML failed: {exc}") from None

    def _read(self, fn_name: str, *args: object) -> object | None:
        try:
            return getattr(self._nvml, fn_name)(self._handle, *args)
        except self._nvml.NVMLError:  # e.g. power not supported on this board
            return None

    def sample(self) -> Row:
        row: Row = {}
        util = self._read("nvmlDeviceGetUtilizationRates")
        if util is not None:
            row["gpu_util_percent"] = float(util.gpu)  # type: ignore[attr-defined]
        mem = self._read("nvmlDeviceGetMemoryInfo")
        if mem is not None:
            row["gpu_mem_used_bytes"] = float(mem.used)  # type: ignore[attr-defined]
            row["gpu_mem_total_bytes"] = float(mem.total)  # type: ignore[attr-defined]
        power = self._read("nvmlDeviceGetPowerUsage")  # milliwatts
        if power is not None:
            row["gpu_power_mw"] = float(power)  # type: ignore[arg-type]
        clock = self._read("nvmlDeviceGetClockInfo", self._nvml.NVML_CLOCK_SM)
        if clock is not None:
            row["gpu_clock_mhz"] = float(clock)  # type: ignore[arg-type]
        return row

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:
            pass


# --------------------------------------------------------------------------------------------------
# Choosing samplers, and the sampling thread
# --------------------------------------------------------------------------------------------------


def open_samplers(interval: float = 0.5, *, pid: int | None = None, jetson: bool | None = None) -> list[Sampler]:
    """Every sampler that works here: jtop (if it runs), psutil or /proc (always), NVML (on a discrete GPU).

    What is missing is said once per process, and the run continues without it.
    """
    if jetson is None:
        jetson = system.detect_jetson() is not None
    samplers: list[Sampler] = []
    try:
        samplers.append(JtopSampler(interval))
    except SamplerUnavailable as exc:
        where = "Jetson power rails, temperatures and EMC are not sampled" if jetson else "only useful on a Jetson"
        notice_once("jtop", f"{exc}; {where} ({JTOP_FIX}). Sampling CPU and memory from psutil or /proc.")
    samplers.append(PsutilSampler(pid))
    if not jetson and has_nvidia_gpu():
        try:
            samplers.append(NvmlSampler())
        except SamplerUnavailable as exc:
            notice_once("nvml", f"{exc}: GPU utilisation and power are not sampled")
    return samplers


class Monitor:
    """Samples every sampler every `interval` seconds on a daemon thread, into `rows`.

    One row is taken at start and one at stop, so even a run shorter than `interval` has two.
    A sampler that raises is reported once and dropped; the others continue.
    """

    def __init__(self, samplers: list[Sampler], interval: float = 0.5) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        self.samplers = list(samplers)
        self.sampler_names = [s.name for s in self.samplers]  # what ran, even if one is dropped later
        self.interval = interval
        self.rows: list[Row] = []
        self.t0 = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def sample_once(self) -> Row:
        now = time.time()
        row: Row = {"time": now, "elapsed_s": now - self.t0}
        with self._lock:
            for sampler in list(self.samplers):
                try:
                    row.update(sampler.sample())
                except Exception as exc:
                    notice_once(f"sampler-{sampler.name}", f"{sampler.name} sampling stopped: {exc}")
                    self.samplers.remove(sampler)
                    sampler.close()
            self.rows.append(row)
        return row

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample_once()

    def start(self) -> Monitor:
        self.t0 = time.time()
        self.sample_once()
        self._thread = threading.Thread(target=self._run, name="vismmoe-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.sample_once()
        for sampler in self.samplers:
            sampler.close()

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def write_csv(path: Path, rows: Iterable[dict[str, object]]) -> int:
    """Rows as CSV with the union of their fields (rails differ by board); returns the number of rows."""
    rows = list(rows)
    fields: dict[str, None] = {}
    for row in rows:
        fields.update(dict.fromkeys(row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields), restval="")
        writer.writeheader()
        writer.writerows(rows)
    return len(rows)
