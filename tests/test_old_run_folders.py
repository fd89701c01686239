"""Run folders written by an earlier fedhpro still load: an interrupted run resumes from its checkpoint and ends
as the uninterrupted run did, ``fedhpro report`` tables a finished one, ``fedhpro predict`` gives what its
stored model gives, its checkpoint loads, and ``fedhpro compare tuned=`` runs at a stored ``tuned.yaml``.

The folders (tests/data/old_runs/, written once by its make.py and never refreshed) are copied to a temporary
folder before each use; they read their data from ``$FEDHPRO_DATA_DIR``, pointed at the session's digits-offline
cache, which is the one they were made on (make.py's SYN_SIZE, TEST_FRACTION and BUILD_SEED).
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from conftest import DIGITS_BUILD_SEED, DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION
from finished_runs import DIGITS

import fedhpro
from fedhpro.api import run
from fedhpro.cli import main as cli_main
from fedhpro.config import load_config
from fedhpro.data import get_dataset
from fedhpro.engines import checkpoint

pytestmark = pytest.mark.slow  # the resume and compare tests train (a few seconds each)

OLD_RUNS = Path(__file__).parent / "data" / "old_runs"


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def stored(tmp_path, digits_data_dir, monkeypatch):
    """``stored(name)``: a copy of tests/data/old_runs/<name>, its data read from the session's cache."""
    monkeypatch.setenv("FEDHPRO_DATA_DIR", str(digits_data_dir))
    monkeypatch.chdir(tmp_path)  # a folder's config.yaml names its out= relative to where it was made

    def copy(name: str) -> Path:
        return Path(shutil.copytree(OLD_RUNS / name, tmp_path / name))

    return copy


def test_the_stored_folders_were_made_on_the_cache_the_tests_build():
    from tests.data.old_runs.make import BUILD_SEED, SYN_SIZE, TEST_FRACTION

    assert (SYN_SIZE, TEST_FRACTION, BUILD_SEED) == (DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION, DIGITS_BUILD_SEED)
    assert (DIGITS["syn_size"], DIGITS["test_fraction"]) == (DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION)  # finished_runs


def test_an_interrupted_run_resumes_from_its_checkpoint_and_ends_as_the_uninterrupted_run_did(stored):
    folder = stored("interrupted")
    before = rows_of(folder / "metrics.jsonl")
    assert [row["round"] for row in before] == [0, 1] and not (folder / "summary.json").exists()
    result = run(overrides=[f"resume={folder}"], echo=False)
    after = rows_of(folder / "metrics.jsonl")
    assert [row["round"] for row in after] == [0, 1, 2]
    assert after[:2] == before  # the stored rows kept as they were, the third continues them
    # the reference: the same run left to finish by the fedhpro that stored the folder (make.py)
    assert after == rows_of(OLD_RUNS / "interrupted_reference.jsonl")
    assert result.summary["accuracy"] == pytest.approx(after[-1]["accuracy"]["AVG"], abs=1e-12)
    assert json.loads((folder / "summary.json").read_text())["rounds"] == 3


def test_report_tables_a_stored_finished_run(stored, tmp_path):
    folder = stored("finished")
    summary = json.loads((folder / "summary.json").read_text())
    assert cli_main(["report", str(folder), f"out={tmp_path / 'report'}"]) == 0
    (row,) = csv.DictReader((tmp_path / "report" / "table.csv").open())
    assert row["run"] == "fedavg" and int(row["rounds"]) == summary["rounds"] == 2
    assert float(row["AVG"]) == pytest.approx(summary["accuracy"], abs=1e-4)
    for domain, accuracy in summary["per_domain"].items():
        assert float(row[domain]) == pytest.approx(accuracy, abs=1e-4)


def federation_of(folder: Path):
    config = load_config(folder / "config.yaml")
    return get_dataset(config.run.dataset).build(config.data, config.run.clients, config.run.seed,
                                                 data_dir=config.run.data_dir, partition=config.partition)


def test_predict_gives_the_stored_models_probabilities_and_the_model_scores_what_the_run_reported(stored, tmp_path,
                                                                                                   capsys):
    folder = stored("finished")
    model = fedhpro.load_model(folder)
    federation = federation_of(folder)
    summary = json.loads((folder / "summary.json").read_text())
    # independent reference: the stored run's own evaluation, per test set
    for name, accuracy in summary["per_domain"].items():
        x, y = federation.test_sets[name]
        with torch.no_grad():
            assert 100.0 * float((model(x).argmax(1) == y).double().mean()) == pytest.approx(accuracy, abs=1e-9)
    inputs = federation.test_sets["mnist"][0][:8]
    torch.save(inputs, tmp_path / "inputs.pt")
    with torch.no_grad():
        expected = torch.softmax(model(inputs).double(), dim=1)
    capsys.readouterr()
    assert cli_main(["predict", str(folder), str(tmp_path / "inputs.pt")]) == 0
    rows = list(csv.DictReader(capsys.readouterr().out.splitlines()))
    assert len(rows) == 8
    for row, probabilities in zip(rows, expected):
        assert [float(row[f"p_{c}"]) for c in range(10)] == pytest.approx(probabilities.tolist(), rel=1e-5, abs=1e-7)
        assert row["predicted"] == str(int(probabilities.argmax()))


def state_dicts_in(value) -> list[dict]:
    """Every mapping of names to tensors nested in a checkpoint's state (where the global weights sit is the
    engine's business)."""
    if isinstance(value, dict):
        if value and all(isinstance(v, torch.Tensor) for v in value.values()):
            return [value]
        return [found for v in value.values() for found in state_dicts_in(v)]
    if isinstance(value, (list, tuple)):
        return [found for v in value for found in state_dicts_in(v)]
    return []


def test_a_stored_checkpoint_loads_with_the_runs_rows_and_its_final_weights(stored):
    folder = stored("finished")
    assert checkpoint.saved_rounds(folder) == [2]
    blob = checkpoint.load(checkpoint.latest(folder))
    assert blob["completed_rounds"] == 2
    assert blob["metrics"] == rows_of(folder / "metrics.jsonl")
    final = torch.load(folder / "model.pt", weights_only=True)
    held = [weights for weights in state_dicts_in(blob[checkpoint.STATE]) if set(weights) == set(final)]
    assert held and all(torch.equal(held[0][name], final[name]) for name in final)


def test_compare_runs_each_method_at_the_settings_of_a_stored_tuned_yaml(stored, tmp_path):
    tuned_folder = stored("tune")
    tuned = yaml.safe_load((tuned_folder / "tuned.yaml").read_text())
    best = tuned["methods"]["fedavg"]
    settings = [f"{key}={value}" for key, value in tuned["tuning"]["settings"].items()
                if key not in ("seed", "validation")]
    out = tmp_path / "compare"
    assert cli_main(["compare", f"tuned={tuned_folder / 'tuned.yaml'}", "methods=[fedavg]", "seeds=[0]",
                     "progress=false", "threads=1", *settings, f"out={out}"]) == 0
    (config,) = [load_config(path) for path in out.rglob("config.yaml")]
    assert config.run.lr == pytest.approx(best["lr"], rel=1e-12) and config.run.max_grad_norm == best["max_grad_norm"]
    assert config.run.seed == 0 and config.run.rounds == 1
    assert (out / "table.csv").is_file()
