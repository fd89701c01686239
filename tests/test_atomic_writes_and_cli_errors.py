"""One atomic writer with the umask's mode, a closed stdout at the CLI, and short unknown-key errors with a
complete ``config --keys``."""

from __future__ import annotations

import ast
import dataclasses
import fcntl
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fedhpro import reports
from fedhpro.config import FaultOptions, RunOptions, _all_keys, load_config
from fedhpro.engines import checkpoint
from fedhpro.errors import ConfigError
from fedhpro.methods import METHODS

SRC = Path(__file__).resolve().parents[1] / "src" / "fedhpro"


# ---------------------------------------------------------------------------- 1. atomic writes


@pytest.fixture
def umask():
    previous = os.umask(0o022)
    os.umask(previous)

    def set_mask(mask: int) -> None:
        os.umask(mask)

    yield set_mask
    os.umask(previous)


@pytest.mark.parametrize("mask,mode", [(0o022, 0o644), (0o007, 0o660)])
def test_result_files_get_the_mode_open_would_give(tmp_path, umask, mask, mode):
    umask(mask)
    reports.write_json(tmp_path / "summary.json", {"AVG": 1.0})
    reports.write_jsonl(tmp_path / "metrics.jsonl", [{"round": 0}])
    reports.write_yaml(tmp_path / "config.yaml", {"rounds": 1})
    saved = checkpoint.save(tmp_path, 1, {"server": {}}, [])
    with open(tmp_path / "plain.txt", "w"):  # the reference: what a plain open gives
        pass
    assert (tmp_path / "plain.txt").stat().st_mode & 0o777 == mode
    for path in (tmp_path / "summary.json", tmp_path / "metrics.jsonl", tmp_path / "config.yaml", saved):
        assert path.stat().st_mode & 0o777 == mode, path.name
    assert json.loads((tmp_path / "summary.json").read_text()) == {"AVG": 1.0}


def test_a_plot_gets_the_umask_mode_too(tmp_path, umask):
    from fedhpro.reports.plots import plot_curves

    umask(0o007)
    plot_curves({"a": ([1, 2], [3.0, 4.0])}, tmp_path / "curve.png")
    path = tmp_path / "curve.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_mode & 0o777 == 0o660
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curve.pdf", "curve.png", "curve.svg"]  # vector copies
    assert (tmp_path / "curve.svg").stat().st_mode & 0o777 == 0o660
    assert (tmp_path / "curve.pdf").stat().st_mode & 0o777 == 0o660


def test_a_crash_mid_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    from fedhpro.files import write_atomic_with

    path = tmp_path / "summary.json"
    reports.write_json(path, {"old": True})
    old = path.read_bytes()

    def crash(handle):
        handle.write(b'{"new": tr')
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError, match="killed mid-write"):
        write_atomic_with(path, crash)
    assert path.read_bytes() == old
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]
    with pytest.raises(KeyboardInterrupt):
        write_atomic_with(tmp_path / "new.json", lambda handle: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def fedhpro_imports(path: Path) -> set[str]:
    """The fedhpro modules a source file imports (absolute imports only, as the project writes them)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fedhpro"):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names if alias.name.startswith("fedhpro"))
    return names


def test_the_writer_is_low_level_and_nothing_low_imports_reports():
    assert fedhpro_imports(SRC / "files.py") <= {"fedhpro.errors"}
    for low in ("data/partition.py", "engines/checkpoint.py"):
        imported = fedhpro_imports(SRC / low)
        assert "fedhpro.files" in imported and not any(m.startswith("fedhpro.reports") for m in imported), low
    # one implementation: nobody but fedhpro.files makes temporary files or renames them into place
    for source in SRC.rglob("*.py"):
        text = source.read_text()
        if source.name == "files.py" or source.name == "loaders.py":  # loaders: a memory map needs a file name
            continue
        assert "mkstemp" not in text and "os.replace(" not in text, source


# ---------------------------------------------------------------------------- 2. a closed stdout


@pytest.mark.slow
def test_a_reader_that_closes_the_pipe_gets_no_traceback(tmp_path):
    if not hasattr(fcntl, "F_SETPIPE_SZ"):
        pytest.skip("needs Linux pipes whose size can be set")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for _ in range(3):
        read_end, write_end = os.pipe()
        # a one-page pipe: the listing (about 11 kB) cannot be written ahead of the reader, so closing
        # after the first line always breaks the pipe under the writer (as `| head -1` sometimes does)
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
        process = subprocess.Popen([sys.executable, "-m", "fedhpro", "config", "--keys"], stdout=write_end,
                                   stderr=subprocess.PIPE, cwd=tmp_path, env=env)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as reader:
            first = reader.readline()
        stderr = process.communicate(timeout=120)[1].decode()
        assert first.startswith(b"method ")
        assert stderr == "", stderr
        assert process.returncode == 1  # as Python's documentation does it (signal module, SIGPIPE note)


# ---------------------------------------------------------------------------- 3. unknown keys, --keys


@pytest.mark.parametrize("key,closest", [
    ("rouds", "rounds"),
    ("fedhpro.tua", "fedhpro.tau"),
    ("faults.corupt", "faults.corrupt"),
    ("zzzzzz", None),
])
def test_an_unknown_key_names_the_closest_keys_in_one_short_line(key, closest):
    with pytest.raises(ConfigError) as error:
        load_config(None, {key: 1})
    message = str(error.value)
    assert "\n" not in message and len(message) < 200, (len(message), message)
    assert f"unknown config key '{key}'" in message and "fedhpro config --keys" in message
    suggested = re.findall(r"'([^']+)'", message.split("did you mean", 1)[1]) if "did you mean" in message else []
    assert len(suggested) <= 3
    assert (suggested[:1] == [closest]) if closest else suggested == []


def test_an_unknown_data_key_of_another_data_set_points_to_its_listing():
    with pytest.raises(ConfigError) as error:
        load_config(None, {"dataset": "cifar10", "data.fration": 0.1})
    assert "fedhpro config --keys dataset=cifar10" in str(error.value)


def test_config_keys_lists_every_key_with_its_default(capsys):
    from fedhpro.cli import main

    assert main(["config", "--keys"]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = {}
    for line in lines:
        match = re.match(r"^(\S+)(?: \[[^\]]*\])?: .*\(default:? ([^()]*)\)$", line)
        assert match, line
        listed[match.group(1)] = match.group(2)
    assert set(_all_keys(RunOptions.dataset)) <= set(listed)
    # defaults, read off the option classes by hand
    assert listed["rounds"] == "10" and listed["lr"] == "0.01" and listed["method"] == "fedhpro"
    assert listed["clients"] == "the data set's layout" and listed["partition.load"] == "null"
    assert listed["progress"] == "true" and listed["data.clients_per_domain"] == '{"mnist": 3, "optdigits": 7, ' \
        '"mnistm": 6, "syn": 4}'
    assert listed["faults.dropout"] == "0.0" and listed["faults.corrupt"] == "0.0"
    assert listed["fedhpro.tau"] == str(METHODS["fedhpro"].options().tau)
    assert listed["partition"] == listed["partition.scheme"]
    assert "transmission" in [f for f in dataclasses.fields(FaultOptions) if f.name == "corrupt"][0].metadata["help"]
