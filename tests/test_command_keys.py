"""The keys the commands take for themselves (``fedhpro compare``, ``tune``, ``report``, ``reproduce`` and the
sweep's), declared in :mod:`fedhpro.command_options`: listed by ``fedhpro config --keys`` and the config reference
with their defaults, a bad value refused in one line naming the key and the fix (exit 2, no traceback) before any
run, and the declarations importable without torch."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from fedhpro.cli import main as cli_main
from fedhpro.command_options import COMMAND_OPTIONS, Sweep
from fedhpro.command_options.keys import take
from fedhpro.command_options.report import DEFAULT_TAIL_RATIO
from fedhpro.command_options.reproduce import SCALES
from fedhpro.errors import ConfigError
from fedhpro.reports.classes import DEFAULT_TAIL_RATIO as REPORTS_TAIL_RATIO
from fedhpro.reproduce.targets import SCALES as TARGET_SCALES
from fedhpro.tune import Tuning, check

ROOT = Path(__file__).resolve().parents[1]

#: every command key with its default as ``fedhpro config --keys`` must show it, written out by hand
EXPECTED_DEFAULTS = [
    ("compare", "methods", "unset"), ("compare", "seeds", "[0, 1, 2]"), ("compare", "out", "runs/compare"),
    ("compare", "tuned", "unset"), ("compare", "jobs", "1"), ("compare", "executor [local|ray]", "local"),
    ("compare", "ray.address", "unset"),
    ("tune", "methods", '["fedavg"]'), ("tune", "trials", "20"), ("tune", "out", "runs/tune"), ("tune", "jobs", "1"),
    ("tune", "storage", "unset"), ("tune", "pruner [median|none]", "median"), ("tune", "lr_range", "[0.001, 0.1]"),
    ("report", "out", "unset"), ("report", "force", "false"), ("report", "per_class", "false"),
    ("report", "tail_ratio", "2.0"),
    ("reproduce", "scale [paper|smoke]", "paper"), ("reproduce", "seeds", "unset"), ("reproduce", "out", "unset"),
    ("reproduce", "jobs", "1"), ("reproduce", "executor [local|ray]", "local"), ("reproduce", "ray.address", "unset"),
]

OPTION_MODULES = ["fedhpro.command_options", "fedhpro.command_options.keys", "fedhpro.command_options.sweep",
                  "fedhpro.command_options.compare", "fedhpro.command_options.tune",
                  "fedhpro.command_options.report", "fedhpro.command_options.reproduce"]


def reference_gen() -> ModuleType:
    """docs/reference_gen.py, the generator of the config reference (not a package module)."""
    spec = importlib.util.spec_from_file_location("reference_gen", ROOT / "docs" / "reference_gen.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("module", OPTION_MODULES)
def test_the_declarations_leave_torch_unloaded(module):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_config_keys_lists_every_command_key_with_its_help_and_default(capsys):
    assert cli_main(["config", "--keys"]) == 0
    lines = capsys.readouterr().out.splitlines()
    commands = [line for line in lines if line.split(":", 1)[0] in ("compare", "tune", "report", "reproduce")]
    assert len(commands) == len(EXPECTED_DEFAULTS)
    for (command, key, default), line in zip(EXPECTED_DEFAULTS, commands):
        assert line.startswith(f"{command}: {key}: ") and line.endswith(f" (default: {default})"), line
        help_text = line[len(f"{command}: {key}: "):-len(f" (default: {default})")]
        assert len(help_text) > 20, line  # a help, not an empty field
    # after the run's keys, before the sections' shorthands and the flower.* keys
    assert lines.index(commands[0]) > lines.index(next(line for line in lines if line.startswith("lr: ")))
    assert lines.index(commands[-1]) < lines.index(next(line for line in lines if line.startswith("flower.")))


def test_the_config_reference_has_a_table_per_command():
    text = reference_gen().config_keys_markdown()
    section = text[text.index("## Command keys"):]
    for command in COMMAND_OPTIONS:
        assert f"### `{command}`\n\nThe keys of `fedhpro {command}`:" in section
    compare = section[section.index("### `compare`"):section.index("### `tune`")]
    assert '`ray.address`</span> |  | <span class="config-code">`null`</span>' in compare
    assert '`seeds`</span> |  | <span class="config-code">`[0, 1, 2]`</span>' in compare
    tune = section[section.index("### `tune`"):section.index("### `report`")]
    assert '`lr_range`</span> |  | <span class="config-code">`[0.001, 0.1]`</span>' in tune


@pytest.mark.parametrize("argv, said", [
    (["compare", "seeds=[0,x]"], "seeds=['0', 'x'] must be integers, e.g. seeds=[0,1,2]"),
    (["compare", "methods=[]"], "methods is empty; give e.g. methods=[a,b]"),
    (["compare", "jobs=0"], "jobs=0 is not valid; give the number of runs at a time, e.g. jobs=4"),
    (["compare", "executor=dask"], "executor='dask' is not valid; choose one of: local, ray"),
    (["compare", "ray.address=auto"], "ray.address= is used only with executor=ray; add executor=ray"),
    (["tune", "trials=-2"], "trials=-2 gives no trial; give the trials per method, a whole number >= 1"),
    (["tune", "trials=many"], "trials='many' gives no trial"),
    (["tune", "jobs=0"], "jobs=0 is not valid; give the worker processes, a whole number >= 1, e.g. jobs=2"),
    (["tune", "pruner=hyperband"], "pruner='hyperband' is not valid"),
    (["tune", "lr_range=[0.1,0.01]"], "lr_range=[0.1, 0.01] is not a range of learning rates; give [low, high] "
                                      "with 0 < low < high"),
    (["tune", "lr_range=0.01"], "lr_range=[0.01] is not a range of learning rates"),
    (["tune", "lr_range=[0.001,0.01]", "lr=0.05"], "lr= fixes the learning rate, so lr_range="),
    (["report", "runs/nowhere", "force=maybe"], "force='maybe' is not a boolean; use force=true"),
    (["report", "runs/nowhere", "per_class=true", "tail_ratio=0.5"], "tail_ratio=0.5 is not a number of at least 1"),
    (["report", "runs/nowhere", "tail_ratio=3"], "tail_ratio= shapes the per-class report only; add per_class=true"),
    (["report", "runs/nowhere", "colour=red"], "fedhpro report takes run folders and out=, force=, per_class=, "
                                               "tail_ratio= only, not colour"),
    (["reproduce", "table3", "scale=huge"], "scale='huge' is not valid; choose one of: paper, smoke"),
    (["reproduce", "table3", "seeds=[a]"], "seeds=['a'] must be integers"),
    (["reproduce", "table3", "executor=spark"], "executor='spark' is not valid; choose one of: local, ray"),
])
def test_a_bad_command_key_is_one_line_naming_the_key_and_the_fix(argv, said, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may be written; if it were, it goes here
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and said in err, err
    assert list(tmp_path.iterdir()) == []  # refused before any run or folder


def test_a_refused_command_key_exits_2_in_one_line_from_the_shell(tmp_path):
    result = subprocess.run([sys.executable, "-m", "fedhpro", "tune", "pruner=hyperband", f"out={tmp_path / 't'}"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "pruner='hyperband' is not valid" in lines[0], result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "t").exists()


def test_take_moves_the_command_keys_out_and_leaves_the_run_keys():
    pairs = {"jobs": "3", "executor": "local", "lr": 0.05, "dataset": "digits"}
    assert take(Sweep, pairs) == Sweep(jobs=3, executor="local", ray_address=None)
    assert pairs == {"lr": 0.05, "dataset": "digits"}
    assert take(Sweep, {}) == Sweep()


def test_the_declarations_agree_with_the_code_that_reads_them():
    """Constants a declaration states for the listing, which the code below it also holds."""
    assert DEFAULT_TAIL_RATIO == REPORTS_TAIL_RATIO == 2.0
    assert SCALES == TARGET_SCALES == ("paper", "smoke")


def test_an_option_check_error_without_refuse_text_is_the_checks_own():
    with pytest.raises(ConfigError, match=r"^executor='rey' is not valid \(did you mean 'ray'"):
        take(Sweep, {"executor": "rey"})


@pytest.mark.parametrize("change, said", [
    ({"trials": 0}, "trials=0 gives no trial; give the trials per method"),
    ({"jobs": 0}, "jobs=0 is not valid; give the worker processes"),
    ({"pruner": "hyperband"}, "pruner='hyperband' is not valid"),
])
def test_a_tuning_made_in_python_is_checked_as_its_command_keys_are(change, said, tmp_path):
    tuning = Tuning(**{"methods": ("fedavg",), "trials": 2, "settings": {}, "out": tmp_path / "t", **change})
    with pytest.raises(ConfigError, match=re.escape(said)):
        check(tuning)
