"""The run shipped to MLflow (``tracker=mlflow``), the issue "your model shipped right": the trained model as an
MLflow model and the run's figures as artifacts.

References: MLflow's own loader (``mlflow.pyfunc.load_model``, by artifact URI and by ``runs:/``) against
``fedhpro.predict`` on the same rows or pixels; MLflow's client for the artifacts, whose figure must be the
run folder's own file to the byte.
"""

from __future__ import annotations

import io

import numpy as np
import pandas as pd
import pytest
from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION
from wine_table import FEATURES, wine_site_table

import fedhpro

pytestmark = pytest.mark.slow


def _tracked(out) -> tuple:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{(out / 'mlflow.db').resolve()}"
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("fedhpro").experiment_id])
    return client, run, uri


@pytest.fixture(scope="module")
def table_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("mlflow-table")
    table = wine_site_table()
    table.to_csv(base / "table.csv", index=False)
    run = fedhpro.run(dataset="clients", data_dir=str(base / "table.csv"), method="fedavg", model="mlp", rounds=2,
                      local_epochs=2, batch_size=16, feature_dim=16, progress=False, threads=1, seed=3,
                      tracker="mlflow", out=str(base / "run"))
    return run, table


def test_the_mlflow_model_of_a_tabular_run_predicts_as_fedhpro_by_name(table_run, monkeypatch):
    import mlflow.pyfunc

    run, table = table_run
    client, tracked, uri = _tracked(run.out)
    artifacts = {item.path for item in client.list_artifacts(tracked.info.run_id)}
    assert {"model", "accuracy.png", "accuracy.svg", "accuracy.pdf", "standardize.json"} <= artifacts
    logged = client.download_artifacts(tracked.info.run_id, "accuracy.png", str(run.out.parent))
    assert open(logged, "rb").read() == (run.out / "accuracy.png").read_bytes()  # the run's own figure
    test = table[table["split"] == "test"].reset_index(drop=True)
    shuffled = test[list(np.random.default_rng(2).permutation(FEATURES))]
    reference = pd.read_csv(io.StringIO(fedhpro.predict(run.out, test[FEATURES])))
    model = mlflow.pyfunc.load_model(f"{tracked.info.artifact_uri}/model")
    assert [spec.name for spec in model.metadata.get_input_schema().inputs] == FEATURES
    answer = model.predict(shuffled)
    assert list(answer["predicted"]) == list(reference["predicted"].astype(str))
    np.testing.assert_allclose(answer[["p_0", "p_1", "p_2"]].to_numpy(), reference[["p_0", "p_1", "p_2"]].to_numpy(),
                               rtol=1e-5, atol=1e-6)
    assert (answer["predicted"].astype(int) == test["label"]).mean() > 0.6  # a model that learnt
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # runs:/ as the docs load it
    by_run = mlflow.pyfunc.load_model(f"runs:/{tracked.info.run_id}/model")
    assert list(by_run.predict(test[FEATURES])["predicted"]) == list(answer["predicted"])


def test_the_mlflow_model_of_an_image_run_takes_pixels(tmp_path, digits_data_dir):
    import mlflow.pyfunc

    run = fedhpro.run(method="fedavg", rounds=1, clients=4, local_epochs=1, feature_dim=16, progress=False,
                      threads=1, data_dir=str(digits_data_dir), out=str(tmp_path / "run"), tracker="mlflow",
                      **{"data.fraction": 0.02, "data.syn_size": DIGITS_SYN_SIZE,
                         "data.test_fraction": DIGITS_TEST_FRACTION})
    client, tracked, _ = _tracked(run.out)
    model = mlflow.pyfunc.load_model(f"{tracked.info.artifact_uri}/model")
    pixels = np.random.default_rng(0).integers(0, 256, (6, 3, 32, 32), dtype=np.uint8)
    expected = fedhpro.load_estimator(run.out).predict(pixels)
    assert list(model.predict(pixels)["predicted"]) == list(expected)
    assert "accuracy.png" in {item.path for item in client.list_artifacts(tracked.info.run_id)}


def test_a_run_with_personal_models_says_why_it_has_no_mlflow_model(tmp_path, digits_data_dir):
    run = fedhpro.run(method="fedproto", rounds=1, clients=3, local_epochs=1, feature_dim=16, progress=False,
                      threads=1, data_dir=str(digits_data_dir), out=str(tmp_path / "run"), tracker="mlflow",
                      **{"fedproto.protocol": "proto-only", "data.fraction": 0.02, "data.syn_size": DIGITS_SYN_SIZE,
                         "data.test_fraction": DIGITS_TEST_FRACTION})
    client, tracked, _ = _tracked(run.out)
    assert "model" not in {item.path for item in client.list_artifacts(tracked.info.run_id)}
    assert "own models" in tracked.data.tags["fedhpro.model"]
