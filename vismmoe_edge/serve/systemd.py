"""`vismmoe-edge install-service`: write the systemd unit and its environment file for this install.

The unit template below is the single source of truth: `systemd/vismmoe-edge.service` and
`systemd/vismmoe-edge.env` in the repository are `render_unit()` / `render_env()` with the defaults
(a test keeps them in sync). Placeholders are `@NAME@`, because `${VAR}` belongs to systemd.
Background: docs/platform-facts.md §3.6 (unit directives, sd_notify) and docs/platform-facts.md §1.4, §1.6.
"""

from __future__ import annotations

import grp
import os
import pwd
import shlex
import shutil
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

from vismmoe_edge.errors import VismmoeError

UNIT_NAME = "vismmoe-edge.service"
DEFAULT_UNIT_DIR = Path("/etc/systemd/system")
DEFAULT_ENV_FILE = Path("/etc/default/vismmoe-edge")
DEFAULT_EXECUTABLE = Path("/opt/vismmoe-edge/venv/bin/vismmoe-edge")
STATE_DIR = Path("/var/lib/vismmoe-edge")  # StateDirectory=: the service user's home and model store
CACHE_DIR = Path("/var/cache/vismmoe-edge")  # CacheDirectory=: the demo model, Hugging Face caches
DEFAULT_MODEL = STATE_DIR / "models/Qwen3-VL-30B-A3B-Instruct"
DEFAULT_LISTEN = "unix:/run/vismmoe-edge/api.sock"  # RuntimeDirectory=vismmoe-edge
DEFAULT_IMAGE_DIR = STATE_DIR / "images"  # StateDirectory=vismmoe-edge/images: local image paths come from here only
# video: Jetson's /dev/nvhost-*, /dev/nvmap and /dev/nvgpu/* are root:video 0660 (desktop /dev/nvidia* are 0666).
# jtop: /run/jtop.sock is root:jtop 0660 (docs/platform-facts.md §3.4).
DEFAULT_GROUPS = ("video", "jtop")


@dataclass(frozen=True)
class ServeSetting:
    """One `vismmoe-edge serve` option, fed from a variable of the environment file."""

    var: str
    flag: str
    default: str
    comment: str


# The `serve` options the unit passes. ExecStart uses ${VAR} (one argument each, even if empty).
SERVE_SETTINGS: tuple[ServeSetting, ...] = (
    ServeSetting(
        "VISMMOE_EDGE_MODEL",
        "--model",
        str(DEFAULT_MODEL),
        "Hugging Face model directory. Keep it OUTSIDE /home (ProtectHome=read-only) and owned by the service\n"
        "user: mincore() reports every page resident to non-owners and MADV_PAGEOUT is a no-op for them\n"
        "(docs/platform-facts.md §1.4), which blinds the expert cache.",
    ),
    ServeSetting(
        "VISMMOE_EDGE_MEMORY_BUDGET",
        "--memory-budget",
        "auto",
        "Expert bytes kept in memory: auto (the plan for this board and profile), a size (6GiB) or a share of\n"
        "all routed-expert bytes (40%). Keep budget + dense weights + KV cache + ~1 GiB below MemoryHigh=.\n"
        "The pinned prefix follows the plan; override it with --pinned-layers N in VISMMOE_EDGE_EXTRA_ARGS.",
    ),
    ServeSetting(
        "VISMMOE_EDGE_TIER",
        "--tier",
        "auto",
        "Cache slots: auto (the plan's), host, gpu, unified (the page cache), mmap.",
    ),
    ServeSetting(
        "VISMMOE_EDGE_PREDICTOR",
        "--predictor",
        "auto",
        "Prefetch: auto (the learned vismmoe-predictor.onnx beside the model if present, else none), none,\n"
        "learned, next-layer-gate, previous-token, or a .onnx file.",
    ),
    ServeSetting("VISMMOE_EDGE_POLICY", "--policy", "popularity", "Eviction: popularity or lru."),
    ServeSetting(
        "VISMMOE_EDGE_COMPRESSOR",
        "--compressor",
        "none",
        "Visual-token compression after the pinned prefix: none, random, saliency, zip, affinity.",
    ),
    ServeSetting("VISMMOE_EDGE_KEEP_RATIO", "--keep-ratio", "0.7", "Compression: share of visual tokens kept."),
    ServeSetting(
        "VISMMOE_EDGE_PROFILE",
        "--profile",
        "auto",
        "Board/power-mode profile for the plan: a name, or auto (this board's nvpmodel conf and current mode).\n"
        "The daemon never switches power modes; after an nvpmodel change, systemctl reload re-plans (SIGHUP).",
    ),
    ServeSetting(
        "VISMMOE_EDGE_LISTEN",
        "--listen",
        DEFAULT_LISTEN,
        "Where the API listens: unix:PATH (PATH under /run/vismmoe-edge, the RuntimeDirectory) or HOST:PORT,\n"
        "e.g. 127.0.0.1:8080, or 0.0.0.0:8080 to serve the robot's network.",
    ),
    ServeSetting(
        "VISMMOE_EDGE_IMAGE_DIR",
        "--image-dir",
        str(DEFAULT_IMAGE_DIR),
        "The one directory whose image files clients may name by path (file:///... or /abs/path); anything\n"
        "outside it is refused, and so is every symlink leading out. Empty: local paths off (data URLs only).\n"
        "More directories: --image-dir DIR in VISMMOE_EDGE_EXTRA_ARGS. Writers need group vismmoe and g+w on it.",
    ),
    ServeSetting("VISMMOE_EDGE_MAX_NEW_TOKENS", "--max-new-tokens", "512", "Request limit: tokens per reply."),
    ServeSetting("VISMMOE_EDGE_MAX_IMAGES", "--max-images", "8", "Request limit: images per request."),
    ServeSetting("VISMMOE_EDGE_MAX_QUEUE", "--max-queue", "8", "Request limit: requests waiting; more get HTTP 429."),
)

# Plain environment for the daemon (not options).
EXTRA_ENVIRONMENT: tuple[tuple[str, str, str], ...] = (
    ("VISMMOE_EDGE_CACHE", str(CACHE_DIR), "The demo model and sample image (CacheDirectory= makes it writable)."),
    ("HF_HOME", str(CACHE_DIR / "huggingface"), "transformers' caches; HOME-relative defaults are read-only here."),
    ("HF_HUB_OFFLINE", "1", "Robots are often offline: never wait on the Hub; the model is local."),
    (
        "TORCHINDUCTOR_CACHE_DIR",
        str(CACHE_DIR / "torchinductor"),
        "torch.compile's graphs and kernels (the decode layers): its default is under /tmp, which PrivateTmp=\n"
        "empties at every start, so each restart would compile them again before READY.",
    ),
    ("TRITON_CACHE_DIR", str(CACHE_DIR / "triton"), "Triton's kernels and autotuned picks, kept across restarts."),
    ("PYTHONUNBUFFERED", "1", "Log lines reach the journal as they are written."),
    ("PYTHONFAULTHANDLER", "1", "A watchdog SIGABRT dumps every thread's Python stack to the journal."),
    (
        "VISMMOE_EDGE_API_KEY",
        "",
        "If set, /v1/ requests need Authorization: Bearer <this key> (read from the environment, never argv,\n"
        "so ps does not show it; this file is written mode 0600). Empty: no key (the socket's group decides).",
    ),
    (
        "VISMMOE_EDGE_EXTRA_ARGS",
        "",
        "More `serve` options, split on spaces (ExecStart uses $VAR, not ${VAR}), e.g.\n"
        "--pinned-layers 4 --image-dir /var/lib/robot/frames --drain-timeout 30 --load-timeout 600",
    ),
)

UNIT_TEMPLATE = """\
# vismmoe-edge inference daemon. Generated by `vismmoe-edge install-service`; settings live in
# @ENV_FILE@ (edit that, then `systemctl restart vismmoe-edge`).
# Directives: docs/platform-facts.md §3.6; residency and mlock: docs/platform-facts.md §1.4, §1.6.

[Unit]
Description=vismmoe-edge vision-language MoE inference daemon
# nvpmodel sets the power mode and jtop.service provides telemetry; both are absent off a Jetson, which is fine.
After=network-online.target nvpmodel.service jtop.service
Wants=network-online.target
# These two belong in [Unit]: in [Service] they are ignored with a warning. 5 failed starts in 10 min stop the loop.
StartLimitIntervalSec=10min
StartLimitBurst=5

[Service]
# The daemon sends READY=1 once the model is mapped and warm, so `systemctl start` and units ordered after us wait
# for a usable API. NotifyAccess=main: only the daemon itself (not a helper child) may report.
Type=notify
NotifyAccess=main
EnvironmentFile=@ENV_FILE@
ExecStart=@EXEC_START@
# Loading validates and maps shards (minutes from an SD card or a cold NVMe). The daemon also asks for
# EXTEND_TIMEOUT_USEC (serve --load-timeout, 600 s by default) as it starts loading; past both, start fails.
TimeoutStartSec=10min
# SIGHUP re-plans from --profile (e.g. after an nvpmodel change); the daemon reports RELOADING=1, then READY=1.
ExecReload=/bin/kill -HUP $MAINPID
# The daemon pings WATCHDOG=1 as prefill and decode make progress (per layer step), not from a free-running thread,
# so a hung CUDA call or I/O stall trips it while a long prefill does not: systemd then sends SIGABRT
# (WatchdogSignal=) and Restart= brings it back.
WatchdogSec=30s
# SIGTERM drains in-flight requests for serve --drain-timeout (30 s by default): give it that plus the shutdown.
TimeoutStopSec=45s
# on-failure covers unclean exits, signals, start timeouts and the watchdog (on-watchdog covers only the last).
Restart=on-failure
RestartSec=5s
# Exit status 2 is a usage/configuration error (bad model path, bad option): restarting cannot fix it.
RestartPreventExitStatus=2

# A dedicated user that owns the model files: mincore() lies ("all resident") to non-owners and MADV_PAGEOUT is
# silently ignored for them (docs/platform-facts.md §1.4), which would blind the expert cache's residency checks.
User=@USER@
Group=@GROUP@
@GROUPS_LINE@
# mlock of the pinned tier (dense weights, pinned expert layers). Its size follows --memory-budget, so a fixed
# bound would have to track the budget; the cgroup limits below still cap it, because locked pages are charged to
# this unit. Without this line the kernel default is 64 KiB (JetPack 5/6) and mlock fails (docs/platform-facts.md §1.6).
LimitMEMLOCK=infinity

# cgroup v2 caps. They count the page cache, so the unified tier's expert pages are included (platform-facts.md §1.7).
# MemoryHigh throttles and reclaims (clean expert pages go first): the main control. MemoryMax OOM-kills: the last
# line. Size them for the module: budget + dense weights + KV cache + ~1 GiB, with MemoryMax ~1 GiB above. On an
# 8 GB Orin Nano (7.4 GiB visible) 75%/85% leaves ~1 GiB to the rest of the robot. JetPack 5 runs cgroup v1, where
# MemoryHigh= does nothing. Whether nvmap/CUDA allocations are charged on Tegra is unverified.
MemoryHigh=75%
MemoryMax=85%
# Expert weights are clean file pages and never swap; only anonymous memory (KV cache, heap) would.
# MemorySwapMax=0
# Our process is the largest and restartable: let the OOM killer take it before the robot's control stack.
OOMScoreAdjust=300
# Yield CPU to control loops, but favour our I/O: expert misses are reads on the decode path.
Nice=5
CPUWeight=50
IOWeight=200

# Directories systemd creates, owned by User=, writable even under ProtectSystem=strict:
#   /run/vismmoe-edge (the Unix socket), /var/lib/vismmoe-edge (home, models; images/ is --image-dir),
#   /var/cache/vismmoe-edge.
# If one exists with another owner, systemd chowns it recursively to User= at start (models placed there included).
RuntimeDirectory=vismmoe-edge
StateDirectory=vismmoe-edge vismmoe-edge/images
CacheDirectory=vismmoe-edge
# Socket clients need write permission on the socket: they join group vismmoe (usermod -aG vismmoe USER);
# others cannot reach /run/vismmoe-edge at all.
RuntimeDirectoryMode=0750
UMask=0007

# Hardening that leaves mmap, mlock and CUDA working.
NoNewPrivileges=yes
# No capabilities: LimitMEMLOCK= above is what mlock needs (instead of CAP_IPC_LOCK).
CapabilityBoundingSet=
# Other users' processes vanish from /proc; /proc/meminfo and /proc/self stay readable.
ProtectProc=invisible
# The whole file system is read-only except the directories above and ReadWritePaths=. Reading a model anywhere
# (and mincore on it) is unaffected: ownership, not writability, makes residency queries truthful.
ProtectSystem=strict
# Add writable places here, e.g. a directory for --trace-out files:
# ReadWritePaths=/data/vismmoe-traces
# read-only, not yes: a venv or model under /home stays readable (yes would hide it). Prefer /opt and /var/lib.
ProtectHome=read-only
PrivateTmp=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectHostname=yes
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
SystemCallArchitectures=native
# Deliberately absent:
#   MemoryDenyWriteExecute=  breaks CUDA's PTX JIT and PyTorch's generated kernels (they map W+X memory).
#   PrivateDevices=          hides /dev/nvhost-*, /dev/nvmap, /dev/nvgpu (Jetson) and /dev/nvidia* (desktop).
#   ProtectClock=, DeviceAllow=  any device allow-list blocks the GPU device nodes above.
#   ProcSubset=pid           hides /proc/meminfo, which memory planning reads (MemAvailable).
#   SystemCallFilter=        the CUDA driver's syscall set is not documented; a filter kills the process on a miss.

[Install]
WantedBy=multi-user.target
"""


@dataclass
class ServiceConfig:
    """Everything the unit and environment file depend on."""

    exec_prefix: list[str] = field(default_factory=lambda: [str(DEFAULT_EXECUTABLE)])  # argv before "serve"
    user: str = "vismmoe"
    group: str = "vismmoe"
    groups: tuple[str, ...] = DEFAULT_GROUPS
    env_file: Path = DEFAULT_ENV_FILE
    model: Path | None = DEFAULT_MODEL  # None: the built-in random demo model
    values: dict[str, str] = field(default_factory=dict)  # VAR -> value, over the settings' defaults

    def value(self, setting: ServeSetting) -> str:
        if setting.var == "VISMMOE_EDGE_MODEL":
            return "" if self.model is None else str(self.model)
        return self.values.get(setting.var, setting.default)


def _systemd_quote(word: str) -> str:
    """Quote one ExecStart word: systemd splits on spaces and honours C-style double quotes."""
    if word and not any(c in word for c in " \t\"\\'$%;"):
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$") + '"'


def exec_start(config: ServiceConfig) -> str:
    """The ExecStart= value, one option per continuation line."""
    parts = [" ".join([_systemd_quote(w) for w in config.exec_prefix] + ["serve"])]
    for setting in SERVE_SETTINGS:
        if setting.var == "VISMMOE_EDGE_MODEL" and config.model is None:
            continue  # no --model: serve loads the demo model
        parts.append(f"{setting.flag} ${{{setting.var}}}")
    parts.append("$VISMMOE_EDGE_EXTRA_ARGS")  # unbraced: split into words, nothing when empty
    return " \\\n    ".join(parts)


def render_unit(config: ServiceConfig | None = None) -> str:
    config = config or ServiceConfig()
    if config.groups:
        groups_line = f"SupplementaryGroups={' '.join(config.groups)}"
    else:
        groups_line = "# SupplementaryGroups=video jtop  (groups absent on this host when installed)"
    return (
        UNIT_TEMPLATE.replace("@ENV_FILE@", str(config.env_file))
        .replace("@EXEC_START@", exec_start(config))
        .replace("@USER@", config.user)
        .replace("@GROUP@", config.group)
        .replace("@GROUPS_LINE@", groups_line)
    )


def _comment(text: str) -> str:
    return "\n".join(f"# {line}" for line in text.splitlines())


def render_env(config: ServiceConfig | None = None) -> str:
    """The EnvironmentFile=: one VAR=value per line (systemd reads it itself; no shell expansion)."""
    config = config or ServiceConfig()
    lines = [
        "# vismmoe-edge daemon settings, read by vismmoe-edge.service (EnvironmentFile=).",
        "# After editing: sudo systemctl restart vismmoe-edge",
        "",
    ]
    for setting in SERVE_SETTINGS:
        lines.append(_comment(f"{setting.flag}: {setting.comment}"))
        value = config.value(setting)
        if setting.var == "VISMMOE_EDGE_MODEL" and config.model is None:
            lines.append("# (unset: the unit runs the built-in demo model, trained on Shapes-VQA only)")
            lines.append(f"# {setting.var}={DEFAULT_MODEL}")
        else:
            lines.append(f"{setting.var}={value}")
        lines.append("")
    lines.append("# Process environment")
    for var, default, comment in EXTRA_ENVIRONMENT:
        lines.append(_comment(comment))
        lines.append(f"{var}={config.values.get(var, default)}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# Installing
# --------------------------------------------------------------------------------------------------


def find_executable() -> list[str]:
    """argv that starts this install's CLI: the venv's console script, else `python -m vismmoe_edge.cli`.

    The venv's bin dir comes from sys.executable without resolving symlinks (that would leave the venv).
    """
    beside = Path(sys.executable).parent / "vismmoe-edge"
    if beside.is_file() and os.access(beside, os.X_OK):
        return [str(beside.absolute())]
    found = shutil.which("vismmoe-edge")
    if found:
        return [str(Path(found).absolute())]
    return [str(Path(sys.executable).absolute()), "-m", "vismmoe_edge.cli"]


def existing_groups(names: tuple[str, ...]) -> tuple[str, ...]:
    """The groups that exist here: a missing SupplementaryGroups= group fails the start (status 216/GROUP)."""
    present = []
    for name in names:
        try:
            grp.getgrnam(name)
        except KeyError:
            continue
        present.append(name)
    return tuple(present)


def user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def blocked_parent(path: Path) -> Path | None:
    """The first directory above `path` that other users cannot traverse (Ubuntu homes are 0750), else None."""
    for parent in reversed(path.absolute().parents):
        try:
            mode = parent.stat().st_mode
        except OSError:
            return None
        if not mode & stat.S_IXOTH:
            return parent
    return None


@dataclass
class InstallResult:
    unit_path: Path | None
    env_path: Path | None
    env_written: bool
    unit_text: str
    env_text: str
    warnings: list[str]
    next_steps: list[str]


def install_service(
    *,
    model: Path | None,
    dest: Path | None = None,
    user: str = "vismmoe",
    group: str | None = None,
    settings: dict[str, str] | None = None,
    exec_prefix: list[str] | None = None,
    force: bool = False,
    dry_run: bool = False,
) -> InstallResult:
    """Write the unit and environment file for this install; return them with the commands still to run.

    dest: None writes /etc/systemd/system/vismmoe-edge.service and /etc/default/vismmoe-edge; a directory writes
        both there (vismmoe-edge.service, vismmoe-edge.env) with EnvironmentFile= pointing at the one written.
    An existing environment file is kept unless `force`: it holds the operator's edits.
    """
    group = group or user
    unit_path = (dest or DEFAULT_UNIT_DIR) / UNIT_NAME
    env_path = (dest / "vismmoe-edge.env") if dest is not None else DEFAULT_ENV_FILE
    model = Path(model).expanduser().absolute() if model is not None else None
    config = ServiceConfig(
        exec_prefix=exec_prefix or find_executable(),
        user=user,
        group=group,
        groups=existing_groups(DEFAULT_GROUPS),
        env_file=env_path.absolute(),
        model=model,
        values=dict(settings or {}),
    )
    unit_text, env_text = render_unit(config), render_env(config)

    warnings: list[str] = []
    missing = [g for g in DEFAULT_GROUPS if g not in config.groups]
    if missing:
        warnings.append(
            f"group(s) {', '.join(missing)} do not exist here, so SupplementaryGroups= leaves them out "
            "(jtop: sudo jtop --install-service creates group jtop; reinstall the unit afterwards)"
        )
    for what, path in (("the executable", Path(config.exec_prefix[0])), ("the model", model)):
        if path is None:
            continue
        blocker = blocked_parent(path)
        if blocker is not None:
            warnings.append(
                f"{what} {path} is under {blocker}, which user {user} cannot enter; move it "
                f"(venv: /opt/vismmoe-edge/venv, model: {STATE_DIR}/models) or chmod o+x {blocker}"
            )
    if model is not None and str(model).startswith(("/home/", "/root/")):
        warnings.append(
            f"the model is under /{model.parts[1]}: ProtectHome=read-only keeps it readable, but it should be "
            f"owned by {user} for truthful residency; better: sudo mv it to {STATE_DIR}/models/"
        )

    env_written = False
    if not dry_run:
        try:
            unit_path.parent.mkdir(parents=True, exist_ok=True)
            unit_path.write_text(unit_text)
            env_path.parent.mkdir(parents=True, exist_ok=True)
            if force or not env_path.exists():
                env_path.write_text(env_text)
                env_path.chmod(0o600)  # it may hold VISMMOE_EDGE_API_KEY; systemd reads it as root
                env_written = True
        except PermissionError as e:
            raise VismmoeError(f"cannot write {e.filename}: run with sudo, or use --dest DIR") from e

    steps: list[str] = []
    if not user_exists(user):
        steps.append(
            f"sudo useradd --system --user-group --home-dir {STATE_DIR} --shell /usr/sbin/nologin {shlex.quote(user)}"
        )
    if model is not None:
        steps.append(
            f"sudo chown -R {shlex.quote(user)}:{shlex.quote(group)} {shlex.quote(str(model))}"
            "   # owner = truthful mincore (docs/platform-facts.md §1.4)"
        )
    if dest is not None:
        steps.append(f"sudo cp {shlex.quote(str(unit_path))} {DEFAULT_UNIT_DIR}/{UNIT_NAME}   # if staged with --dest")
    steps += [
        f"sudo systemd-analyze verify {DEFAULT_UNIT_DIR}/{UNIT_NAME}",
        "sudo systemctl daemon-reload",
        "sudo systemctl enable --now vismmoe-edge",
        "systemctl status vismmoe-edge",
        "journalctl -u vismmoe-edge -f",
    ]
    return InstallResult(
        unit_path=None if dry_run else unit_path,
        env_path=None if dry_run else env_path,
        env_written=env_written,
        unit_text=unit_text,
        env_text=env_text,
        warnings=warnings,
        next_steps=steps,
    )


