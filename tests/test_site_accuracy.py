"""The reported accuracy cannot be carried by one site, and a run's end says what it spent.

* summary.json's ``site_accuracy`` (each client's accuracy on its own test set, their unweighted mean and
  median) and the printout's ``per client`` line, next to the pooled accuracy, which weights every client by
  the size of its test set: a client holding most of the pooled test samples carries the pooled figure, not
  these; it is also named in one warning line (``aggregation.max_share``), printed and kept in the notes.
* with privacy on, the final printout carries (epsilon, delta) also with ``progress=false``; a near-vacuous
  delta is one warning line (:func:`fedhpro.privacy.privacy_warnings`), printed and kept in the notes.
* a run that ``privacy.max_epsilon`` stops before its first round writes strict JSON (null, not NaN).

The runs use a model that predicts class 2 whatever it is given and whatever training does (features
multiplied by zero, a frozen classifier favouring class 2), so every accuracy is known by hand from the
labels of the test sets.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import fedhpro
from fedhpro.data.federation import Federation

pytestmark = pytest.mark.slow

SHAPE = (4,)


class Class2Net(nn.Module):
    """Predicts class 2 of 4 for every input: its features are zero and its classifier is frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Flatten(), nn.Linear(4, 3), Zero())
        self.classifier = nn.Linear(3, 4)
        with torch.no_grad():
            self.classifier.weight.zero_()
            self.classifier.bias.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0]))
        self.classifier.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class Zero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.0


def labelled(n: int, label: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, *SHAPE, generator=torch.Generator().manual_seed(seed)), torch.full((n,), label)


def sites(tests: list[tuple[int, int]], domains: list[str] | None = None) -> Federation:
    """One client per ``(test size, test label)``, each with its own test split (federated evaluation, pooled
    per domain, or in one test set ``all``) and 8 training samples of every class."""
    train = [(torch.randn(8, *SHAPE, generator=torch.Generator().manual_seed(k)), torch.arange(8) % 4)
             for k in range(len(tests))]
    return Federation.from_tensors(train, [labelled(n, label, 100 + k) for k, (n, label) in enumerate(tests)],
                                   num_classes=4, domains=domains)


def run(federation: Federation, out: Path, **settings) -> fedhpro.RunResult:
    return fedhpro.run(federation=federation, model=Class2Net, method="fedavg", rounds=2, local_epochs=1,
                       batch_size=4, progress=False, device="cpu", threads=1, out=str(out), echo=True, **settings)


def strict_json(text: str):
    """JSON as the standard has it: NaN and Infinity are refused."""
    return json.loads(text, parse_constant=lambda constant: (_ for _ in ()).throw(ValueError(constant)))


def test_one_site_holding_most_of_its_test_set_carries_the_pooled_accuracy_not_the_per_site_figures(tmp_path,
                                                                                                   capsys):
    # test set a: site 0 has 10 samples of class 0 (0 % right), site 1 70 of class 2 (100 %); test set b:
    # site 2, 70 of class 0 (0 %)
    result = run(sites([(10, 0), (70, 2), (70, 0)], domains=["a", "a", "b"]), tmp_path / "run")
    summary = strict_json((tmp_path / "run" / "summary.json").read_text())
    # a's pooled figure is site 1's: 100 * 70 / 80 = 87.5 plain, 75 with site 1's count capped at
    # aggregation.max_share=0.75 of a's (the size caps are tested with them)
    assert summary["per_domain"]["b"] == 0.0 and 75.0 - 1e-9 <= summary["per_domain"]["a"] <= 87.5 + 1e-9
    assert summary["accuracy"] == pytest.approx(summary["per_domain"]["a"] / 2)
    site = summary["site_accuracy"]
    assert site["per_client"] == [0.0, 100.0, 0.0] and site["tested"] == 3
    assert site["mean"] == pytest.approx(100.0 / 3) and site["median"] == 0.0
    assert result.summary == summary
    out, err = capsys.readouterr()
    assert "per client (unweighted, 3 tested): mean 33.3, median 0.0" in out.splitlines()
    # site 1 holds 70 of the 80 test samples of a (87.5 %), more than aggregation.max_share's default 0.75;
    # b is tested on by site 2 alone: nothing pooled there
    warning = "client 1 holds 70 of the 80 test samples of test set 'a' (87.5%), more than aggregation.max_share=0.75"
    assert [line for line in err.splitlines() if "test samples of test set" in line] == [
        line for line in err.splitlines() if line.startswith(f"fedhpro: warning: {warning}")]
    assert len([line for line in err.splitlines() if warning in line]) == 1
    assert [note for note in summary["notes"] if "test samples of test set" in note] == [
        note for note in summary["notes"] if note.startswith(warning)]
    assert len([note for note in summary["notes"] if note.startswith(warning)]) == 1


def test_balanced_sites_or_a_higher_max_share_give_no_warning(tmp_path, capsys):
    # 40 + 30 + 30: nobody above half (pooled 100 * (40 + 0 + 30) / 100, per site 100, 0, 100); then 80 of
    # 100 under aggregation.max_share=0.9 (pooled 80, per site 0, 0, 100)
    for name, tests, settings, pooled, mean in (
            ("balanced", [(40, 2), (30, 0), (30, 2)], {}, 70.0, 200.0 / 3),
            ("allowed", [(10, 0), (10, 0), (80, 2)], {"aggregation.max_share": 0.9}, 80.0, 100.0 / 3)):
        result = run(sites(tests), tmp_path / name, **settings)
        assert not any("test samples of test set" in note for note in result.summary["notes"])
        assert "test samples of test set" not in capsys.readouterr().err
        assert result.summary["accuracy"] == pytest.approx(pooled)
        assert result.summary["site_accuracy"]["mean"] == pytest.approx(mean)


def test_privacy_prints_epsilon_and_delta_without_a_progress_bar(tmp_path, capsys):
    result = run(sites([(10, 2), (10, 0), (10, 2)]), tmp_path / "run", privacy="client")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    epsilon = rows[-1]["privacy"]["epsilon"]
    assert rows[-1]["privacy"]["delta"] == pytest.approx(3 ** -1.1)  # the default delta, 1 / n^1.1 for n = 3
    out, err = capsys.readouterr()
    assert f"privacy (client): (epsilon, delta) = ({epsilon:.4g}, 0.299) after 2 rounds" in out.splitlines()
    assert result.summary["privacy"]["epsilon"] == epsilon
    # 3^-1.1 = 0.2987 is at least 0.1, a near-vacuous delta for 3 clients: one warning, said and kept
    warning = "privacy.delta=0.2987 (the default 1/N^1.1) is at least 0.1 for 3 clients"
    assert len([line for line in err.splitlines() if line.startswith(f"fedhpro: warning: {warning}")]) == 1
    assert len([note for note in result.summary["notes"] if note.startswith(warning)]) == 1
    # a small delta: no such line
    result = run(sites([(10, 2), (10, 0), (10, 2)]), tmp_path / "small", privacy="client",
                 **{"privacy.delta": 1e-5})
    assert "privacy.delta" not in capsys.readouterr().err
    assert not any("privacy.delta" in note for note in result.summary["notes"])


def test_a_privacy_stop_before_the_first_round_writes_strict_json_with_null_accuracy(tmp_path, capsys):
    result = run(sites([(10, 2), (10, 0), (10, 2)]), tmp_path / "run", privacy="client",
                 **{"privacy.max_epsilon": 1e-9})
    text = (tmp_path / "run" / "summary.json").read_text()
    summary = strict_json(text)  # NaN here raises
    assert strict_json(json.dumps(result.summary)) == summary  # the summary fedhpro.run returns, too
    assert summary["accuracy"] is None and summary["best_accuracy"] is None and summary["per_domain"] == {}
    assert summary["site_accuracy"] == {"mean": None, "median": None, "tested": 0, "per_client": []}
    assert summary["privacy"]["rounds_run"] == 0 and "before round 0" in summary["privacy"]["stopped"]
    assert result.accuracy is None
    out = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("note: ")]
    assert "fedavg on custom, seed 0, 2 rounds" in out[0] and out[0].endswith(
        "— test accuracy (%): no round evaluated")
    assert out[1] == "privacy (client): (epsilon, delta) = (0, 0.299) after 0 rounds; stopped at privacy.max_epsilon"


def test_a_shared_test_set_run_has_per_client_figures_of_its_domains_and_no_warning(tmp_path, capsys):
    # one global model on shared test sets: each client is scored on its domain's set (none pooled per client)
    train = [(torch.randn(8, *SHAPE, generator=torch.Generator().manual_seed(k)), torch.arange(8) % 4)
             for k in range(3)]
    federation = Federation.from_tensors(train, {"a": labelled(10, 2, 1), "b": labelled(30, 0, 2)},
                                         domains=["a", "a", "b"], num_classes=4)
    result = run(federation, tmp_path / "run")
    assert result.summary["per_domain"] == {"a": 100.0, "b": 0.0} and result.summary["accuracy"] == 50.0
    site = result.summary["site_accuracy"]
    assert site["per_client"] == [100.0, 100.0, 0.0]
    assert site["mean"] == pytest.approx(200.0 / 3) and site["median"] == 100.0
    assert not any("test samples of test set" in note for note in result.summary["notes"])
    assert "per client (unweighted, 3 tested): mean 66.7, median 100.0" in capsys.readouterr().out.splitlines()
