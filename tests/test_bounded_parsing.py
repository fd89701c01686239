"""Bounded YAML and JSON (:mod:`fedhpro.bounded`): a billion-laughs alias graph, a value that contains itself
and nesting past any use end in one line, fast, wherever the text comes from (a KEY=VALUE on the command line,
a config file, a run folder's config.yaml, model.json, metrics.jsonl, summary.json).

The hang bound is a subprocess timeout (or an alarm in process), generous on a shared machine: the refusal
itself takes milliseconds, the unbounded walk took longer than any of these bounds.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from fedhpro.bounded import MAX_DEPTH, MAX_NODES, LimitError, load_json, load_yaml, read_jsonl_file
from fedhpro.config import load_config
from fedhpro.errors import ConfigError, FedHProError

#: seconds a refusal may take before the test calls it a hang (a fresh interpreter imports torch first)
HANG = 60


def laughs(levels: int = 9, width: int = 10, *, flow: bool = False) -> str:
    """The billion-laughs YAML: anchor ``a0`` a list of ``width`` scalars, each ``a<i>`` a list of ``width``
    aliases of ``a<i-1>``; ``rounds`` refers to the last: ``width ** levels`` scalars once expanded. ``flow``:
    one flow value (what ``rounds=`` takes on the command line), the anchors nested in it."""
    if flow:
        value = "&a0 [" + ", ".join(["lol"] * width) + "]"
        for i in range(1, levels):
            value = f"&a{i} [{value}, " + ", ".join([f"*a{i - 1}"] * (width - 1)) + "]"
        return value
    lines = ["a0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "\n".join(lines + [f"rounds: *a{levels - 1}"]) + "\n"


@contextmanager
def hang_bound(seconds: int = HANG):
    """Fail instead of hanging: SIGALRM interrupts Python code that runs past ``seconds``."""
    def stop(signum, frame):
        raise AssertionError(f"still running after {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def cli(*arguments: str, timeout: int = HANG) -> tuple[int, str, float]:
    """``python -m fedhpro ARGUMENTS`` in a fresh process: exit code, stderr, seconds."""
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "fedhpro", *arguments], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"fedhpro {arguments[0]} did not finish within {timeout} s: a hang")
    return done.returncode, done.stderr, time.monotonic() - start


def one_error_line(code: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert lines[0].startswith("fedhpro: error: "), lines[0]
    return lines[0]


def expanded_size(value, memo=None) -> int:
    """Independent reference: the nodes of ``value`` counted as a tree (a mapping counts its keys and values),
    memoised by identity so that a shared graph is sized without being walked as a tree."""
    memo = {} if memo is None else memo
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, dict):
        size = 1 + sum(expanded_size(k, memo) + expanded_size(v, memo) for k, v in value.items())
    elif isinstance(value, list):
        size = 1 + sum(expanded_size(item, memo) for item in value)
    else:
        size = 1
    if isinstance(value, (dict, list)):
        memo[id(value)] = size
    return size


# ---------------------------------------------------------------------------- the hangs, end to end


@pytest.mark.slow
def test_a_billion_laughs_on_the_command_line_is_one_line(tmp_path):
    code, err, seconds = cli("config", f"rounds={laughs(flow=True)}")
    line = one_error_line(code, err)
    assert "the value of rounds=" in line and f"more than {MAX_NODES:,} values" in line and "aliases" in line


@pytest.mark.slow
def test_a_billion_laughs_config_file_is_one_line(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(laughs())
    code, err, _ = cli("config", str(path))
    line = one_error_line(code, err)
    assert str(path) in line and "aliases" in line


@pytest.mark.slow
def test_predict_on_a_run_folder_whose_config_is_a_billion_laughs_is_one_line(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.yaml").write_text(laughs())
    (folder / "model.json").write_text(json.dumps({
        "format": "fedhpro-model/1", "method": "fedavg", "model": "cnn", "num_classes": 2, "classes": ["a", "b"],
        "input_shape": [3, 8, 8], "feature_dim": 16, "inference": "head", "global": "model.pt", "personal": {},
        "input": {"kind": "tensor", "shape": [3, 8, 8], "dtype": "float32"}, "config": "config.yaml"}))
    (tmp_path / "x.png").write_bytes(b"")
    code, err, _ = cli("predict", str(folder), str(tmp_path / "x.png"))
    line = one_error_line(code, err)
    assert "config.yaml" in line and "aliases" in line


def _fake_run(folder: Path, config_text: str) -> Path:
    """A run folder as a report reads it: one evaluated metrics row, the given config.yaml."""
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text(json.dumps({"round": 0, "bytes_up": 10, "accuracy": {"a": 50.0,
                                                                                                "AVG": 50.0}}) + "\n")
    (folder / "config.yaml").write_text(config_text)
    return folder


@pytest.mark.slow
def test_report_on_run_folders_whose_config_is_a_billion_laughs_is_one_line(tmp_path):
    first = _fake_run(tmp_path / "one", "method: fedavg\n" + laughs())
    second = _fake_run(tmp_path / "two", "method: fedavg\nrounds: 3\n")
    code, err, _ = cli("report", str(first), str(second), f"out={tmp_path / 'report'}")
    line = one_error_line(code, err)
    assert "config.yaml" in line and "aliases" in line


# ---------------------------------------------------------------------------- the bounds, in process


def test_the_bomb_is_refused_before_it_is_expanded_and_fast():
    """The refusal counts while composing: the nodes counted stop just past the bound (an alias adds its
    subtree at once), nothing of size 10**9 is ever built or walked."""
    with hang_bound(20):
        start = time.monotonic()
        with pytest.raises(LimitError, match=r"more than 1,000,000 values once its YAML aliases") as raised:
            load_yaml(laughs(), "bomb.yaml")
        seconds = time.monotonic() - start
    assert "\n" not in str(raised.value) and str(raised.value).startswith("bomb.yaml ")
    print(f"billion laughs refused in {seconds * 1000:.1f} ms")


def test_a_small_alias_graph_loads_as_safe_load_loads_it():
    text = laughs(levels=3, width=4)
    value = load_yaml(text)
    assert value == yaml.safe_load(text)
    assert value["rounds"][0] is value["a1"]  # still shared: aliases are not copied
    size = expanded_size(value)  # 201: the three levels as a tree
    assert load_yaml(text, max_nodes=size) == value
    with pytest.raises(LimitError):
        load_yaml(text, max_nodes=size - 1)


@pytest.mark.parametrize("nodes", [999, 1000, 1001])
@pytest.mark.parametrize("shape", ["flat", "nested"])
def test_the_node_bound_is_the_tree_size(nodes, shape):
    """The reference counts the constructed value as a tree (:func:`expanded_size`); the loader, given a bound
    of 1000 nodes, refuses exactly above it."""
    if shape == "flat":  # {a: 1, b: [*s, ...]}: 5 nodes besides the aliases, each alias one node
        text = "a: &s 1\nb: [" + ", ".join(["*s"] * (nodes - 5)) + "]\n"
    else:  # {a: [x x 9], b: [*a ...], c: [...]}: an alias of a 10-node list adds 10
        aliases, rest = divmod(nodes - 16, 10)
        text = ("a: &a [" + ", ".join(["x"] * 9) + "]\nb: [" + ", ".join(["*a"] * aliases) + "]\nc: ["
                + ", ".join(["y"] * rest) + "]\n")
    assert expanded_size(yaml.safe_load(text)) == nodes
    if nodes <= 1000:
        assert load_yaml(text, max_nodes=1000) == yaml.safe_load(text)
    else:
        with pytest.raises(LimitError, match="more than 1,000 values once its YAML aliases"):
            load_yaml(text, max_nodes=1000)


@pytest.mark.parametrize("text", ["a: &x [*x]\n", "a: &x {b: *x}\n", "&x [1, [2, *x]]"])
def test_a_value_that_contains_itself_is_refused(text, tmp_path):
    with pytest.raises(LimitError, match="an alias inside the value it refers to"):
        load_yaml(text)
    path = tmp_path / "self.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="contains itself") as raised:
        load_config(path)
    assert "\n" not in str(raised.value)


def test_nesting_past_the_depth_bound_is_one_line_for_yaml_and_json():
    assert load_yaml("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None
    assert load_json("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None
    for deep in (MAX_DEPTH + 1, 100_000):
        with pytest.raises(LimitError, match=f"more than {MAX_DEPTH} levels deep"):
            load_yaml("[" * deep + "]" * deep)
        with pytest.raises(LimitError, match=f"more than {MAX_DEPTH} levels deep"):  # json: a RecursionError
            load_json("[" * deep + "]" * deep)


def test_the_text_size_is_bounded_before_parsing():
    with pytest.raises(LimitError, match="characters long, over fedhpro's limit of 10"):
        load_yaml("rounds: 1000", max_chars=10)
    with pytest.raises(LimitError, match="characters long, over fedhpro's limit of 10"):
        load_json('{"a": 12345}', max_chars=10)


def test_aliases_beyond_the_alias_bound_are_refused():
    text = "a: &s 1\nb: [" + ", ".join(["*s"] * 1001) + "]\n"
    with pytest.raises(LimitError, match="more than 1000 YAML aliases"):
        load_yaml(text)
    assert len(load_yaml(text, max_aliases=2000)["b"]) == 1001


def test_a_yaml_tag_that_would_run_code_stays_refused(tmp_path):
    with pytest.raises(yaml.constructor.ConstructorError):
        load_yaml("!!python/object/apply:os.system [touch x]")


def test_a_jsonl_file_of_deep_or_foreign_rows_is_one_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for content, text in (("[" * 5000 + "]" * 5000 + "\n", "levels deep"), ("[1, 2]\n", "not an object"),
                          ('{"round": 0}\n{"round": \n', "not valid JSON"), ("\xff", "not UTF-8")):
        path.write_bytes(content.encode("latin-1"))
        with pytest.raises(FedHProError, match=text) as raised:
            read_jsonl_file(path)
        assert "\n" not in str(raised.value) and str(path) in str(raised.value)


def test_files_over_the_size_bound_are_refused_before_they_are_read(tmp_path, monkeypatch):
    import fedhpro.bounded as bounded
    import fedhpro.config as config

    monkeypatch.setattr(bounded, "MAX_JSON_CHARS", 1000)
    monkeypatch.setattr(config, "MAX_YAML_CHARS", 1000)
    path = tmp_path / "summary.json"
    path.write_text('{"notes": "' + "x" * 1000 + '"}')
    with pytest.raises(FedHProError, match=r"summary.json is 1,013 bytes, over fedhpro's limit of 1,000") as raised:
        bounded.read_json_file(path)
    assert "\n" not in str(raised.value)
    path.write_text('{"notes": "' + "x" * 900 + '"}')
    assert len(bounded.read_json_file(path)["notes"]) == 900
    config_file = tmp_path / "big.yaml"
    config_file.write_text("rounds: 2\n" + "#" * 1000 + "\n")
    with pytest.raises(ConfigError, match=r"big.yaml' is 1,011 bytes, over fedhpro's limit of 1,000 for YAML"):
        load_config(config_file)
