"""The Flower ServerApp writes summary.json through the same ``driver.run_summary`` as ``fedhpro run``, so its
summary carries ``site_accuracy`` too: checked in process (the ServerApp against the ClientApp's handlers,
test_flower_resume.InProcessGrid), with personal models that every node tests on its own data."""

from __future__ import annotations

import json
import statistics

import pytest

pytest.importorskip("flwr", reason="the Flower engine needs the flower extra: pip install -e '.[flower]'")

from test_flower import read_rows, tiny_config  # noqa: E402
from test_flower_resume import InProcessGrid, inside_a_run, node_contexts  # noqa: E402, F401

import fedhpro  # noqa: E402
from fedhpro.flower.server import run_server  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_flower_run_has_the_simulators_site_accuracy(digits_data_dir, tmp_path, inside_a_run):  # noqa: F811
    settings = tiny_config(digits_data_dir, method="fedproto", rounds=2, **{"fedproto.protocol": "proto-only"})
    run_server(InProcessGrid(node_contexts(tmp_path / "node-state")), {}, {**settings, "out": str(tmp_path / "fl")})
    summary = json.loads((tmp_path / "fl" / "summary.json").read_text())
    per_client = read_rows(tmp_path / "fl" / "metrics.jsonl")[-1]["client_accuracy"]
    assert len(per_client) == 3 and None not in per_client
    site = summary["site_accuracy"]
    assert site == {"mean": pytest.approx(sum(per_client) / 3), "median": sorted(per_client)[1], "tested": 3,
                    "per_client": per_client}
    assert site["median"] == statistics.median(per_client)
    expected = fedhpro.run(settings, out=str(tmp_path / "sim")).summary["site_accuracy"]
    assert site == expected
