"""A guard on this process's name lookups and connections: loopback and unix sockets pass, everything else is
refused and recorded, so that no test (and no library a test drives, a tracker's telemetry included) reaches
another host unnoticed.

It wraps ``socket.getaddrinfo`` and ``socket.socket.connect`` / ``connect_ex`` (``socket.create_connection``,
``requests``, ``urllib3`` and asyncio's ``sock_connect`` all go through them). Allowed: no host (a passive or
local lookup), ``localhost``, a numeric loopback address (127.0.0.0/8, ::1, an IPv4-mapped 127.x), the
unspecified address (0.0.0.0, ::: a bind, or on Linux this machine itself) and unix sockets (AF_UNIX).
It sees only this Python process: a subprocess, or a library's own native code (gRPC's C core, a Go binary),
is not covered; tests that start one guard it there themselves (:func:`install` in the child).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import threading
from dataclasses import dataclass

#: host names that name this machine's loopback
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


@dataclass(frozen=True)
class Attempt:
    """One refused lookup or connection: what was tried (``lookup`` or ``connect``) and the host."""

    kind: str
    host: str
    port: object = None

    def __str__(self) -> str:
        return f"{self.kind} {self.host}" + ("" if self.port in (None, "", 0) else f":{self.port}")


class NetworkRefused(ConnectionRefusedError):
    """A connection outside loopback, refused by the test suite's network guard."""


_lock = threading.Lock()
#: every refused attempt since the last :func:`take` (shared by all threads of the process)
attempts: list[Attempt] = []
_installed: dict[str, object] = {}


def is_local(host: object) -> bool:
    """Whether ``host`` (a name, a numeric address, bytes or None) is this machine's loopback."""
    if host is None:
        return True
    if isinstance(host, (bytes, bytearray)):
        host = bytes(host).decode("ascii", "replace")
    text = str(host).strip().rstrip(".").lower()
    if text in ("", *LOOPBACK_NAMES) or text.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(text.split("%", 1)[0].strip("[]"))
    except ValueError:
        return False  # a name other than localhost: a lookup that may leave the machine
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or address.is_unspecified or bool(mapped and mapped.is_loopback)


def _record(kind: str, host: object, port: object) -> Attempt:
    attempt = Attempt(kind, str(host), port)
    with _lock:
        attempts.append(attempt)
    return attempt


def take() -> list[Attempt]:
    """The attempts recorded so far, and the record emptied."""
    with _lock:
        taken = list(attempts)
        attempts.clear()
    return taken


def install() -> None:
    """Wrap the socket functions (once per process; a second call does nothing)."""
    if _installed:
        return
    real_getaddrinfo = socket.getaddrinfo
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def getaddrinfo(host, port, *args, **kwargs):
        if not is_local(host):
            attempt = _record("lookup", host, port)
            raise socket.gaierror(socket.EAI_NONAME, f"the test suite's network guard refused the {attempt} "
                                                     "(only loopback is allowed in tests)")
        return real_getaddrinfo(host, port, *args, **kwargs)

    def refused(sock: socket.socket, address) -> NetworkRefused | None:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or not isinstance(address, tuple):
            return None  # AF_UNIX and the other local families
        if is_local(address[0]):
            return None
        attempt = _record("connect", address[0], address[1] if len(address) > 1 else None)
        return NetworkRefused(f"the test suite's network guard refused the {attempt} (only loopback is allowed "
                              "in tests)")

    def connect(self, address):
        error = refused(self, address)
        if error is not None:
            raise error
        return real_connect(self, address)

    def connect_ex(self, address):
        if refused(self, address) is not None:
            return errno.ECONNREFUSED  # as connect_ex reports a refusal
        return real_connect_ex(self, address)

    socket.getaddrinfo = getaddrinfo
    socket.socket.connect = connect
    socket.socket.connect_ex = connect_ex
    _installed.update(getaddrinfo=real_getaddrinfo, connect=real_connect, connect_ex=real_connect_ex)
