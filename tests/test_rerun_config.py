"""``fedhpro run runs/x/config.yaml`` runs the same configuration again (the run-folder docs say so): the stumble
where it was refused because the file's ``out=`` holds the run that wrote it.

References: the first run's own metrics.jsonl (the same config and seed give the same bytes) and the folders on
disk.
"""

from __future__ import annotations

import pytest
from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION

from fedhpro.cli import main

pytestmark = pytest.mark.slow


def _settings(data_dir, out) -> list[str]:
    return ["method=fedavg", "rounds=1", "clients=4", "local_epochs=1", "feature_dim=16", "progress=false",
            "threads=1", "data.fraction=0.02", f"data.syn_size={DIGITS_SYN_SIZE}",
            f"data.test_fraction={DIGITS_TEST_FRACTION}", f"data_dir={data_dir}", f"out={out}"]


def test_a_run_folders_config_runs_again_into_a_fresh_folder(digits_data_dir, tmp_path, capsys):
    first = tmp_path / "first"
    assert main(["run", *_settings(digits_data_dir, first)]) == 0
    capsys.readouterr()
    assert main(["run", str(first / "config.yaml")]) == 0
    printed = capsys.readouterr().out
    assert f"names out={first}, which holds a run; this run writes to {first}-2" in printed
    assert (tmp_path / "first-2" / "metrics.jsonl").read_bytes() == (first / "metrics.jsonl").read_bytes()
    assert main(["run", str(first / "config.yaml")]) == 0  # and again: the next free name
    assert (tmp_path / "first-3" / "summary.json").is_file()
    capsys.readouterr()
    assert main(["run", str(first / "config.yaml"), f"out={tmp_path / 'chosen'}"]) == 0  # out= given wins
    assert "which holds a run" not in capsys.readouterr().out and (tmp_path / "chosen" / "summary.json").is_file()
