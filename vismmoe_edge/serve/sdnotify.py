"""sd_notify(3) without a dependency: one datagram of `KEY=VALUE` lines to `$NOTIFY_SOCKET`.

Every function is a no-op returning False when the process is not run by systemd (no `$NOTIFY_SOCKET`).
A send that fails is logged, never raised: a daemon must not die because its supervisor's socket hiccuped.
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger(__name__)
_warned = False  # log the first failed send as a warning, later ones at debug level (watchdog pings repeat)


def _address() -> str | None:
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return None
    if addr[0] == "@":  # abstract namespace: the kernel name starts with a NUL byte
        return "\0" + addr[1:]
    return addr


def send(message: str) -> bool:
    """Send a raw notification; True if it was delivered to a socket."""
    global _warned
    addr = _address()
    if addr is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.setblocking(False)  # a reader that fell behind must not stall the decode loop that pings it
            s.connect(addr)
            s.sendall(message.encode())
    except OSError as e:
        level = logging.DEBUG if _warned else logging.WARNING
        _warned = True
        log.log(level, "sd_notify to %r failed: %s", os.environ.get("NOTIFY_SOCKET"), e)
        return False
    return True


def notify(**fields: str | int) -> bool:
    """notify(READY=1, STATUS="serving") sends "READY=1\\nSTATUS=serving"; newlines in values become spaces."""
    lines = [f"{key}={str(value).replace(chr(10), ' ')}" for key, value in fields.items()]
    return send("\n".join(lines)) if lines else False


def ready(status_text: str | None = None) -> bool:
    return notify(READY=1, STATUS=status_text) if status_text else notify(READY=1)


def status(text: str) -> bool:
    return notify(STATUS=text)


def watchdog() -> bool:
    return notify(WATCHDOG=1)


def extend_timeout(usec: int) -> bool:
    """Ask for `usec` more microseconds to start (or stop); send it again before it runs out."""
    return notify(EXTEND_TIMEOUT_USEC=int(usec))


def reloading() -> bool:
    """Start of a reload; send ready() when done. MONOTONIC_USEC is what Type=notify-reload requires."""
    return notify(RELOADING=1, MONOTONIC_USEC=int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6))


def stopping() -> bool:
    return notify(STOPPING=1)


def watchdog_interval() -> float | None:
    """Seconds between watchdog pings (half of `WatchdogSec=`), or None when the watchdog is not for us."""
    usec, pid = os.environ.get("WATCHDOG_USEC"), os.environ.get("WATCHDOG_PID")
    if not usec or not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid.isdigit() and int(pid) != os.getpid():
        return None  # exported to a parent that exec'd us, or inherited by a child
    return int(usec) / 2e6
