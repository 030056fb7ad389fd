"""Who may talk to the daemon: the Host and Origin checks that keep web pages out, and the optional bearer token.

A web page the user visits can make the browser send requests to 127.0.0.1. Three checks stop that, as in
llama-server, Jupyter and Ollama: a request that names a foreign Host (DNS rebinding: attacker.example resolving
to 127.0.0.1) is refused; any request carrying an Origin (browsers send one with every cross-site POST) is
refused unless the operator allowed it with --allowed-origin; and POST bodies must be application/json, which a
page cannot send cross-site without a CORS preflight, which we answer only for allowed origins.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.serve.protocol import ApiError

LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")


def parse_origin(text: str) -> str:
    """--allowed-origin: "*" or scheme://host[:port], as a browser sends it in Origin (lower case, no path)."""
    if text == "*":
        return text
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") or parts.query:
        raise VismmoeError(f"--allowed-origin {text!r}: use scheme://host[:port], e.g. http://localhost:3000, or *")
    port = f":{parts.port}" if parts.port else ""
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host.lower()}{port}"


def host_name(header: str) -> str:
    """The name in a Host header, without port and brackets."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class HttpPolicy:
    allowed_origins: tuple[str, ...] = ()
    api_key: str | None = None
    check_host: bool = True  # off on a Unix socket: no browser can reach one
    loopback_only: bool = True  # bound to a loopback address: only loopback names are ours
    own_names: frozenset[str] = field(default_factory=frozenset)  # this machine's names, when not loopback only

    @classmethod
    def for_listener(
        cls, host: str, unix_socket: object, allowed_origins: tuple[str, ...], api_key: str | None
    ) -> HttpPolicy:
        loopback = host in LOOPBACK_NAMES or (is_ip_literal(host) and ipaddress.ip_address(host).is_loopback)
        names: set[str] = set()
        if not loopback:
            names |= {socket.gethostname().lower(), socket.getfqdn().lower(), host.lower()}
            names |= {f"{n.split('.')[0]}.local" for n in list(names) if n}
        return cls(
            allowed_origins=tuple(allowed_origins),
            api_key=api_key or None,
            check_host=unix_socket is None,
            loopback_only=loopback,
            own_names=frozenset(n for n in names if n),
        )

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin.lower().rstrip("/") in self.allowed_origins

    def host_allowed(self, header: str | None) -> bool:
        if not self.check_host or header is None:  # HTTP/1.0 clients may omit Host; browsers never do
            return True
        name = host_name(header)
        if name in LOOPBACK_NAMES or name.endswith(".localhost"):
            return True
        if is_ip_literal(name):  # an address cannot be rebound; off loopback any of ours may be used
            return ipaddress.ip_address(name).is_loopback or not self.loopback_only
        allowed = {host_name(urlsplit(o).netloc) for o in self.allowed_origins if o != "*"}
        return name in allowed or name in self.own_names

    def check(self, host: str | None, origin: str | None, authorization: str | None, path: str) -> None:
        """Refuse (403, 401) what may not be served; CORS preflights are checked by the handler."""
        if not self.host_allowed(host):
            raise ApiError(
                403,
                f"Host {host_name(host or '')!r} is not this server's: requests through another name are refused "
                "(DNS rebinding); add it with --allowed-origin if it is yours",
                type="permission_error",
                code="forbidden_host",
            )
        if origin is not None and not self.origin_allowed(origin):
            raise ApiError(
                403,
                "cross-origin requests are refused: browsers may not use this API unless the operator allows the "
                "origin with --allowed-origin",
                type="permission_error",
                code="forbidden_origin",
            )
        if self.api_key and path.startswith("/v1/") and not self.token_ok(authorization):
            raise ApiError(
                401,
                "a valid API key is required: send Authorization: Bearer <key>",
                type="authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": 'Bearer realm="vismmoe-edge"'},
            )

    def token_ok(self, authorization: str | None) -> bool:
        scheme, _, token = (authorization or "").partition(" ")
        expected = (self.api_key or "").encode()
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), expected)
