"""Which Jetson power mode is running, by NAME and parsed limits: never by numeric id.

Sources, in order (docs/platform-facts.md §3.3): ``/var/lib/nvpmodel/status`` (``pmode:000N``, written on a mode
change), then ``nvpmodel -q`` (only on the live system and only when the binary exists), then the
conf's ``PM_CONFIG DEFAULT`` (the mode that applies when nobody ever switched). The id from those
sources is only an index into this device's own ``/etc/nvpmodel.conf``: the same id means different
modes on different modules and releases (docs/platform-facts.md §3.3).

Every reader takes ``root`` so that tests point it at a fixture tree (tests/fixtures/boards/<board>/).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from vismmoe_edge.errors import VismmoeError

CONF_PATH = "etc/nvpmodel.conf"
STATUS_PATH = "var/lib/nvpmodel/status"

Setting = int | str

_POWER_MODEL = re.compile(r"<\s*POWER_MODEL\s+ID=(\d+)\s+NAME=(\S+?)\s*>")
_PM_CONFIG = re.compile(r"<\s*PM_CONFIG\s+DEFAULT=(\d+)")
_STATUS = re.compile(r"pmode:\s*(\d+)")
_QUERY_NAME = re.compile(r"NV Power Mode:\s*(\S+)")
_TPC_BITS = 8  # TPC_PG_MASK: a set bit = a power-gated TPC, over 8 bit positions (docs/platform-facts.md §3.2)


@dataclass(frozen=True)
class ModeLimits:
    """The limits a mode sets. ``None`` = no cap (the conf's -1, or 0 for EMC): the hardware maximum."""

    cpu_online: int | None
    cpu_max_freq_mhz: float | None
    gpu_max_freq_mhz: float | None
    gpu_tpcs: int | None
    emc_max_freq_mhz: float | None

    def describe(self) -> str:
        def mhz(v: float | None) -> str:
            return "max" if v is None else f"{v:g} MHz"

        return (
            f"{self.cpu_online if self.cpu_online is not None else '?'} cores at {mhz(self.cpu_max_freq_mhz)}, "
            f"GPU {mhz(self.gpu_max_freq_mhz)} x {self.gpu_tpcs if self.gpu_tpcs is not None else '?'} TPC, "
            f"EMC {mhz(self.emc_max_freq_mhz)}"
        )


@dataclass(frozen=True)
class PowerMode:
    id: int
    name: str
    settings: dict[tuple[str, str], Setting] = field(default_factory=dict)

    @property
    def limits(self) -> ModeLimits:
        return limits_from_settings(self.settings)


@dataclass(frozen=True)
class NvpmodelConf:
    path: Path
    target: str  # basename of the symlink's target, e.g. "nvpmodel_p3767_0000_super.conf" (docs/platform-facts.md §3.3)
    modes: dict[int, PowerMode]
    default_id: int | None

    def by_name(self, name: str) -> PowerMode | None:
        return next((m for m in self.modes.values() if m.name == name), None)

    @property
    def is_super(self) -> bool:
        """The conf of a JetPack 6.2 "Super" variant: its basename ends in _super, or it has MAXN_SUPER."""
        return self.target.endswith("_super.conf") or self.by_name("MAXN_SUPER") is not None


@dataclass(frozen=True)
class RunningMode:
    name: str
    id: int | None
    limits: ModeLimits | None  # None when the conf could not be read (nvpmodel -q gives only the name)
    source: str  # where the mode came from: the status file, "nvpmodel -q" or "PM_CONFIG DEFAULT"
    conf: NvpmodelConf | None
    notes: tuple[str, ...] = ()  # sources that were tried and disagreed or failed


# --------------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------------


def parse_conf(text: str) -> tuple[dict[int, PowerMode], int | None]:
    """({id: PowerMode}, default id) from nvpmodel.conf text (the grammar of docs/platform-facts.md §3.3)."""
    modes: dict[int, PowerMode] = {}
    default: int | None = None
    current: PowerMode | None = None
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if match := _POWER_MODEL.match(line):
            current = modes.setdefault(int(match[1]), PowerMode(int(match[1]), match[2]))
        elif match := _PM_CONFIG.match(line):
            default, current = int(match[1]), None
        elif line.startswith("<"):
            current = None  # PARAM blocks map names to sysfs paths: not settings
        elif current is not None and len(parts := line.split()) == 3:
            value = parts[2]
            current.settings[(parts[0], parts[1])] = int(value) if value.lstrip("-").isdigit() else value
    return modes, default


def _to_mhz(value: int) -> float:
    # Units differ by line: CPU MAX_FREQ is in kHz (cpufreq), GPU and EMC in Hz [I: every conf in
    # jetson.md's sources]; a bare MHz figure is accepted too. Decided by magnitude.
    if value >= 10_000_000:
        return value / 1e6
    if value >= 10_000:
        return value / 1e3
    return float(value)


def _cap(value: Setting | None, *, zero_is_uncapped: bool = False) -> float | None:
    if not isinstance(value, int) or value < 0 or (zero_is_uncapped and value == 0):
        return None  # -1 = INT_MAX = the hardware maximum (docs/platform-facts.md §3.2); EMC uses 0 too (§3.1)
    return _to_mhz(value)


def limits_from_settings(settings: dict[tuple[str, str], Setting]) -> ModeLimits:
    """Cores online, CPU / GPU / EMC caps and powered TPCs from one POWER_MODEL block's settings."""
    online = [v for (group, _), v in settings.items() if group == "CPU_ONLINE"]
    cpu_online = sum(1 for v in online if v == 1) if online else None
    cpu_caps = [v for (group, key), v in settings.items() if group.startswith("CPU_") and key == "MAX_FREQ"]
    if not cpu_caps:
        cpu_max = None
    elif any(not isinstance(v, int) or v < 0 for v in cpu_caps):
        cpu_max = None  # one uncapped cluster: the mode's CPU maximum is the hardware's
    else:
        cpu_max = max(_to_mhz(int(v)) for v in cpu_caps)
    mask = settings.get(("TPC_POWER_GATING", "TPC_PG_MASK"))
    tpcs = _TPC_BITS - bin(mask & 0xFF).count("1") if isinstance(mask, int) else None
    return ModeLimits(
        cpu_online=cpu_online,
        cpu_max_freq_mhz=cpu_max,
        gpu_max_freq_mhz=_cap(settings.get(("GPU", "MAX_FREQ"))),
        gpu_tpcs=tpcs,
        emc_max_freq_mhz=_cap(settings.get(("EMC", "MAX_FREQ")), zero_is_uncapped=True),
    )


def parse_status(text: str) -> int | None:
    """The mode id in /var/lib/nvpmodel/status ("pmode:0002 fmode:quiet"), or None."""
    match = _STATUS.search(text)
    return None if match is None else int(match[1])


def parse_query(text: str) -> tuple[str | None, int | None]:
    """(name, id) from ``nvpmodel -q``: "NV Power Mode: MODE_30W" then the id on the next line."""
    match = _QUERY_NAME.search(text)
    if match is None:
        return None, None
    rest = text[match.end() :].split()
    mode_id = int(rest[0]) if rest and rest[0].isdigit() else None
    return match[1], mode_id


# --------------------------------------------------------------------------------------------------
# Reading a system (or fixture) tree
# --------------------------------------------------------------------------------------------------


def read_conf(root: Path = Path("/")) -> NvpmodelConf | None:
    """This device's nvpmodel.conf; None when absent (not a Jetson, or a container without it)."""
    path = root / CONF_PATH
    if not path.exists():
        return None
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        raise VismmoeError(f"cannot read {path} ({e.strerror}): make it readable or pass --profile NAME") from e
    target = os.path.basename(os.readlink(path)) if path.is_symlink() else path.name
    modes, default = parse_conf(text)
    if not modes:
        raise VismmoeError(f"{path} has no POWER_MODEL blocks: pass --profile NAME")
    return NvpmodelConf(path=path, target=target, modes=modes, default_id=default)


def read_status(root: Path = Path("/")) -> int | None:
    """The id nvpmodel last set, or None when the file is absent or unreadable (the default applies)."""
    try:
        return parse_status((root / STATUS_PATH).read_text(errors="replace"))
    except OSError:
        return None


def query_nvpmodel(root: Path = Path("/"), timeout_s: float = 5.0) -> tuple[str | None, int | None] | None:
    """``nvpmodel -q`` on the live system; None for fixture roots, without the binary, or on failure.

    Often needs sudo (docs/platform-facts.md §3.3), so nothing depends on it.
    """
    if root.resolve() != Path("/"):
        return None
    binary = shutil.which("nvpmodel")
    if binary is None:
        return None
    try:
        done = subprocess.run([binary, "-q"], capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    name, mode_id = parse_query(done.stdout)
    return None if name is None else (name, mode_id)


def running_mode(root: Path = Path("/")) -> RunningMode | None:
    """The running mode's NAME and parsed limits; None when no source says anything (not a Jetson)."""
    conf = read_conf(root)
    notes: list[str] = []
    status_id = read_status(root)
    if status_id is not None:
        mode = conf.modes.get(status_id) if conf else None
        if mode is not None:
            return RunningMode(mode.name, mode.id, mode.limits, str(root / STATUS_PATH), conf)
        notes.append(f"{root / STATUS_PATH} names mode id {status_id}, which the conf does not define")
    query = query_nvpmodel(root)
    if query is not None:
        name, mode_id = query
        mode = conf.by_name(name) if conf and name else None
        return RunningMode(name or "", mode_id, mode.limits if mode else None, "nvpmodel -q", conf, tuple(notes))
    if conf is not None and conf.default_id in conf.modes:
        mode = conf.modes[conf.default_id]
        return RunningMode(mode.name, mode.id, mode.limits, "PM_CONFIG DEFAULT", conf, tuple(notes))
    return None
