"""The Linux network namespaces of :mod:`fedhpro.deploy.up`: made, entered and checked through raw syscalls.

A :class:`Namespace` is held open by file descriptors of the ``up`` process: the SuperLink and each node run in
one of their own, so that no other local user reaches their 127.0.0.1 listeners (Flower 1.42 takes no Unix
socket; see :data:`fedhpro.deploy.up.NO_UNIX_SOCKETS`).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def loopback_up() -> None:
    """Bring ``lo`` up in the calling process's network namespace (a new one has it down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        request = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(probe, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(probe, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))


@dataclass
class Namespace:
    """A private network namespace (inside a user namespace of ours when not root), held open by file
    descriptors of this process: its processes see only its own loopback, and other local users can
    neither connect into it nor enter it (entering needs root, or our uid owning its user namespace)."""

    name: str
    net: int
    user: int | None = None

    def enter(self) -> None:
        """Move the calling process into the namespace (in a child, between fork and exec)."""
        libc = _libc()
        for fd, kind in ((self.user, CLONE_NEWUSER), (self.net, CLONE_NEWNET)):
            if fd is not None and libc.setns(fd, kind) != 0:
                error = ctypes.get_errno()
                raise OSError(error, f"setns into {self.name}: {os.strerror(error)}")

    def close(self) -> None:
        for fd in (self.net, self.user):
            if fd is not None:
                os.close(fd)


def new_namespace(name: str) -> Namespace:
    """A new :class:`Namespace` with ``lo`` up, made by a short-lived child; OSError (its reason) when the
    system refuses (no unshare, or unprivileged user namespaces turned off)."""
    rootless = os.geteuid() != 0
    uid, gid = os.getuid(), os.getgid()
    status_read, status_write = os.pipe()
    hold_read, hold_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: unshare, report, wait until the parent holds the namespace, exit
        os.close(status_read)
        os.close(hold_write)
        code = 0
        try:
            if _libc().unshare(CLONE_NEWNET | (CLONE_NEWUSER if rootless else 0)) != 0:
                raise OSError(ctypes.get_errno(), "unshare")
            if rootless:  # our uid/gid stay ours inside: nothing runs as root there
                Path("/proc/self/setgroups").write_text("deny")
                Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
                Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")
            loopback_up()
            os.write(status_write, b"ok")
        except OSError as error:
            os.write(status_write, f"{error.strerror or error}".encode()[:200])
            code = 1
        except BaseException:  # noqa: BLE001  # a forked child must never return into the caller
            code = 2
        finally:
            os.close(status_write)
            if code == 0:
                os.read(hold_read, 1)
            os._exit(code)
    os.close(status_write)
    os.close(hold_read)
    try:
        reply = os.read(status_read, 256).decode(errors="replace")
        if reply != "ok":
            raise OSError(f"unshare(CLONE_NEWNET{'|CLONE_NEWUSER' if rootless else ''}) refused: "
                          f"{reply or 'the child died'}")
        net = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        user = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC) if rootless else None
        return Namespace(name, net, user)
    finally:
        os.close(status_read)
        os.close(hold_write)
        os.waitpid(pid, 0)


def in_namespace(namespace: Namespace | None, check: Callable[[], bool]) -> bool:
    """``check()`` run in ``namespace`` (a forked child; at once in this process for None)."""
    if namespace is None:
        return check()
    pid = os.fork()
    if pid == 0:
        ok = False
        try:
            namespace.enter()
            ok = check()
        finally:
            os._exit(0 if ok else 1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
