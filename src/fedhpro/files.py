"""Files written whole or not at all: the one atomic writer every result, checkpoint and cache file uses.

The bytes go to a new temporary file beside the target (same folder, hence
the same file system, where :func:`os.replace` is atomic), are flushed to
disk, then replace the target in one step. A reader sees the old file or the
new one, never half of one; a write that fails or is interrupted leaves the
old file and removes its temporary file.

The file gets the mode a plain ``open(path, "w")`` gives, ``0o666`` less the
umask (``tempfile.mkstemp`` would give ``0o600``: results in a shared folder
would be unreadable to the group).

This module sits below everything else in fedhpro (it imports nothing from
the package), so data, engines and reports can all use it.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

#: what a new file's mode starts from before the umask, as ``open(path, "w")`` does
NEW_FILE_MODE = 0o666


def _temporary_beside(path: Path) -> Path:
    """A name beside ``path`` that no other writer (process or thread) picks: hidden, marked ``.tmp``."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


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


def write_atomic(path: str | os.PathLike, content: str | bytes) -> None:
    """Write ``content`` (text as UTF-8, or bytes) to ``path`` atomically (:func:`write_atomic_with`)."""
    data = content.encode("utf-8") if isinstance(content, str) else bytes(content)
    write_atomic_with(path, lambda handle: handle.write(data))
