"""scikit-learn's wine data as one CSV-ready table of three sites (13 named features, a label, a site and a
split column), as a user of tabular data trains it: the tests of predictions by name, MLflow and ONNX share it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from sklearn.datasets import load_wine

FEATURES = list(load_wine().feature_names)


def wine_site_table(labels: Sequence[str] | None = None, site_prefix: str = "site-",
                    float32: bool = False) -> pd.DataFrame:
    """Wine's rows in a random permutation (seed 0) cut into 3 sites, 70 % of each site's rows ``train``,
    the rest ``test``; ``labels``: names for the class indices (default the indices); ``float32``: features as
    float32 (as a CSV run reads them) rather than float64."""
    x, y = load_wine(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    names = None if labels is None else np.array(list(labels))
    parts = []
    for k, rows in enumerate(np.array_split(order, 3)):
        cut = int(len(rows) * 0.7)
        for split, part in (("train", rows[:cut]), ("test", rows[cut:])):
            frame = pd.DataFrame(x[part].astype(np.float32) if float32 else x[part], columns=FEATURES)
            parts.append(frame.assign(label=y[part] if names is None else names[y[part]],
                                      site=f"{site_prefix}{k}", split=split))
    return pd.concat(parts, ignore_index=True)
