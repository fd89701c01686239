"""model.onnx says what it is: the class names, the input, the feature order and the preprocessing in its
``metadata_props`` (JSON strings), the issue "your model shipped right".

References: onnx's own loader for the file's metadata_props, onnxruntime (a second runtime) for the scores, read
by the metadata alone (the classes' names, the columns' order) against ``fedhpro.predict`` on the same rows,
and standardize.json for the statistics the graph states it applies.
"""

from __future__ import annotations

import io
import json

import numpy as np
import onnx
import onnxruntime
import pandas as pd
import pytest
from wine_table import FEATURES, wine_site_table

import fedhpro
from fedhpro.trained.onnx_export import METADATA_KEYS, export_onnx


def _metadata(path) -> tuple[onnxruntime.InferenceSession, dict]:
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session, {key: json.loads(value) for key, value in session.get_modelmeta().custom_metadata_map.items()}


@pytest.mark.slow
def test_a_tabular_model_onnx_names_its_classes_and_columns(tmp_path):
    table = wine_site_table(labels=["barolo", "merlot", "shiraz"], site_prefix="s")
    table.to_csv(tmp_path / "table.csv", index=False)
    run = fedhpro.run(dataset="clients", data_dir=str(tmp_path / "table.csv"), method="fedavg", model="mlp",
                      rounds=2, local_epochs=2, batch_size=16, feature_dim=16, progress=False, threads=1, seed=3,
                      out=str(tmp_path / "run"))
    exported = export_onnx(run.out)
    stored = {entry.key: entry.value for entry in onnx.load(str(exported.path)).metadata_props}
    assert set(METADATA_KEYS) <= set(stored) and stored == exported.metadata
    session, meta = _metadata(exported.path)
    assert meta["fedhpro.classes"] == ["barolo", "merlot", "shiraz"] and meta["fedhpro.features"] == FEATURES
    assert meta["fedhpro.input"] == "raw rows" and meta["fedhpro.input_shape"] == ["batch", 13]
    pooled = json.loads((run.out / "standardize.json").read_text())["pooled"]
    assert meta["fedhpro.preprocessing"]["in_graph"] is True
    assert meta["fedhpro.preprocessing"]["mean"] == pooled["mean"] and meta["fedhpro.preprocessing"]["std"] == \
        pooled["std"]
    test = table[table["split"] == "test"]
    shuffled = test[list(np.random.default_rng(4).permutation(FEATURES))]
    rows = shuffled[meta["fedhpro.features"]].to_numpy(np.float32)  # ordered by the file's own metadata
    scores = session.run(None, {"input": rows})[0]
    reference = pd.read_csv(io.StringIO(fedhpro.predict(run.out, shuffled)))
    assert [meta["fedhpro.classes"][k] for k in scores.argmax(1)] == list(reference["predicted"])
    assert (reference["predicted"].to_numpy() == test["label"].to_numpy()).mean() > 0.6  # a model that learnt


def test_an_image_model_onnx_names_its_classes_and_no_columns(tmp_path, finished_runs):
    run = finished_runs.copy("image", tmp_path)
    session, meta = _metadata(export_onnx(run.out).path)
    assert meta["fedhpro.features"] is None and meta["fedhpro.input"] == "uint8 pixels"
    assert meta["fedhpro.classes"] == json.loads((run.out / "model.json").read_text())["classes"]
    assert meta["fedhpro.preprocessing"]["in_graph"] is True
    pixels = np.random.default_rng(0).integers(0, 256, (7, 3, 32, 32), dtype=np.uint8)
    scores = session.run(None, {"input": pixels})[0]
    expected = fedhpro.load_estimator(run.out).predict(pixels)
    assert [meta["fedhpro.classes"][k] for k in scores.argmax(1)] == list(expected)

