"""No domain is dropped in silence: where ``clients=K`` (or ``data.clients_per_domain``) leaves a domain of a
domain-skew data set without a client, the run says which, that it is neither trained on nor tested, and
what AVG covers; the README's tiny example gives every domain a client.

The reference is the round robin worked by hand: ``clients=3`` over digits-offline's four domains in the
paper's order (mnist, optdigits, mnistm, syn) gives mnist, optdigits and mnistm one client each and syn none.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION

from fedhpro import cli
from fedhpro.config import load_config
from fedhpro.data import get_dataset

ROOT = Path(__file__).resolve().parents[1]
SMALL = [f"data.syn_size={DIGITS_SYN_SIZE}", f"data.test_fraction={DIGITS_TEST_FRACTION}", "data.fraction=0.02"]


def _build(digits_data_dir: Path, *overrides: str):
    config = load_config(None, [*SMALL, *overrides])
    return get_dataset("digits-offline").build(config.data, config.run.clients, config.run.seed,
                                               data_dir=digits_data_dir, partition=config.partition)


def _dropped(notes: list[str]) -> list[str]:
    return [note for note in notes if "no client" in note]


def test_three_clients_on_four_domains_name_the_dropped_one(digits_data_dir):
    federation = _build(digits_data_dir, "clients=3")
    assert federation.client_domains == ["mnist", "optdigits", "mnistm"]
    assert list(federation.test_sets) == ["mnist", "optdigits", "mnistm"]
    assert _dropped(federation.notes) == [
        "digits-offline: clients=3 is fewer than its 4 domains, so domain syn gets no client: not trained on, "
        "not tested, and AVG covers mnist, optdigits, mnistm only; set clients=4 or more to give every domain "
        "a client, or choose the domains with data.domains=[mnist,optdigits,mnistm]"]
    # the same rule under a label partition within the domains
    iid = _build(digits_data_dir, "clients=2", "partition=iid")
    assert sorted(set(iid.client_domains)) == ["mnist", "optdigits"]
    assert "so domains mnistm, syn get no client" in _dropped(iid.notes)[0]


def test_every_domain_with_a_client_or_left_out_on_purpose_says_nothing(digits_data_dir):
    assert _dropped(_build(digits_data_dir, "clients=4").notes) == []
    assert _dropped(_build(digits_data_dir, "data.clients_per_domain.syn=0").notes) == []  # 0: on purpose
    assert _dropped(_build(digits_data_dir, "clients=2", "data.domains=[mnist,syn]").notes) == []
    # a data.clients_per_domain that does not name a domain of data.domains
    partial = _build(digits_data_dir, "data.clients_per_domain={mnist: 2, syn: 1}")
    assert list(partial.test_sets) == ["mnist", "syn"]
    assert _dropped(partial.notes) == [
        "digits-offline: data.clients_per_domain gives domains optdigits, mnistm no client: not trained on, not "
        "tested, and AVG covers mnist, syn only; give every domain its clients in data.clients_per_domain (0 "
        "leaves one out on purpose), or choose the domains with data.domains=[mnist,syn]"]


def test_one_wording_for_the_downloaded_domain_benchmarks():
    """digits and office-caltech (downloaded data) call the same note with their domains and layout."""
    from fedhpro.data.federation import domains_without_clients_note

    names = ["caltech", "webcam", "amazon", "dslr"]
    assert domains_without_clients_note("office-caltech", names, {"caltech": 1, "webcam": 1}, 2) == (
        "office-caltech: clients=2 is fewer than its 4 domains, so domains amazon, dslr get no client: not "
        "trained on, not tested, and AVG covers caltech, webcam only; set clients=4 or more to give every "
        "domain a client")
    assert domains_without_clients_note("office-caltech", names, dict.fromkeys(names, 1), 4) is None
    assert domains_without_clients_note("digits", ["mnist", "usps"], {"mnist": 3}, None, ["usps"]) is None


@pytest.mark.slow
def test_a_run_says_it_at_start_and_avg_covers_the_named_domains(digits_data_dir, tmp_path, capsys):
    out = tmp_path / "three"
    code = cli.main(["run", "method=fedavg", "rounds=1", "clients=3", "local_epochs=1", "feature_dim=16",
                     "progress=false", "threads=1", f"data_dir={digits_data_dir}", f"out={out}", *SMALL])
    assert code == 0
    printed = capsys.readouterr().out
    assert "note: digits-offline: clients=3 is fewer than its 4 domains, so domain syn gets no client" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["per_domain"]) == ["mnist", "optdigits", "mnistm"]
    assert summary["accuracy"] == pytest.approx(sum(summary["per_domain"].values()) / 3, abs=1e-6)
    assert len(_dropped(summary["notes"])) == 1


def _readme_tiny_run() -> list[str]:
    """The README's tiny ``fedhpro run`` example (its "Run" section), as arguments."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    line = next(line for line in text.splitlines() if re.match(r"fedhpro run method=\S+ rounds=1 ", line))
    return shlex.split(line)[1:]


@pytest.mark.slow
def test_the_readme_tiny_example_keeps_every_domain(digits_data_dir, tmp_path):
    args = [arg for arg in _readme_tiny_run() if not arg.startswith("out=")]
    assert cli.main([*args, "threads=1", f"data_dir={digits_data_dir}", f"out={tmp_path / 'readme'}",
                     f"data.syn_size={DIGITS_SYN_SIZE}", f"data.test_fraction={DIGITS_TEST_FRACTION}"]) == 0
    summary = json.loads((tmp_path / "readme" / "summary.json").read_text())
    assert list(summary["per_domain"]) == ["mnist", "optdigits", "mnistm", "syn"]
    assert _dropped(summary["notes"]) == []
