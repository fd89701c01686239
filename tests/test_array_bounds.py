"""Array and tensor files are checked from what they declare before anything is read (:mod:`fedhpro.arrays`).

The attack: a 1.9 MB ``.npz`` whose ``x.npy`` declares 60,000,000 x 8 float32 (1.92 GB) and holds it, as a
megabyte or two of deflated zeros (:func:`deflate_bomb`); numpy inflates and allocates all of it, and the
readers after it copy it several times. Each reader must refuse such a file in one line, at once and without
allocating: the tests measure the time and the growth of the process's peak resident memory (a reader that
inflated the bomb would take seconds and add gigabytes). Honest files read as ``np.load`` / ``torch.load``
read them (the independent reference).
"""

from __future__ import annotations

import io
import resource
import struct
import time
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from fedhpro.arrays import (
    MAX_ARRAY_BYTES,
    MAX_ARRAY_BYTES_VARIABLE,
    MAX_NPZ_MEMBERS,
    MAX_STATE_BYTES_VARIABLE,
    ArrayFileError,
    Bound,
    load_npy,
    load_npz,
    load_torch,
)
from fedhpro.cli import main
from fedhpro.data.tensor_files import read_tensor_file
from fedhpro.engines import checkpoint
from fedhpro.errors import ConfigError, DataError

#: the review's bomb: x.npy declaring 60,000,000 x 8 float32 (1,920,000,000 bytes)
BOMB_SHAPE = (60_000_000, 8)
BOMB_BYTES = 60_000_000 * 8 * 4
#: what a refused bomb may add to the process's peak resident memory (a read of it adds 1.9 GB or more)
SMALL_GROWTH = 64 * 2**20


def npy_header(shape: tuple[int, ...], descr: str = "<f4") -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array_header_2_0(buffer, {"descr": descr, "fortran_order": False, "shape": shape})
    return buffer.getvalue()


def deflate_bomb(prefix: bytes, zeros: int) -> bytes:
    """Raw deflate data of ``prefix`` and ``zeros`` zero bytes, about a thousandth of their size: one block of
    a MiB of zeros compressed after a full window of zeros refers only to zeros, so it is repeated."""
    block = 1 << 20
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = compressor.compress(prefix + bytes(block)) + compressor.flush(zlib.Z_SYNC_FLUSH)
    middle = compressor.compress(bytes(block)) + compressor.flush(zlib.Z_SYNC_FLUSH)
    count, rest = divmod(zeros - block, block)
    return head + middle * count + compressor.compress(bytes(rest)) + compressor.flush(zlib.Z_FINISH)


def zip_bytes(members: list[tuple[str, bytes, int, int, int]]) -> bytes:
    """A zip archive of ``(name, data, method, uncompressed size, crc)`` members, written by hand (zipfile
    cannot store data that is already deflated)."""
    out, directory = io.BytesIO(), []
    for name, data, method, size, crc in members:
        offset, encoded = out.tell(), name.encode()
        out.write(struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, method, 0, 0, crc, len(data), size, len(encoded), 0)
                  + encoded + data)
        directory.append(struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, method, 0, 0, crc, len(data), size,
                                     len(encoded), 0, 0, 0, 0, 0, offset) + encoded)
    start, listing = out.tell(), b"".join(directory)
    out.write(listing + struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(members), len(members), len(listing),
                                    start, 0))
    return out.getvalue()


def write_bomb_npz(path: Path, with_y: bool = True) -> Path:
    """The review's bomb: x.npy declares and (deflated) holds 60,000,000 x 8 float32; y.npy is honest."""
    header = npy_header(BOMB_SHAPE)
    members = [("x.npy", deflate_bomb(header, BOMB_BYTES), 8, len(header) + BOMB_BYTES, 0)]
    if with_y:
        y = io.BytesIO()
        np.save(y, np.zeros(4, np.int64))
        members.append(("y.npy", y.getvalue(), 0, len(y.getvalue()), zlib.crc32(y.getvalue())))
    path.write_bytes(zip_bytes(members))
    return path


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


@contextmanager
def at_once(seconds: float = 0.5) -> Iterator[None]:
    """The block runs within ``seconds`` and grows the process's peak resident memory by less than
    :data:`SMALL_GROWTH` (inflating the bomb takes seconds and gigabytes)."""
    before, start = peak_bytes(), time.perf_counter()
    yield
    elapsed, grown = time.perf_counter() - start, peak_bytes() - before
    assert elapsed < seconds, f"{elapsed:.2f} s: the file was read, not refused from its header"
    assert grown < SMALL_GROWTH, f"the peak resident memory grew by {grown:,} bytes"


def refused_at_once(call, error=DataError, match: str | None = None) -> str:
    """``call()`` raises ``error``, one line matching ``match``, :func:`at_once`; the message."""
    with at_once(), pytest.raises(error, match=match) as raised:
        call()
    message = str(raised.value)
    assert "\n" not in message
    return message


def test_the_bomb_is_small_and_declares_what_the_review_measured(tmp_path):
    """The file the tests use is the review's: under 2 MB on disk, 1.92 GB declared in its zip directory and in
    x.npy's header (read here with numpy's own header reader, independently of fedhpro)."""
    path = write_bomb_npz(tmp_path / "bomb.npz")
    assert path.stat().st_size < 2_000_000
    with zipfile.ZipFile(path) as archive:
        member = archive.getinfo("x.npy")
        assert member.file_size == len(npy_header(BOMB_SHAPE)) + BOMB_BYTES
        with archive.open(member) as stream:
            np.lib.format.read_magic(stream)
            assert np.lib.format.read_array_header_2_0(stream) == (BOMB_SHAPE, False, np.dtype("<f4"))


def test_the_bomb_npz_is_refused_from_its_header(tmp_path):
    path = write_bomb_npz(tmp_path / "bomb.npz")
    message = refused_at_once(lambda: load_npz(path), ArrayFileError)
    assert message == (f"{path} declares x.npy: 60000000 x 8 float32, 1,920,000,000 bytes uncompressed, over "
                       f"fedhpro's limit of {MAX_ARRAY_BYTES:,}; if the file is genuine, raise the limit with "
                       f"{MAX_ARRAY_BYTES_VARIABLE}=BYTES")


def test_a_header_declaring_more_than_its_member_holds_is_refused(tmp_path, monkeypatch):
    """Under the limit (raised here), a header that declares more data than the zip member holds is refused
    before its array is allocated: the member's size comes from the zip's directory."""
    monkeypatch.setenv(MAX_ARRAY_BYTES_VARIABLE, str(4 * 2**30))
    header = npy_header(BOMB_SHAPE) + b"\0" * 8
    path = tmp_path / "short.npz"
    path.write_bytes(zip_bytes([("x.npy", zlib.compress(header)[2:-4], 8, len(header), zlib.crc32(header))]))
    message = refused_at_once(lambda: load_npz(path), ArrayFileError, "truncated or forged")
    assert "1,920,000,000 bytes but holds 8" in message


@pytest.mark.slow
def test_own_data_with_the_bomb_is_refused_in_one_line(tmp_path, capsys):
    """``dataset=clients``: a site's train.npz is the bomb; the run stops in one line before reading it."""
    for name in ("site-0", "site-1"):
        (tmp_path / "fed" / name).mkdir(parents=True)
        np.savez(tmp_path / "fed" / name / "train.npz", x=np.ones((4, 8), np.float32), y=np.arange(4) % 2)
    write_bomb_npz(tmp_path / "fed" / "site-1" / "train.npz")
    with at_once(seconds=3.0):  # a run's start included; reading the bomb takes about 10 s
        code = main(["run", "dataset=clients", f"data_dir={tmp_path / 'fed'}", "model=mlp", "rounds=1",
                     "local_epochs=1", "progress=false", "device=cpu", f"out={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "Traceback" not in err
    assert "site-1/train.npz declares x.npy: 60000000 x 8 float32, 1,920,000,000 bytes" in err
    assert MAX_ARRAY_BYTES_VARIABLE in err


def test_own_data_of_a_torch_file_past_the_limit_is_refused(tmp_path, monkeypatch):
    """train.pt is checked from its zip directory: declared bytes over the limit are refused before
    torch.load, and read once the limit is raised."""
    path = tmp_path / "site" / "train.pt"
    path.parent.mkdir()
    x = torch.arange(2000, dtype=torch.float32).reshape(250, 8)
    torch.save({"x": x, "y": torch.arange(250) % 3}, path)
    monkeypatch.setenv(MAX_ARRAY_BYTES_VARIABLE, "4000")
    message = refused_at_once(lambda: read_tensor_file(path), ArrayFileError, "over fedhpro's limit of 4,000")
    assert str(path) in message and "zip members" in message and f"{MAX_ARRAY_BYTES_VARIABLE}=BYTES" in message
    monkeypatch.setenv(MAX_ARRAY_BYTES_VARIABLE, "100000")
    read_x, read_y = read_tensor_file(path)
    assert torch.equal(read_x, x) and read_y.tolist() == [k % 3 for k in range(250)]


def test_honest_files_read_as_numpy_and_torch_read_them(tmp_path):
    """Every dtype numpy saves without objects, C and Fortran order, big-endian, 0-d and empty arrays, stored
    and deflated: the same dtype, shape, order and bytes as ``np.load``; a .pt as ``torch.load`` gives it."""
    rng = np.random.default_rng(0)
    arrays = {"f32": rng.normal(size=(5, 3)).astype(np.float32), "fortran": np.asfortranarray(rng.normal(size=(4, 6))),
              "big": np.arange(6, dtype=">i4").reshape(2, 3), "scalar": np.array(3.5),
              "empty": np.zeros((0, 4), np.uint8), "text": np.array(["ab", "cde"]), "flags": np.array([True, False]),
              "record": np.zeros(3, dtype=[("p", "<f4"), ("q", "i2")])}
    for save in (np.savez, np.savez_compressed):
        save(tmp_path / "a.npz", **arrays)
        mine, reference = load_npz(tmp_path / "a.npz"), np.load(tmp_path / "a.npz")
        assert sorted(mine) == sorted(reference.files)
        for name, expected in reference.items():
            got = mine[name]
            assert (got.dtype, got.shape, got.tobytes(), got.flags.f_contiguous) == \
                (expected.dtype, expected.shape, expected.tobytes(), expected.flags.f_contiguous), name
    for name, array in arrays.items():
        np.save(tmp_path / "a.npy", array)
        got, expected = load_npy(tmp_path / "a.npy"), np.load(tmp_path / "a.npy")
        assert (got.dtype, got.shape, got.tobytes()) == (expected.dtype, expected.shape, expected.tobytes()), name
    blob = {"x": torch.arange(10.0), "y": [torch.tensor([1, 2]), 3]}
    torch.save(blob, tmp_path / "a.pt")
    got = load_torch(tmp_path / "a.pt")
    assert torch.equal(got["x"], blob["x"]) and torch.equal(got["y"][0], blob["y"][0]) and got["y"][1] == 3


def test_objects_other_members_and_too_many_members_are_refused(tmp_path):
    np.save(tmp_path / "o.npy", np.array([{}, 1], dtype=object))
    np.savez(tmp_path / "o.npz", x=np.array([{}, 1], dtype=object))
    for path in (tmp_path / "o.npy", tmp_path / "o.npz"):
        with pytest.raises(ArrayFileError, match=r"holds Python objects \(object\). Object arrays cannot be "
                                                 r"loaded: fedhpro never unpickles them"):
            (load_npy if path.suffix == ".npy" else load_npz)(path)
    with zipfile.ZipFile(tmp_path / "bytes.npz", "w") as archive:
        archive.writestr("x.npy", b"")
        archive.writestr("notes.txt", b"hello")
    with pytest.raises(ArrayFileError, match="holds 'notes.txt', which is not a .npy array"):
        load_npz(tmp_path / "bytes.npz")
    np.savez(tmp_path / "many.npz", **{f"a{k}": np.zeros(1) for k in range(MAX_NPZ_MEMBERS + 1)})
    with pytest.raises(ArrayFileError, match=f"declares {MAX_NPZ_MEMBERS + 1} members, more than the 64"):
        load_npz(tmp_path / "many.npz")


def test_the_limit_variables_are_checked(monkeypatch, tmp_path):
    np.save(tmp_path / "a.npy", np.zeros(100, np.float64))  # 800 bytes of data
    monkeypatch.setenv(MAX_ARRAY_BYTES_VARIABLE, "799")
    with pytest.raises(ArrayFileError, match="declares 100 float64, 800 bytes uncompressed, over fedhpro's limit "
                                             f"of 799; if the file is genuine, raise the limit with "
                                             f"{MAX_ARRAY_BYTES_VARIABLE}=BYTES"):
        load_npy(tmp_path / "a.npy")
    monkeypatch.setenv(MAX_ARRAY_BYTES_VARIABLE, "800")
    assert load_npy(tmp_path / "a.npy").shape == (100,)
    for variable in (MAX_ARRAY_BYTES_VARIABLE, MAX_STATE_BYTES_VARIABLE):
        monkeypatch.setenv(variable, "lots")
        with pytest.raises(ConfigError, match=f"{variable}='lots' is not a whole number >= 1"):
            Bound.data() if variable == MAX_ARRAY_BYTES_VARIABLE else Bound.state()
        monkeypatch.delenv(variable)


# ----------------------------------------------------------------------------- a run folder's tensor files


def torch_bomb(path: Path, original: bytes | None = None) -> Path:
    """A real torch file (``original``, default one of a 2 x 2 float32 tensor) whose first storage member is
    replaced by 1.92 GB of deflated zeros declared in the zip directory: torch.load allocates and inflates
    what the directory declares."""
    buffer = io.BytesIO(original or b"")
    if original is None:
        torch.save({"weight": torch.zeros(2, 2)}, buffer)
    members = []
    with zipfile.ZipFile(buffer) as archive:
        for member in archive.infolist():
            data = archive.read(member)
            if member.filename.endswith("/data/0"):
                members.append((member.filename, deflate_bomb(data, BOMB_BYTES - len(data)), 8, BOMB_BYTES, 0))
            else:
                members.append((member.filename, data, 0, len(data), zlib.crc32(data)))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(zip_bytes(members))
    return path


def test_a_checkpoint_whose_member_declares_gigabytes_is_refused(tmp_path):
    path = torch_bomb(tmp_path / "run" / "checkpoints" / "round-000003.pt")
    assert path.stat().st_size < 2_000_000
    message = refused_at_once(lambda: checkpoint.load(path), DataError, "is compressed")
    assert f"{path}: its member archive/data/0 is compressed" in message
    assert "declaring 1,920,000,000" in message and "not written by torch.save" in message
    assert "no earlier checkpoint is kept" in message


def test_a_state_file_past_its_limit_is_refused_and_read_once_raised(tmp_path, monkeypatch):
    path = tmp_path / "model.pt"
    torch.save({"weight": torch.ones(64, 64)}, path)  # 16 KiB of data
    monkeypatch.setenv(MAX_STATE_BYTES_VARIABLE, "4096")
    message = refused_at_once(lambda: load_torch(path, Bound.state()), ArrayFileError)
    assert "over fedhpro's limit of 4,096" in message and f"{MAX_STATE_BYTES_VARIABLE}=BYTES" in message
    monkeypatch.setenv(MAX_STATE_BYTES_VARIABLE, str(2**20))
    assert torch.equal(load_torch(path, Bound.state())["weight"], torch.ones(64, 64))
