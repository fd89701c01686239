"""Predictions by name: ``fedhpro.predict`` on a DataFrame and ``fedhpro.load_estimator`` (scikit-learn's
``predict`` / ``predict_proba``, ``classes_``, ``feature_names_in_``, ``n_features_in_``), the issue "Your data
read right".

References, independent of the code under test: the network without its preprocessing on rows scaled here
by hand with numpy (the training rows' pooled mean and population std), ``fedhpro predict`` on a CSV of the
same rows (the path that reads columns by name since the CSV issue), and a trained model's own learnt
accuracy: columns in another order must not change a single prediction.
"""

from __future__ import annotations

import io

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image
from wine_table import FEATURES, wine_site_table

import fedhpro
from fedhpro.errors import DataError

#: named features, none of them in the order wine's columns come in sorted order
TINY = {"rounds": 3, "local_epochs": 2, "feature_dim": 16, "progress": False, "threads": 1, "device": "cpu",
        "seed": 3, "method": "fedavg", "model": "mlp", "batch_size": 16}


@pytest.fixture(scope="module")
def table_run(tmp_path_factory):
    """A run on one CSV table with site and split columns (wine: 13 named features, 3 sites), as the issue's
    user trained it, and the table."""
    base = tmp_path_factory.mktemp("by-name")
    table = wine_site_table(float32=True)
    table.to_csv(base / "table.csv", index=False)
    run = fedhpro.run(**TINY, dataset="clients", data_dir=str(base / "table.csv"), out=str(base / "run"))
    return run, table, base


@pytest.mark.slow
def test_a_shuffled_dataframe_gives_the_predictions_of_the_csv_and_of_rows_scaled_by_hand(table_run, tmp_path):
    run, table, _ = table_run
    test = table[table["split"] == "test"].reset_index(drop=True)
    features = test[FEATURES]
    shuffled = features[list(np.random.default_rng(1).permutation(FEATURES))]
    assert list(shuffled.columns) != FEATURES
    estimator = fedhpro.load_estimator(run.out)
    assert list(estimator.feature_names_in_) == FEATURES and estimator.n_features_in_ == 13
    assert list(estimator.classes_) == ["0", "1", "2"]
    # the reference by hand: every training row pooled, numpy's mean and population std, the bare network
    train = table[table["split"] == "train"][FEATURES].to_numpy(np.float64)
    mean, std = train.astype(np.float32).astype(np.float64).mean(0), train.astype(np.float32).astype(np.float64).std(0)
    scaled = torch.from_numpy(((features.to_numpy(np.float32).astype(np.float64) - mean) / std).astype(np.float32))
    with torch.no_grad():
        by_hand = torch.softmax(fedhpro.load_model(run.out, preprocess=False)(scaled).double(), 1).numpy()
    assert (by_hand.argmax(1) == test["label"].to_numpy()).mean() > 0.8  # a model that learnt: orders matter
    for frame in (features, shuffled, shuffled.to_dict(orient="list")):
        np.testing.assert_allclose(estimator.predict_proba(frame), by_hand, atol=1e-6)
        assert list(estimator.predict(frame)) == [str(k) for k in by_hand.argmax(1)]
    # fedhpro.predict on the DataFrame is fedhpro predict on a CSV of the same rows, to the byte
    rows = tmp_path / "rows.csv"
    test[["label", *shuffled.columns]].to_csv(rows, index=False)
    from_csv = fedhpro.predict(run.out, [rows])
    assert fedhpro.predict(run.out, pd.read_csv(rows), out=tmp_path / "frame.csv") == from_csv
    assert (tmp_path / "frame.csv").read_text() == from_csv
    table_out = pd.read_csv(io.StringIO(from_csv))
    assert list(table_out["predicted"].astype(str)) == list(estimator.predict(shuffled))
    by_mapping = pd.read_csv(io.StringIO(fedhpro.predict(run.out, shuffled.to_dict(orient="list"))))
    added = ["predicted", "p_0", "p_1", "p_2"]
    pd.testing.assert_frame_equal(by_mapping[added], table_out[added])


@pytest.mark.slow
def test_a_site_s_statistics_by_name_equal_predict_on_the_csv(table_run, tmp_path):
    run, table, _ = table_run
    test = table[(table["split"] == "test") & (table["site"] == "site-2")]
    rows = tmp_path / "site.csv"
    test[FEATURES].to_csv(rows, index=False)
    reference = pd.read_csv(io.StringIO(fedhpro.predict(run.out, [rows], site="site-2")))
    estimator = fedhpro.TrainedClassifier.from_run(run.out, site="site-2")
    probabilities = estimator.predict_proba(test[FEATURES[::-1]])
    np.testing.assert_allclose(probabilities, reference[[f"p_{c}" for c in "012"]].to_numpy(), rtol=1e-5, atol=1e-6)
    assert list(estimator.predict(test[FEATURES[::-1]])) == list(reference["predicted"].astype(str))


@pytest.mark.slow
def test_missing_or_extra_columns_are_refused_in_one_line_naming_them(table_run):
    run, table, _ = table_run
    estimator = fedhpro.load_estimator(run.out)
    rows = table[FEATURES].head(4)
    with pytest.raises(DataError) as missing:
        estimator.predict(rows.drop(columns=["proline", "hue"]))
    assert "'hue', 'proline'" in str(missing.value) and "give every feature column" in str(missing.value)
    with pytest.raises(DataError) as extra:
        estimator.predict(table[[*FEATURES, "label"]].head(4))
    assert "'label'" in str(extra.value) and "drop it" in str(extra.value)
    for error in (missing.value, extra.value):
        assert "\n" not in str(error)
    # predict on a DataFrame reads it as a CSV of rows: a label column is kept beside, a missing one refused
    with pytest.raises(DataError, match="'hue'"):
        fedhpro.predict(run.out, rows.drop(columns=["hue"]))
    with pytest.raises(DataError, match="no rows"):
        estimator.predict(rows.iloc[:0])
    with pytest.raises(DataError, match="holds text"):
        estimator.predict(rows.astype(str).assign(hue="pale"))


@pytest.mark.slow
def test_a_tensor_of_the_wrong_width_is_one_line_naming_the_features(table_run):
    run, table, _ = table_run
    module = fedhpro.load_model(run.out)
    rows = torch.from_numpy(table[FEATURES].head(3).to_numpy(np.float32).copy())
    with torch.no_grad():
        assert module(rows).shape == (3, 3)  # the right width passes
        with pytest.raises(DataError) as caught:
            module(rows[:, :12])
    message = str(caught.value)
    assert "N x 13 features" in message and "alcohol, malic_acid" in message and "(3, 12)" in message
    assert "load_estimator" in message and "\n" not in message
    with pytest.raises(DataError, match="N x 13 features"):
        fedhpro.load_estimator(run.out).predict(rows[:, :12].numpy())
    with pytest.raises(DataError, match="one row"):
        fedhpro.load_estimator(run.out).predict(rows[0].numpy())
    # an array is taken in the run's feature order (feature_names_in_), as scikit-learn takes arrays
    estimator = fedhpro.load_estimator(run.out)
    assert list(estimator.predict(rows.numpy())) == list(estimator.predict(table[FEATURES].head(3)))


@pytest.fixture(scope="module")
def image_run(finished_runs, tmp_path_factory):
    return finished_runs.copy("image", tmp_path_factory.mktemp("image"))


def test_the_estimator_of_an_image_run_takes_pixels_flat_arrays_and_files(image_run, tmp_path):
    estimator = fedhpro.load_estimator(image_run.out)
    assert estimator.feature_names_in_ is None and estimator.n_features_in_ == 3 * 32 * 32
    pixels = np.random.default_rng(0).integers(0, 256, (5, 3, 32, 32), dtype=np.uint8)
    with torch.no_grad():
        reference = torch.softmax(fedhpro.load_model(image_run.out)(torch.from_numpy(pixels)).double(), 1).numpy()
    np.testing.assert_allclose(estimator.predict_proba(pixels), reference, atol=1e-7)
    np.testing.assert_allclose(estimator.predict_proba(pixels.reshape(5, -1)), reference, atol=1e-7)
    paths = []
    for i, image in enumerate(pixels):
        paths.append(tmp_path / f"{i}.png")
        Image.fromarray(image.transpose(1, 2, 0)).save(paths[-1])
    by_files = pd.read_csv(io.StringIO(fedhpro.predict(image_run.out, paths)))
    assert list(estimator.predict(paths)) == list(by_files["predicted"].astype(str))
    assert list(estimator.predict([str(p) for p in paths])) == list(estimator.classes_[reference.argmax(1)])
    with pytest.raises(DataError, match="not rows of a table"):
        estimator.predict(pd.DataFrame({"a": [1.0]}))
    with pytest.raises(DataError, match="N x 3 x 32 x 32"):
        estimator.predict(pixels[:, :, :16])


@pytest.mark.slow
def test_score_is_scikit_learns_accuracy_by_name_or_index(table_run):
    from sklearn.metrics import accuracy_score

    run, table, _ = table_run
    test = table[table["split"] == "test"].reset_index(drop=True)
    estimator = fedhpro.load_estimator(run.out)
    predicted = estimator.predict(test[FEATURES])
    reference = accuracy_score(test["label"].astype(str), predicted.astype(str))
    assert reference > 0.8  # a model that learnt
    assert estimator.score(test[FEATURES], test["label"]) == pytest.approx(reference)  # indices 0..2
    assert estimator.score(test[FEATURES], test["label"].astype(str)) == pytest.approx(reference)  # names
    for y, message in ((np.full(len(test), 5), "y holds the class index 5, outside 0..2"),
                       (["malbec"] * len(test), "y holds 'malbec', which is not one of the run's classes"),
                       (test["label"][:3], f"y has 3 labels for {len(test)} inputs")):
        with pytest.raises(DataError, match=message) as error:
            estimator.score(test[FEATURES], y)
        assert "\n" not in str(error.value)
