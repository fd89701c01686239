"""Files written whole or not at all: the one atomic writer every result, checkpoint and cache file uses.

The bytes go to a new temporary file beside the target (same folder, hence
the same file system, where :func:`os.replace` is atomic), are flushed to
disk, then replace the target in one step. A reader sees the old file or the
new one, never half of one; a write that fails or is interrupted leaves the
old file and removes its temporary file.

The file gets the mode a plain ``open(path, "w")`` gives, ``0o666`` less the
umask (``tempfile.mkstemp`` would give ``0o600``: results in a shared folder
would be unreadable to the group).

It also claims a run's folder for the life of the run (:func:`claim_run_folder`):
two runs writing into one ``out=`` would mix their files.

Every JSON file fedhpro writes is strict JSON (:func:`strict_json`).

This module sits below everything else in fedhpro (it imports only
:mod:`fedhpro.errors`, which imports nothing), so data, engines and reports
can all use it.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from fedhpro.errors import ConfigError

#: what a new file's mode starts from before the umask, as ``open(path, "w")`` does
NEW_FILE_MODE = 0o666


def _temporary_beside(path: Path) -> Path:
    """A name beside ``path`` that no other writer (process or thread) picks: hidden, marked ``.tmp``."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


#: the names :func:`_temporary_beside` gives
_TEMPORARY = re.compile(r"^\..+\.\d+\.[0-9a-f]{8}\.tmp$")


def remove_partial_writes(folder: str | os.PathLike) -> list[Path]:
    """Remove the temporary files that writers killed mid-write (SIGKILL, power loss) left in ``folder``
    (not below it); the removed paths. Only for a folder no other process writes: a claimed run folder."""
    folder = Path(folder)
    removed: list[Path] = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for path in entries:
        if _TEMPORARY.match(path.name) and path.is_file():
            try:
                path.unlink()
                removed.append(path)
            except OSError:
                pass
    return removed


def write_atomic_with(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> None:
    """Call ``write(handle)`` (its return value is ignored) on a new temporary file beside ``path`` (binary,
    mode ``0o666`` less the umask), flush it to disk and ``os.replace`` it onto ``path``; on any failure the
    temporary file is removed and ``path`` keeps its previous content. The folder is created if needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = _temporary_beside(path)
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0),
                         NEW_FILE_MODE)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise


def strict_json(value: Any, **dumps: Any) -> str:
    """``json.dumps(value, **dumps)`` as strict JSON: a float that is NaN or infinite (a measurement that has
    no finite value: a loss that diverged, an epsilon before any round) is written as ``null``, never as the
    ``NaN`` / ``Infinity`` that Python writes and strict parsers (JavaScript, jq, Go, ...) refuse. Text with
    finite floats only is byte for byte what ``json.dumps`` writes."""
    try:
        return json.dumps(value, allow_nan=False, **dumps)
    except ValueError:  # a non-finite float somewhere: written as null
        return json.dumps(finite_or_none(value), allow_nan=False, **dumps)


def finite_or_none(value: Any) -> Any:
    """``value`` with every float that is NaN or infinite (in lists, tuples and dict values, at any depth)
    replaced by None: what a strict JSON writer writes for a measurement that has no finite value."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(item) for item in value]
    return value


#: how a spreadsheet recognises a formula (OWASP's CSV injection list): a cell starting with one of these
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def spreadsheet_cell(value: Any) -> Any:
    """A CSV cell that a spreadsheet shows as text: text starting like a formula (``=HYPERLINK(...)``, ``@SUM``,
    ``-2+3``) gets a leading ``'``, as OWASP recommends; a number (``-0.5``, ``+1e3``) and anything not text
    stay as they are."""
    if not isinstance(value, str) or not value.startswith(FORMULA_STARTS):
        return value
    try:
        float(value)
    except ValueError:
        return "'" + value
    return value


def write_atomic(path: str | os.PathLike, content: str | bytes) -> None:
    """Write ``content`` (text as UTF-8, or bytes) to ``path`` atomically (:func:`write_atomic_with`)."""
    data = content.encode("utf-8") if isinstance(content, str) else bytes(content)
    write_atomic_with(path, lambda handle: handle.write(data))


#: the lock file of a claimed run folder; hidden (a leading dot), so listings, reports and resume pass it by
LOCK_NAME = ".fedhpro.lock"


class RunFolderInUse(ConfigError):
    """The run folder is claimed by another live run (its pid, host and start time are in the message)."""


class RunFolderClaim:
    """An exclusive claim on a run folder, held for the life of a run (:func:`claim_run_folder`).

    The claim is an ``fcntl.flock(LOCK_EX)`` on an open descriptor of the
    folder's :data:`LOCK_NAME`: the operating system drops it when the process
    ends, however it ends, so a crashed run never leaves its folder claimed.
    :meth:`release` (or leaving the ``with`` block) removes the lock file and
    drops the claim; it may be called more than once.
    """

    def __init__(self, folder: Path, descriptor: int | None, created: list[Path]):
        self.folder = folder
        self.lock_path = folder / LOCK_NAME
        self._descriptor = descriptor
        self._created = created  # the folders the claim made, innermost first

    @property
    def held(self) -> bool:
        """Whether this claim still holds the folder."""
        return self._descriptor is not None

    def release(self) -> None:
        """Drop the claim: the lock file goes, then the lock; the folders the claim made that nothing else
        filled go too (a run that failed before writing anything leaves no empty folder behind)."""
        descriptor, self._descriptor = self._descriptor, None
        if descriptor is None:
            return
        try:
            try:
                if os.path.samestat(os.fstat(descriptor), os.stat(self.lock_path)):
                    os.unlink(self.lock_path)  # while still locked: nobody holds a claim on this file
            except OSError:
                pass
        finally:
            os.close(descriptor)  # drops the flock
        for made in self._created:
            try:
                made.rmdir()  # only if empty
            except OSError:
                break

    def __enter__(self) -> RunFolderClaim:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"RunFolderClaim({str(self.folder)!r}, held={self.held})"


def _holder(lock_path: Path) -> str:
    """``run pid 123 on host h since 2026-12-01 16:05:00 UTC`` from a held lock file (the holder writes it
    just after locking: read a few times before settling for less)."""
    for attempt in range(5):
        try:
            with open(lock_path, "rb") as handle:
                info = json.loads(handle.read(4096))  # a record is one short line: no more is read
            return (f"run pid {int(info['pid'])} on host {info['host']} since "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(float(info['started'])))}")
        except (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError):
            time.sleep(0.02 * (attempt + 1))
    return "another run"


def claim_run_folder(path: Path, *, setting: str = "out") -> RunFolderClaim:
    """Claim the run folder ``path`` exclusively for the life of a run: the folder is made if needed and its
    lock file :data:`LOCK_NAME` (pid, host and start time, for the message another run gets) is locked with
    ``fcntl.flock(LOCK_EX | LOCK_NB)`` on a descriptor the returned claim keeps open. Use it as a context
    manager, or call :meth:`RunFolderClaim.release` when the run ends; a process that dies releases it too.

    Raises :class:`RunFolderInUse` (a one-line :class:`~fedhpro.errors.ConfigError`) while another run holds
    the folder: ``out=X is in use by run pid 123 on host h since ...; wait for it or choose another out=``;
    and a ConfigError when ``path`` is a file or cannot be written. ``setting`` names the key in messages
    (``out``, ``resume``). On a file system without locks (some network mounts) the folder is not claimed.
    """
    folder = Path(path)
    where = f"{setting}={folder}"
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{where} is a file, not a folder; give a folder (new or of an earlier run)")
    created = [parent for parent in (folder, *folder.parents) if not parent.exists()]
    lock_path = folder / LOCK_NAME
    try:
        folder.mkdir(parents=True, exist_ok=True)
        while True:
            descriptor = os.open(lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), NEW_FILE_MODE)
            try:
                if not _lock(descriptor):
                    raise RunFolderInUse(f"{where} is in use by {_holder(lock_path)}; wait for it or choose "
                                         f"another {setting}=")
                try:
                    current = os.stat(lock_path)
                except FileNotFoundError:
                    current = None
                if current is None or not os.path.samestat(os.fstat(descriptor), current):
                    os.close(descriptor)  # its holder released it (and removed it) between our open and lock
                    continue
                record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
                os.ftruncate(descriptor, 0)
                os.pwrite(descriptor, (record + "\n").encode("utf-8"), 0)
                return RunFolderClaim(folder, descriptor, created)
            except BaseException:
                try:
                    os.close(descriptor)
                except OSError:
                    pass
                raise
    except FileExistsError:
        raise ConfigError(f"{where}: a file stands where a folder of that path must be; give another "
                          f"{setting}=") from None
    except NotADirectoryError:
        raise ConfigError(f"{where}: part of that path is a file, not a folder; give another {setting}=") from None
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise ConfigError(f"{where} cannot be written ({reason}); give a folder you can write") from None


def _lock(descriptor: int) -> bool:
    """Take the exclusive lock without waiting: False if another descriptor holds it (True where the file
    system has no locks: the folder then goes unclaimed)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no claim
        return True
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
            return True
        raise
    return True
