"""Bounded reading of array and tensor files (``.npy``, ``.npz``, torch's ``.pt``): what a file declares is
checked before anything is allocated.

A file of a few MB can declare gigabytes: a ``.npz`` is a zip archive whose members may be deflated (a megabyte
of deflated zeros expands to a gigabyte), and the header of a ``.npy`` member gives the shape and dtype the
reader allocates; a ``.pt`` is a zip archive too, whose members torch allocates at the size the zip's
directory declares. So every reader here reads the declarations first, without decompressing any data:

* ``.npy`` (a file, or each member of a ``.npz``): its header's shape and dtype; object dtypes (pickled
  arrays) are refused, and the data it declares must fit in the bytes the file (member) holds;
* ``.npz``: at most :data:`MAX_NPZ_MEMBERS` members, each a ``.npy`` array, their declared uncompressed sizes
  (the zip directory's ``file_size``) and their headers' data summed;
* ``.pt``: at most :data:`MAX_TORCH_MEMBERS` members, stored uncompressed as ``torch.save`` writes them (a
  deflated member, or one declaring more bytes than the file holds, was not written by torch.save), their
  declared sizes summed; a file of torch's legacy (non-zip) format by its size on disk.

The sum is refused over the limit, in one line naming the file, what it declares, the limit and the
environment variable that raises it: :data:`MAX_ARRAY_BYTES_VARIABLE` for data handed in (own data's
``train``/``test`` files, ``fedhpro predict``'s inputs, a run's ``tsne.npz``), :data:`MAX_STATE_BYTES_VARIABLE`
for the tensor files fedhpro writes into a run folder (``model.pt``, ``models/``, checkpoints, a Flower node's
client state). Only then is the data read, at the size checked: ``.npy`` data by these readers themselves
(never ``allow_pickle``), ``.pt`` files by ``torch.load(weights_only=True)`` from the same open file.
"""

from __future__ import annotations

import math
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from fedhpro.bounded import limit_from_environment
from fedhpro.errors import DataError

#: the most uncompressed bytes one data file (a ``.npy``, ``.npz`` or ``.pt`` of features, labels or inputs) may
#: declare: 1 GiB, 268 million float32 values (a site of a million rows of 256 features, or 87,000 32x32 RGB
#: images as float32). Reading costs several times a file's size (conversions, copies; ``fedhpro predict`` kept
#: ten), so this keeps a hostile file of a few MB far from exhausting a host; a bigger genuine file is read
#: with :data:`MAX_ARRAY_BYTES_VARIABLE` set
MAX_ARRAY_BYTES = 2**30
#: the environment variable that sets :data:`MAX_ARRAY_BYTES`
MAX_ARRAY_BYTES_VARIABLE = "FEDHPRO_MAX_ARRAY_BYTES"
#: the most bytes one of a run's own tensor files (``model.pt``, ``models/client_<k>.pt``, a checkpoint, a
#: Flower node's client state) may declare: 16 GiB. A checkpoint holds every client's state and personal
#: model, which for a large registered model and many clients reaches several GiB; these files are stored
#: uncompressed (anything else is refused), so what they declare is what they hold on disk
MAX_STATE_BYTES = 16 * 2**30
#: the environment variable that sets :data:`MAX_STATE_BYTES`
MAX_STATE_BYTES_VARIABLE = "FEDHPRO_MAX_STATE_BYTES"
#: the most members a ``.npz`` may hold: fedhpro's own hold two (``x``, ``y``) to six (``tsne.npz``)
MAX_NPZ_MEMBERS = 64
#: the most members a ``.pt`` zip may hold: one per tensor storage and five more; a checkpoint of a thousand
#: clients' personal models of a few hundred tensors each fits (each member costs a few hundred bytes to list)
MAX_TORCH_MEMBERS = 1_000_000
#: the longest ``.npy`` header read (numpy's own bound: a header is a short Python literal)
MAX_HEADER_CHARS = 10_000
#: how much array data is read at a time
_CHUNK = 1 << 24


class ArrayFileError(DataError):
    """An array or tensor file that declares more than fedhpro reads, or what it never reads (objects,
    pickles, compressed torch members): one line naming the file and the fix."""


def _limit_from(variable: str, default: int) -> int:
    return limit_from_environment(variable, default, "bytes a file may declare")


def max_array_bytes() -> int:
    """The byte limit of a data file: ``$FEDHPRO_MAX_ARRAY_BYTES`` when set (a whole number >= 1), else
    :data:`MAX_ARRAY_BYTES`; a value that is not one is a one-line ConfigError."""
    return _limit_from(MAX_ARRAY_BYTES_VARIABLE, MAX_ARRAY_BYTES)


def max_state_bytes() -> int:
    """The byte limit of a run's own tensor file: ``$FEDHPRO_MAX_STATE_BYTES`` when set, else
    :data:`MAX_STATE_BYTES`; a value that is not a whole number >= 1 is a one-line ConfigError."""
    return _limit_from(MAX_STATE_BYTES_VARIABLE, MAX_STATE_BYTES)


@dataclass(frozen=True)
class Bound:
    """The byte limit a file is read within and the environment variable that sets it."""

    limit: int
    variable: str

    @classmethod
    def data(cls) -> Bound:
        return cls(max_array_bytes(), MAX_ARRAY_BYTES_VARIABLE)

    @classmethod
    def state(cls) -> Bound:
        return cls(max_state_bytes(), MAX_STATE_BYTES_VARIABLE)

    def check(self, declared: int, where: str, what: str, error: type[DataError]) -> None:
        if declared > self.limit:
            raise error(f"{where} declares {what}, {declared:,} bytes uncompressed, over fedhpro's limit of "
                        f"{self.limit:,}; if the file is genuine, raise the limit with {self.variable}=BYTES")


@dataclass(frozen=True)
class NpyHeader:
    """What a ``.npy`` header declares, and where its data begins."""

    shape: tuple[int, ...]
    fortran_order: bool
    dtype: np.dtype[Any]
    offset: int

    @property
    def count(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize

    def describe(self) -> str:
        return f"{' x '.join(map(str, self.shape)) or 'a scalar'} {self.dtype}"


def _first_line(error: BaseException) -> str:
    return ((str(error).strip().splitlines() or [type(error).__name__])[0])[:160]


def read_npy_header(stream: IO[bytes], where: str, error: type[DataError] = ArrayFileError) -> NpyHeader:
    """The header of the ``.npy`` data at the start of ``stream`` (left just after it), checked: a numeric or
    other plain dtype (no objects: nothing is ever unpickled), sizes >= 0. One line of ``error`` otherwise."""
    start = stream.tell()
    try:
        version = np.lib.format.read_magic(stream)
        # numpy's own parsers of the header's Python literal (ast.literal_eval: no code); version 3.0 (UTF-8
        # field names) has no public one, and np.save writes it only for such names
        readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
        if version not in readers:
            raise ValueError(f".npy format version {version[0]}.{version[1]}, not 1.0 or 2.0")
        shape, fortran_order, dtype = readers[version](stream, max_header_size=MAX_HEADER_CHARS)
    except (ValueError, OSError, EOFError, SyntaxError, TypeError, KeyError, zipfile.BadZipFile) as problem:
        raise error(f"{where} is not a .npy array fedhpro can read ({_first_line(problem)}); save it with "
                    "numpy (np.save, np.savez)") from None
    if dtype.hasobject:
        raise error(f"{where} holds Python objects ({dtype}). Object arrays cannot be loaded: fedhpro never "
                    "unpickles them; save numeric arrays")
    if not all(isinstance(n, int) and n >= 0 for n in shape):
        raise error(f"{where} declares the shape {shape!r}; the file is damaged: save it again with numpy")
    return NpyHeader(tuple(shape), bool(fortran_order), dtype, stream.tell() - start)


def _read_data(stream: IO[bytes], header: NpyHeader, where: str, error: type[DataError]) -> np.ndarray:
    """The array of ``header`` from ``stream`` (positioned at its data): allocated at the checked size,
    filled chunk by chunk, as ``numpy.lib.format.read_array`` does for a zip member."""
    array = np.empty(header.count, dtype=header.dtype)
    if header.nbytes:
        flat = array.view(np.uint8)
        done = 0
        while done < header.nbytes:
            chunk = stream.read(min(_CHUNK, header.nbytes - done))
            if not chunk:
                raise error(f"{where} ends after {done:,} of the {header.nbytes:,} bytes its header declares; it "
                            "is truncated: save it again")
            flat[done:done + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
            done += len(chunk)
    return array.reshape(header.shape, order="F" if header.fortran_order else "C")


def load_npy(path: str | os.PathLike, bound: Bound | None = None,
             error: type[DataError] = ArrayFileError) -> np.ndarray:
    """The array of the ``.npy`` file ``path``, its header checked against ``bound`` (default
    :meth:`Bound.data`) and against the file's size before its data is read; every failure one line."""
    path, bound = Path(path), bound or Bound.data()
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            header = read_npy_header(handle, str(path), error)
            bound.check(header.nbytes, str(path), header.describe(), error)
            if header.offset + header.nbytes > size:
                raise error(f"{path} declares {header.describe()} = {header.nbytes:,} bytes but holds "
                            f"{max(size - header.offset, 0):,}; it is truncated: save it again")
            return _read_data(handle, header, str(path), error)
    except OSError as problem:
        raise error(f"{path} cannot be read ({problem.strerror or type(problem).__name__})") from None


def _open_zip(handle: IO[bytes], where: str, most: int, error: type[DataError]) -> zipfile.ZipFile:
    """The zip archive open in ``handle``, of at most ``most`` members: the count is read from the archive's
    end record before its directory is listed (each member listed costs memory)."""
    end_record = getattr(zipfile, "_EndRecData", None)  # zipfile's own reader of the end record (zip64 too)
    record = end_record(handle) if end_record is not None else None
    if record is not None and record[4] > most:  # 4: zipfile._ECD_ENTRIES_TOTAL
        raise error(f"{where} declares {record[4]:,} members, more than the {most:,} fedhpro reads; it is not a "
                    "file fedhpro can use: save it again")
    handle.seek(0)
    try:
        archive = zipfile.ZipFile(handle)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError, NotImplementedError) as problem:
        raise error(f"{where} is not a zip archive fedhpro can read ({_first_line(problem)}); save it again") \
            from None
    if len(archive.infolist()) > most:
        raise error(f"{where} holds {len(archive.infolist()):,} members, more than the {most:,} fedhpro reads; it is "
                    "not a file fedhpro can use: save it again")
    return archive


def load_npz(path: str | os.PathLike, bound: Bound | None = None,
             error: type[DataError] = ArrayFileError) -> dict[str, np.ndarray]:
    """Every array of the ``.npz`` file ``path`` by name (``x.npy`` as ``x``), as ``np.load`` gives them, read
    only after the members' count, their declared uncompressed sizes and each ``.npy`` header (read through
    the zip, no data decompressed) are checked against ``bound`` (default :meth:`Bound.data`); objects and
    members that are not ``.npy`` arrays are refused. Every failure is one line of ``error``."""
    path, bound = Path(path), bound or Bound.data()
    try:
        with open(path, "rb") as handle:
            if not zipfile.is_zipfile(handle):
                raise error(f"{path} is not a .npz file (a zip archive of .npy arrays); save it with np.savez")
            archive = _open_zip(handle, str(path), MAX_NPZ_MEMBERS, error)
            members = archive.infolist()
            others = [m.filename for m in members if not m.filename.endswith(".npy")]
            if others:
                raise error(f"{path} holds {others[0][:80]!r}, which is not a .npy array; save only arrays "
                            "(np.savez)")
            headers: dict[str, NpyHeader] = {}
            for member in members:  # each header read through the zip: only its first bytes are inflated
                where = f"{path} ({member.filename[:80]})"
                with archive.open(member) as stream:
                    header = read_npy_header(stream, where, error)
                bound.check(header.nbytes, str(path), f"{member.filename[:80]}: {header.describe()}", error)
                if header.offset + header.nbytes > member.file_size:
                    raise error(f"{where} declares {header.describe()} = {header.nbytes:,} bytes but holds "
                                f"{max(member.file_size - header.offset, 0):,}; it is truncated or forged: save "
                                "it again")
                headers[member.filename] = header
            bound.check(sum(h.nbytes for h in headers.values()), str(path),
                        " and ".join(f"{name[:40]}: {h.describe()}" for name, h in list(headers.items())[:4]), error)
            largest = max(members, key=lambda m: m.file_size, default=None)
            if largest is not None:  # what inflating every member would produce (numpy checks each one's CRC)
                bound.check(sum(m.file_size for m in members), str(path),
                            f"{len(members)} zip members (the largest {largest.filename[:80]}, {largest.file_size:,} "
                            "bytes)", error)
            arrays: dict[str, np.ndarray] = {}
            for member in members:
                with archive.open(member) as stream:
                    stream.read(headers[member.filename].offset)  # the header, checked above
                    arrays[member.filename[:-4]] = _read_data(stream, headers[member.filename],
                                                              f"{path} ({member.filename[:80]})", error)
            return arrays
    except OSError as problem:
        raise error(f"{path} cannot be read ({problem.strerror or type(problem).__name__})") from None
    except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError) as problem:  # a damaged member
        raise error(f"{path} is not a .npz file fedhpro can read ({_first_line(problem)}); save it with np.savez") \
            from None


def check_torch_file(handle: IO[bytes], where: str, bound: Bound, error: type[DataError] = ArrayFileError) -> None:
    """One line of ``error`` unless the torch file open in ``handle`` declares at most ``bound`` bytes: a zip
    (torch's format since 1.6) of at most :data:`MAX_TORCH_MEMBERS` members stored uncompressed, as
    ``torch.save`` writes them, inside the file, their declared sizes summed; a legacy file by its size."""
    size = os.fstat(handle.fileno()).st_size
    if not zipfile.is_zipfile(handle):
        bound.check(size, where, "a torch file of the legacy format", error)
        handle.seek(0)
        return
    members = _open_zip(handle, where, MAX_TORCH_MEMBERS, error).infolist()
    for member in members:
        if member.compress_type != zipfile.ZIP_STORED or member.file_size != member.compress_size:
            raise error(f"{where}: its member {member.filename[:80]} is compressed ({member.compress_size:,} bytes "
                        f"declaring {member.file_size:,}); torch.save stores every member as it is: the file was "
                        "not written by torch.save, save it again")
    stored = sum(member.compress_size for member in members)
    if stored > size:
        raise error(f"{where} declares {stored:,} bytes of members but is {size:,} bytes long; it is truncated or "
                    "forged: save it again")
    largest = max(members, key=lambda m: m.file_size, default=None)
    if largest is not None:
        bound.check(sum(member.file_size for member in members), where,
                    f"{len(members)} zip members (the largest {largest.filename[:80]}, {largest.file_size:,} bytes)",
                    error)
    handle.seek(0)


def load_torch(path: str | os.PathLike, bound: Bound | None = None, error: type[DataError] = ArrayFileError) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)`` (never unpickled) after
    :func:`check_torch_file` of the same open file against ``bound`` (default :meth:`Bound.data`). A bound
    exceeded is one line of ``error``; torch's own errors (a damaged file) propagate for the caller to name."""
    bound = bound or Bound.data()
    with open(path, "rb") as handle:
        check_torch_file(handle, str(path), bound, error)
        return torch.load(handle, map_location="cpu", weights_only=True)


__all__ = ["MAX_ARRAY_BYTES", "MAX_ARRAY_BYTES_VARIABLE", "MAX_HEADER_CHARS", "MAX_NPZ_MEMBERS", "MAX_STATE_BYTES",
           "MAX_STATE_BYTES_VARIABLE", "MAX_TORCH_MEMBERS", "ArrayFileError", "Bound", "NpyHeader", "check_torch_file",
           "load_npy", "load_npz", "load_torch", "max_array_bytes", "max_state_bytes", "read_npy_header"]
