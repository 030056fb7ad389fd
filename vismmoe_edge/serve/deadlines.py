"""Deadlines on reading a request: its headers, then its body, must arrive in time, however slowly they trickle.

A socket timeout bounds one read; a client that sends one byte a second never trips it and holds its thread
(and a connection slot) for ever. So the handler reads through DeadlineReader, which gives each read only the
time left until the phase's deadline: --header-timeout from the moment the handler waits for a request line,
--body-timeout once the headers are in. Past it the read raises DeadlinePassed (a TimeoutError), which the
handler answers with 408 and a closed connection.
"""

from __future__ import annotations

import io
import socket
import time


class DeadlinePassed(TimeoutError):
    """A request's headers or body did not arrive before its deadline."""


class DeadlineReader(io.RawIOBase):
    """The raw stream under the handler's rfile: socket reads bounded by the current phase's deadline."""

    def __init__(self, sock: socket.socket, idle_timeout: float | None) -> None:
        self.sock = sock
        self.idle_timeout = idle_timeout  # the socket's own timeout, restored after each read (writes use it)
        self.deadline: float | None = None  # time.monotonic()
        self.phase = ""
        self.received = 0  # bytes read in this phase
        self.expired = False

    def start(self, phase: str, seconds: float | None) -> None:
        self.phase = phase
        self.deadline = None if seconds is None else time.monotonic() + seconds
        self.received = 0
        self.expired = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                self.expired = True
                raise DeadlinePassed(f"the request's {self.phase} did not arrive in time")
            self.sock.settimeout(left if self.idle_timeout is None else min(left, self.idle_timeout))
        try:
            n = self.sock.recv_into(buffer)
        except TimeoutError:
            if self.deadline is not None and time.monotonic() >= self.deadline:
                self.expired = True
                raise DeadlinePassed(f"the request's {self.phase} did not arrive in time") from None
            raise
        finally:
            self.sock.settimeout(self.idle_timeout)
        self.received += n
        return n
