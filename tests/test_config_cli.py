"""Tests of the configuration (``fedhpro.config``), the command line and one end-to-end ``fedhpro.run``."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION
from fedhpro.config import load_config
from fedhpro.errors import ConfigError
from fedhpro.methods import METHODS

PAPER_LAYOUT = {"mnist": 3, "optdigits": 7, "mnistm": 6, "syn": 4}


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# ----------------------------------------------------------------------------
# defaults, types, sources
# ----------------------------------------------------------------------------


def test_defaults():
    config = load_config(None)
    run = config.run
    assert (run.method, run.dataset, run.model) == ("fedhpro", "digits-offline", "cnn")
    assert (run.rounds, run.feature_dim, run.local_epochs, run.batch_size) == (10, 512, 5, 64)
    assert (run.lr, run.momentum, run.weight_decay) == (0.01, 0.9, 1e-5)
    assert (run.participation, run.seed, run.eval_every, run.clients) == (1.0, 0, 1, None)
    assert run.progress is True and run.device == "auto" and run.out is None and run.data_dir is None
    fedhpro = config.method_options
    assert fedhpro is config.methods["fedhpro"]
    assert (fedhpro.tau, fedhpro.num_hyper, fedhpro.match_steps, fedhpro.hyper_lr) == (0.05, 5, 30, 0.1)
    assert (fedhpro.hpcl_weight, fedhpro.hpal_weight, fedhpro.margin) == (1.0, 1.0, "raw")
    assert (fedhpro.hpal_form, fedhpro.gradient_timing, fedhpro.gradient_samples_per_class) == ("normalized", "after", 0)
    assert {"fedavg", "fedhpro"} <= set(config.methods) and set(config.methods) == set(METHODS)
    assert config.data.clients_per_domain == PAPER_LAYOUT
    assert (config.data.fraction, config.data.test_fraction, config.data.syn_size) == (0.1, 0.2, 5000)
    # defaults are fresh objects: changing one config's mapping leaves the next one alone
    config.data.clients_per_domain["mnist"] = 99
    assert load_config(None).data.clients_per_domain == PAPER_LAYOUT


def test_override_strings_are_typed():
    config = load_config(None, ["rounds=3", "fedhpro.tau=0.1", "lr=1e-3", "progress=false", "clients=null",
                                "method=fedavg", "data.fraction=5e-2", "fedhpro.margin=normalized", "seed=7"])
    assert config.run.rounds == 3 and type(config.run.rounds) is int
    assert config.methods["fedhpro"].tau == 0.1 and type(config.methods["fedhpro"].tau) is float
    assert config.run.lr == 0.001 and type(config.run.lr) is float  # YAML reads "1e-3" as a string
    assert config.data.fraction == 0.05 and type(config.data.fraction) is float
    assert config.run.progress is False
    assert config.run.clients is None
    assert config.run.method == "fedavg" and config.run.seed == 7
    assert config.methods["fedhpro"].margin == "normalized"
    assert config.method_options is config.methods["fedavg"]
    # an integer given where a float is expected is a float; a whole float where an int is expected is an int
    config = load_config(None, ["lr=1", "rounds=4.0", "progress=yes"])
    assert type(config.run.lr) is float and config.run.lr == 1.0
    assert type(config.run.rounds) is int and config.run.rounds == 4
    assert config.run.progress is True


def test_quoted_off_is_accepted_for_the_margin():
    assert load_config(None, ['fedhpro.margin="off"']).methods["fedhpro"].margin == "off"
    assert load_config({"fedhpro": {"margin": "off"}}).methods["fedhpro"].margin == "off"


def test_bare_off_is_accepted_for_the_margin(tmp_path):
    assert load_config(None, ["fedhpro.margin=off"]).methods["fedhpro"].margin == "off"
    path = write(tmp_path / "off.yaml", "fedhpro:\n  margin: off\n")
    assert load_config(path).methods["fedhpro"].margin == "off"


def test_mapping_overrides_and_keyword_style():
    config = load_config({"rounds": 5, "fedhpro": {"num_hyper": 2}}, {"fedhpro.tau": 0.3, "data": {"syn_size": 300}})
    assert config.run.rounds == 5
    assert config.methods["fedhpro"].num_hyper == 2
    assert config.methods["fedhpro"].tau == 0.3
    assert config.data.syn_size == 300


def test_yaml_file_nested_sections_dotted_keys_and_overrides_win(tmp_path):
    path = write(tmp_path / "run.yaml", """
rounds: 7
method: fedavg
lr: 1.0e-3
fedhpro:
  tau: 0.2
  margin: normalized
fedhpro.num_hyper: 3
data:
  fraction: 0.05
data.syn_size: 400
""")
    config = load_config(path)
    assert config.run.rounds == 7 and config.run.method == "fedavg" and config.run.lr == 0.001
    assert config.methods["fedhpro"].tau == 0.2
    assert config.methods["fedhpro"].margin == "normalized"
    assert config.methods["fedhpro"].num_hyper == 3
    assert config.data.fraction == 0.05 and config.data.syn_size == 400
    assert config.data.clients_per_domain == PAPER_LAYOUT

    config = load_config(str(path), ["rounds=2", "fedhpro.tau=0.9", "data.syn_size=150", "method=fedhpro"])
    assert config.run.rounds == 2 and config.run.method == "fedhpro"
    assert config.methods["fedhpro"].tau == 0.9
    assert config.methods["fedhpro"].num_hyper == 3  # untouched keys keep the file's value
    assert config.data.syn_size == 150 and config.data.fraction == 0.05


def test_empty_yaml_file_gives_the_defaults(tmp_path):
    assert load_config(write(tmp_path / "empty.yaml", "")) == load_config(None)


def test_mapping_entry_merges_into_default_while_whole_mapping_replaces(tmp_path):
    merged = load_config(None, ["data.clients_per_domain.mnist=1"]).data.clients_per_domain
    assert merged == {**PAPER_LAYOUT, "mnist": 1}
    replaced = load_config(None, ["data.clients_per_domain={mnist: 1}"]).data.clients_per_domain
    assert replaced == {"mnist": 1}
    two = load_config(None, ["data.clients_per_domain.mnist=0", "data.clients_per_domain.syn=2"])
    assert two.data.clients_per_domain == {**PAPER_LAYOUT, "mnist": 0, "syn": 2}
    # the same in a YAML file: nested mapping replaces, dotted entry merges
    nested = write(tmp_path / "nested.yaml", "data:\n  clients_per_domain:\n    syn: 2\n")
    assert load_config(nested).data.clients_per_domain == {"syn": 2}
    dotted = write(tmp_path / "dotted.yaml", "data.clients_per_domain.syn: 2\n")
    assert load_config(dotted).data.clients_per_domain == {**PAPER_LAYOUT, "syn": 2}


def test_entry_override_edits_the_sources_mapping_not_the_defaults():
    config = load_config({"data": {"clients_per_domain": {"mnist": 2}}}, ["data.clients_per_domain.mnist=1"])
    assert config.data.clients_per_domain == {"mnist": 1}


def test_whole_mapping_override_beats_an_entry_in_the_source(tmp_path):
    path = write(tmp_path / "entry.yaml", "data.clients_per_domain.mnist: 2\n")
    config = load_config(path, ["data.clients_per_domain={syn: 1}"])
    assert config.data.clients_per_domain == {"syn": 1}


def test_load_config_does_not_mutate_the_callers_mapping():
    source = {"rounds": 3, "data": {"clients_per_domain": {"mnist": 2}}}
    original = copy.deepcopy(source)
    load_config(source, ["data.clients_per_domain.mnist=1"])
    assert source == original


def test_to_dict_round_trips_through_load_config_and_yaml(tmp_path):
    config = load_config(None, ["rounds=3", "fedhpro.tau=0.1", "lr=1e-3", "data.clients_per_domain={mnist: 2}",
                                "out=somewhere", "clients=5", "progress=false", "fedhpro.hpal_form=paper"])
    as_dict = config.to_dict()
    assert as_dict["rounds"] == 3 and as_dict["fedhpro"]["tau"] == 0.1 and as_dict["lr"] == 0.001
    assert as_dict["data"]["clients_per_domain"] == {"mnist": 2}
    assert "fedavg" not in as_dict  # FedAvg has no knobs
    assert load_config(as_dict) == config
    path = write(tmp_path / "saved.yaml", yaml.safe_dump(as_dict, sort_keys=False))
    assert load_config(path) == config
    assert load_config(None).to_dict() == load_config(load_config(None).to_dict()).to_dict()


# ----------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("overrides,words", [
    (["rouds=3"], ["'rouds'", "did you mean 'rounds'"]),
    (["fedhpro.tauu=0.1"], ["'fedhpro.tauu'", "did you mean 'fedhpro.tau'"]),
    (["data.fration=0.1"], ["'data.fration'", "did you mean 'data.fraction'"]),
    (["fedhpo.tau=0.1"], ["'fedhpo.tau'", "did you mean 'fedhpro.tau'"]),
    (["zzzzzz=1"], ["'zzzzzz'", "fedhpro config --keys"]),
    (["method=nosuch"], ["method", "nosuch", "fedavg", "fedhpro"]),
    (["dataset=nosuch"], ["dataset", "nosuch", "digits-offline"]),
    (["fedhpro.margin=cosine"], ["fedhpro.margin", "cosine", "raw", "normalized", "off"]),
    (["rounds=-1"], ["rounds=-1", ">= 1"]),
    (["rounds=0"], ["rounds=0", ">= 1"]),
    (["rounds=2.5"], ["rounds=2.5", "integer"]),
    (["rounds=many"], ["rounds='many'", "integer"]),
    (["participation=0"], ["participation=0", "> 0"]),
    (["participation=1.5"], ["participation=1.5", "<= 1"]),
    (["fedhpro.tau=0"], ["fedhpro.tau=0", "> 0"]),
    (["lr=nan"], ["lr=", "finite"]),
    (["progress=maybe"], ["progress='maybe'", "true or false"]),
    (["data.clients_per_domain=3"], ["data.clients_per_domain=3", "mapping"]),
    (["data.clients_per_domain.mnist=lots"], ["data.clients_per_domain.mnist", "integer"]),
    (["rounds"], ["'rounds'", "KEY=VALUE"]),
    (["=3"], ["no key"]),
])
def test_config_errors_name_the_key_and_the_choices(overrides, words):
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    message = str(error.value)
    assert "\n" not in message
    for word in words:
        assert word in message, (word, message)


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        load_config(None, ["rounds=-1"])


def test_missing_yaml_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="does not exist") as error:
        load_config(missing)
    assert str(missing) in str(error.value)


def test_invalid_yaml_file(tmp_path):
    path = write(tmp_path / "bad.yaml", "rounds: 3\nfedhpro: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML") as error:
        load_config(path)
    assert str(path) in str(error.value)
    assert "line" in str(error.value)


def test_yaml_file_that_is_not_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path / "list.yaml", "- rounds\n- 3\n"))


def test_yaml_file_errors_name_the_key(tmp_path):
    path = write(tmp_path / "typo.yaml", "fedhpro:\n  tua: 0.1\n")
    with pytest.raises(ConfigError, match=r"'fedhpro\.tua' \(did you mean 'fedhpro\.tau'[,?]"):
        load_config(path)


YAML_FILE_ERRORS = [
    (b"rounds: 3\n# caf\xe9 au lait\n", "is not UTF-8 text (byte 0xe9 at offset 15); save it as UTF-8"),
    ("rounds: 3\n".encode("utf-16"), "is not UTF-8 text (byte 0xff at offset 0); save it as UTF-8"),
    (b"- rounds\n- 3\n", "holds a YAML list, not a mapping of settings; write one 'key: value' per line"),
    (b"just text\n", "holds a YAML str, not a mapping of settings"),
    (b"rounds: 3\nfedhpro: [1, 2\n", "is not valid YAML at line 3, column 1 (expected ',' or ']'"),
    (b"rounds: 3\n\tlr: 1\n", "is not valid YAML at line 2, column 1 (found character '\\t'"),
    (b"a: b: c\n", "is not valid YAML at line 1, column 5 (mapping values are not allowed here)"),
    (b"seed: " + b"7" * 5000 + b"\n", "is not valid YAML (a whole number of more than 4300 digits)"),
    (b"rounds: 3\n1: 2\n", "unknown config key '1'"),
    (b"rounds: 3\n? [a, b]\n: 2\n", "is not valid YAML at line 2"),
]


@pytest.mark.parametrize("content, words", YAML_FILE_ERRORS,
                         ids=["latin-1", "utf-16", "list", "scalar", "unclosed", "tab", "mapping-in-value",
                              "huge-int", "int-key", "list-key"])
def test_every_bad_config_file_is_one_line_naming_the_file(content, words, tmp_path, capsys):
    from fedhpro.cli import main as cli_main

    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    for command in (["config", str(path)], ["run", str(path), f"out={tmp_path / 'out'}"]):
        assert cli_main(command) == 2
        captured = capsys.readouterr()
        lines = [line for line in captured.err.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
        assert lines[0].startswith(f"fedhpro: error: config file {str(path)!r} ") or "unknown config key" in lines[0]
        assert words in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------
# command line (subprocess)
# ----------------------------------------------------------------------------


def cli(args: list[str], cwd: Path, script: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    if script:
        command = [str(Path(sys.executable).parent / "fedhpro")]
    else:
        command = [sys.executable, "-m", "fedhpro"]
    return subprocess.run(command + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("args,words,script", [
    (["run", "method=nosuch"], ["method='nosuch'", "fedavg, fedhpro"], False),
    (["run", "rounds=-1"], ["rounds=-1", ">= 1"], False),
    (["run", "rouds=3"], ["'rouds'", "did you mean 'rounds'"], True),
    (["run", "missing.yaml", "rounds=1"], ["missing.yaml", "does not exist"], False),
], ids=["unknown-method", "negative-rounds", "typo-key-console-script", "missing-file"])
def test_cli_errors_are_one_line_without_traceback(tmp_path, args, words, script):
    if script and not (Path(sys.executable).parent / "fedhpro").exists():
        pytest.skip("the fedhpro console script is not installed next to this Python")
    result = cli(args, tmp_path, script=script)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("fedhpro: error:")
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert not (tmp_path / "runs").exists()  # nothing was started


@pytest.mark.slow
def test_cli_config_prints_a_loadable_resolved_config(tmp_path):
    result = cli(["config", "rounds=3", "fedhpro.tau=0.2", "data.clients_per_domain.mnist=1"], tmp_path)
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    expected = load_config(None, ["rounds=3", "fedhpro.tau=0.2", "data.clients_per_domain.mnist=1"])
    assert load_config(printed) == expected


# ----------------------------------------------------------------------------
# end to end on digits-offline
# ----------------------------------------------------------------------------

DOMAINS = ["mnist", "optdigits", "mnistm", "syn"]
TIMING = {"seconds", "elapsed"}


def tiny_run(data_dir: Path, out: Path, **extra):
    import fedhpro

    settings = {"rounds": 2, "clients": 4, "data.fraction": 0.02, "data.syn_size": DIGITS_SYN_SIZE,
                "data.test_fraction": DIGITS_TEST_FRACTION, "feature_dim": 32, "progress": False,
                "device": "cpu", "data_dir": str(data_dir), "out": str(out), "seed": 3, **extra}
    return fedhpro.run(**settings)


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def two_runs(digits_data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    return tiny_run(digits_data_dir, out / "first"), tiny_run(digits_data_dir, out / "second")


@pytest.mark.slow
def test_run_writes_config_metrics_summary_and_plot(two_runs):
    result, _ = two_runs
    out = result.out
    assert load_config(out / "config.yaml") == result.config
    assert result.config.run.rounds == 2 and result.config.run.clients == 4

    rows = read_rows(out / "metrics.jsonl")
    assert len(rows) == 2
    assert [row["round"] for row in rows] == [0, 1]
    assert rows == json.loads(json.dumps(result.metrics))
    for row in rows:
        assert row["participants"] == [0, 1, 2, 3]
        assert set(row["accuracy"]) == set(DOMAINS) | {"AVG"}
        assert all(0.0 <= value <= 100.0 for value in row["accuracy"].values())
        domain_mean = sum(row["accuracy"][d] for d in DOMAINS) / len(DOMAINS)
        assert row["accuracy"]["AVG"] == pytest.approx(domain_mean)
        assert {"ce", "hpcl", "hpal", "loss", "margin"} <= set(row["train"])
        assert {"gm_loss_before", "gm_loss_after", "hyper_movement"} <= set(row["server"])
        assert row["bytes_up"] > 0 and row["bytes_down"] > 0
    timing = read_rows(out / "timing.jsonl")  # wall times live in their own file, not in metrics.jsonl
    assert [row["round"] for row in timing] == [0, 1]
    assert all(row["clients"] > 0 and row["elapsed"] > 0 for row in timing)
    assert not any(TIMING & set(row) for row in rows)

    summary = json.loads((out / "summary.json").read_text())
    assert {"method", "dataset", "seed", "rounds", "accuracy", "per_domain", "seconds"} <= set(summary)
    assert (summary["method"], summary["dataset"], summary["seed"], summary["rounds"]) == \
        ("fedhpro", "digits-offline", 3, 2)
    assert summary["accuracy"] == pytest.approx(rows[-1]["accuracy"]["AVG"])
    assert summary["per_domain"] == {d: rows[-1]["accuracy"][d] for d in DOMAINS}
    assert summary["seconds"] > 0
    assert summary == json.loads(json.dumps(result.summary))
    assert result.accuracy == summary["accuracy"]

    png = (out / "accuracy.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    assert (out / "partition.json").is_file()


@pytest.mark.slow
def test_same_seed_runs_give_identical_metrics_jsonl(two_runs):
    first, second = two_runs
    assert (first.out / "metrics.jsonl").read_bytes() == (second.out / "metrics.jsonl").read_bytes()
    assert json.loads((first.out / "partition.json").read_text()) == \
        json.loads((second.out / "partition.json").read_text())
    summary_a = {k: v for k, v in first.summary.items() if k not in TIMING}
    summary_b = {k: v for k, v in second.summary.items() if k not in TIMING}
    assert summary_a == summary_b


# ----------------------------------------------------------------------------
# the sections table and the key kinds: declared once, used everywhere
# ----------------------------------------------------------------------------


def test_the_sections_table_orders_config_yaml_keys_and_shorthands():
    from fedhpro.cli import key_lines
    from fedhpro.config import SECTIONS, SHORTHANDS

    assert [section.name for section in SECTIONS] == ["data", "faults", "partition", "aggregation", "privacy"]
    assert SHORTHANDS == {"partition": "scheme", "aggregation": "rule", "privacy": "mode"}
    config = load_config(None, ["partition=iid", "aggregation=median"])
    # privacy off: config.yaml has no privacy section (runs from before privacy existed write the same file)
    assert list(config.to_dict())[-4:] == ["data", "faults", "partition", "aggregation"]
    assert (config.partition.scheme, config.aggregation.rule) == ("iid", "median")
    private = load_config(None, ["privacy=client", "privacy.clip=0.5"])
    assert list(private.to_dict())[-5:] == ["data", "faults", "partition", "aggregation", "privacy"]
    assert private.to_dict()["privacy"]["clip"] == 0.5 and private.privacy.mode == "client"
    assert load_config(private.to_dict()).to_dict() == private.to_dict()  # config.yaml loads back
    assert list(config.sections())[:len(METHODS)] == list(METHODS)
    assert list(config.sections())[len(METHODS):] == ["data", "faults", "partition", "aggregation", "privacy"]
    from fedhpro.flower.options import FLOWER_KEYS

    lines = key_lines("digits-offline")
    flower = len(FLOWER_KEYS)  # the Flower apps' keys end the listing, in the order the app's table declares them
    assert lines[-3 - flower:-flower] == ["partition: short for partition.scheme (default: auto)",
                                          "aggregation: short for aggregation.rule (default: mean)",
                                          "privacy: short for privacy.mode (default: none)"]
    assert [line.split(":")[0] for line in lines[-flower:]] == [entry.key for entry in FLOWER_KEYS]
    assert lines[-flower] == "flower.node-wait: Flower only: seconds to wait for the SuperNodes (default: 600.0)"
    for section in SECTIONS:
        assert any(line.startswith(f"{section.name}.") for line in lines)


def test_a_close_choice_is_suggested_in_one_line():
    with pytest.raises(ConfigError, match=r"dataset='cifar' is not valid \(did you mean 'cifar10'"):
        load_config(None, {"dataset": "cifar"})
    with pytest.raises(ConfigError, match=r"partition.scheme='dirichlett' is not valid \(did you mean 'dirichlet'"):
        load_config(None, {"partition": "dirichlett"})
    with pytest.raises(ConfigError, match=r"method='fedavgg' is not valid \(did you mean 'fedavg'"):
        load_config(None, {"method": "fedavgg"})


def test_a_flower_key_given_to_a_plain_run_says_where_it_belongs():
    # config --keys lists the flower.* keys; a plain run reads none of them and says so, not "unknown key"
    with pytest.raises(ConfigError, match=r"^'flower.node-wait' is a Flower setting: give it in a Flower run's "
                                          r"run config \(flwr run --run-config 'flower.node-wait=\.\.\.'\)"):
        load_config(None, ["flower.node-wait=3"])
