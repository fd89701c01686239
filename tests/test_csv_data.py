"""Own tabular data as CSV files and pandas DataFrames: the issue "No CSV".

The references are independent of the code under test: the same arrays saved with ``np.savez`` (the
``.npz`` reader fedhpro had before), pandas' own reading and category codes, and a run on the ``.npz``
files. A CSV federation must equal the ``.npz`` one bit for bit; text labels must become the classes
``predict`` names; DataFrames must give the same run, byte for byte; and each bad table is one line.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import fedhpro
from fedhpro import cli
from fedhpro.arrays import MAX_ARRAY_BYTES_VARIABLE
from fedhpro.config import load_config
from fedhpro.data import get_dataset
from fedhpro.data.clients import ClientInfo, load_client, resolve_classes, scan_client
from fedhpro.data.tables import read_csv
from fedhpro.errors import DataError
from fedhpro.reports.tables import csv_text
from fedhpro.trained import predict
from fedhpro.trained.prediction import labelled_accuracy

SITES = ("site-0", "site-1", "site-2")
#: wine's three cultivars as names whose sorted order is not the order in which they first appear
NAMES = np.array(["shiraz", "barolo", "merlot"])
TINY = {"rounds": 1, "local_epochs": 1, "feature_dim": 16, "progress": False, "threads": 1, "device": "cpu",
        "seed": 3, "method": "fedavg", "model": "mlp", "batch_size": 8}


def wine_parts() -> dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """scikit-learn's wine data (13 features, 3 classes) in 3 sites, 70 % of each site's rows to train."""
    from sklearn.datasets import load_wine

    x, y = load_wine(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    parts = {}
    for name, rows in zip(SITES, np.array_split(order, 3)):
        cut = int(len(rows) * 0.7)
        parts[name] = {"train": (x[rows[:cut]].astype(np.float32), y[rows[:cut]]),
                       "test": (x[rows[cut:]].astype(np.float32), y[rows[cut:]])}
    return parts


FEATURES = [f"f{j}" for j in range(13)]


def frame_of(x: np.ndarray, y: np.ndarray, names: bool = False) -> pd.DataFrame:
    frame = pd.DataFrame(x, columns=FEATURES)
    frame["label"] = NAMES[y] if names else y
    return frame


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    """The same arrays as .npz folders, CSV folders (integer and named labels), one CSV table with site and
    split columns, and a folder with train.csv and test.csv holding a site column."""
    base = tmp_path_factory.mktemp("csv")
    parts = wine_parts()
    tables = {"train": [], "test": []}
    for name, splits in parts.items():
        for split, (x, y) in splits.items():
            for kind in ("npz", "csv", "named"):
                (base / kind / name).mkdir(parents=True, exist_ok=True)
            np.savez(base / "npz" / name / f"{split}.npz", x=x, y=y)
            frame_of(x, y).to_csv(base / "csv" / name / f"{split}.csv", index=False)
            frame_of(x, y, names=True).to_csv(base / "named" / name / f"{split}.csv", index=False)
            tables[split].append(frame_of(x, y).assign(site=name, split=split))
    table = pd.concat(tables["train"] + tables["test"], ignore_index=True)  # the sites' rows interleaved
    table.to_csv(base / "table.csv", index=False)
    (base / "pair").mkdir()
    for split in ("train", "test"):
        pd.concat(tables[split]).drop(columns="split").to_csv(base / "pair" / f"{split}.csv", index=False)
    return {"base": base, "npz": base / "npz", "csv": base / "csv", "named": base / "named",
            "table": base / "table.csv", "pair": base / "pair"}


def build(data_dir: Path, *overrides: str):
    config = load_config(None, ["dataset=clients", f"data_dir={data_dir}", *overrides])
    return get_dataset("clients").build(config.data, None, 0, data_dir=config.run.data_dir,
                                        partition=config.partition)


def assert_same_federation(a, b) -> None:
    assert a.client_names == b.client_names and a.client_domains == b.client_domains
    assert a.num_classes == b.num_classes and a.input_shape == b.input_shape
    for one, other in zip(a.clients, b.clients):
        assert one.x.dtype == other.x.dtype and torch.equal(one.x, other.x)
        assert torch.equal(one.y, other.y)
    assert len(a.client_tests) == len(b.client_tests)
    for (x, y), (xo, yo) in zip(a.client_tests, b.client_tests):
        assert torch.equal(x, xo) and torch.equal(y, yo)


# ----------------------------------------------------------------------------------- the same federation


@pytest.mark.parametrize("layout", ["csv", "table", "pair"])
@pytest.mark.parametrize("standardize", ["client", "none"])
def test_a_csv_federation_equals_the_npz_one_bit_for_bit(data, layout, standardize):
    """Site folders of CSV files, one table with site and split columns, and a train.csv/test.csv pair with
    a site column give the tensors the .npz files of the same arrays give."""
    reference = build(data["npz"], f"data.standardize={standardize}")
    federation = build(data[layout], f"data.standardize={standardize}")
    assert_same_federation(federation, reference)
    assert federation.partition["classes"] == reference.partition["classes"] == ["0", "1", "2"]
    assert federation.partition["columns"] == FEATURES and federation.partition["label_column"] == "label"
    raw = build(data[layout], "data.standardize=none")
    x, _ = wine_parts()["site-1"]["train"]
    assert torch.equal(raw.clients[1].x, torch.from_numpy(x))  # the arrays themselves


def test_text_labels_are_classes_in_sorted_order_or_as_data_classes_says(data):
    federation = build(data["named"])
    expected = sorted(NAMES.tolist())  # barolo, merlot, shiraz
    assert federation.partition["classes"] == expected
    frame = pd.read_csv(data["named"] / "site-2" / "test.csv")
    codes = pd.Categorical(frame["label"], categories=expected).codes  # pandas' own mapping
    assert federation.client_tests[2][1].tolist() == codes.tolist()
    ordered = build(data["named"], "data.classes=[shiraz,barolo,merlot]")
    assert ordered.partition["classes"] == NAMES.tolist()
    assert ordered.client_tests[2][1].tolist() == pd.Categorical(frame["label"], categories=NAMES).codes.tolist()
    assert_same_federation(build(data["named"], "data.classes=[shiraz,barolo,merlot]", "data.standardize=none"),
                           build(data["npz"], "data.standardize=none"))


def test_the_site_and_label_columns_are_named_by_keys(data, tmp_path):
    frame = pd.read_csv(data["table"]).rename(columns={"site": "hospital", "label": "diagnosis", "split": "part"})
    frame.to_csv(tmp_path / "renamed.csv", index=False)
    federation = build(tmp_path / "renamed.csv", "data.site_column=hospital", "data.label_column=diagnosis",
                       "data.split_column=part")
    assert_same_federation(federation, build(data["npz"]))


def test_a_node_holding_one_csv_folder_loads_the_federation_s_client(data):
    """A Flower node reads only its own folder: scan_client's JSON-able description, the classes resolved over
    every node's, and load_client give client k of the simulated federation (text labels included)."""
    options = load_config(None, ["dataset=clients"]).data
    infos = [scan_client(data["named"] / name, options) for name in SITES]
    echoed = [ClientInfo(**json.loads(json.dumps(dataclasses.asdict(info)))) for info in infos]
    classes = resolve_classes(echoed, options)
    assert classes == sorted(NAMES.tolist()) and infos[1].class_names == classes
    federation = build(data["named"])
    # data.standardize=federated: the node scales by the shared statistics the server sends it in the config
    scaling = federation.partition["scaling"]
    options = dataclasses.replace(options, feature_mean=scaling["mean"], feature_std=scaling["std"])
    for k, name in enumerate(SITES):
        (x, y), (xt, yt), _ = load_client(data["named"] / name, options, classes)
        assert torch.equal(x, federation.clients[k].x) and torch.equal(y, federation.clients[k].y)
        assert torch.equal(xt, federation.client_tests[k][0]) and torch.equal(yt, federation.client_tests[k][1])


# ----------------------------------------------------------------------------------- DataFrames


@pytest.mark.slow
def test_dataframes_give_the_csv_federation_and_the_same_run_bytes(data, tmp_path):
    parts = wine_parts()
    per_site = {name: (frame_of(*splits["train"], names=True), frame_of(*splits["test"], names=True))
                for name, splits in parts.items()}
    by_mapping = fedhpro.from_dataframes(per_site)
    assert_same_federation(by_mapping, build(data["named"]))
    one_frame = fedhpro.from_dataframes(pd.read_csv(data["table"]))
    assert_same_federation(one_frame, build(data["table"]))
    from_csv = fedhpro.run(**TINY, dataset="clients", data_dir=str(data["named"]), out=str(tmp_path / "csv"))
    from_frames = fedhpro.run(**TINY, out=str(tmp_path / "frames"), federation=by_mapping)
    for name in ("metrics.jsonl", "standardize.json", "model.pt"):
        assert (from_frames.out / name).read_bytes() == (from_csv.out / name).read_bytes(), name
    rows = data["named"] / "site-0" / "test.csv"
    assert predict(from_frames.out, [rows], out=tmp_path / "a.csv") == predict(from_csv.out, [rows],
                                                                               out=tmp_path / "b.csv")


# ----------------------------------------------------------------------------------- predict on a CSV


@pytest.fixture(scope="module")
def named_run(data, tmp_path_factory):
    return fedhpro.run(**{**TINY, "rounds": 3}, dataset="clients", data_dir=str(data["named"]),
                       out=str(tmp_path_factory.mktemp("named") / "run"))


@pytest.mark.slow
def test_predict_on_a_csv_writes_names_beside_the_rows(data, named_run, tmp_path, capsys):
    rows = tmp_path / "rows.csv"
    source = pd.read_csv(data["named"] / "site-1" / "test.csv")
    source[["label"] + FEATURES[::-1]].to_csv(rows, index=False)  # columns in another order: found by name
    assert json.loads((named_run.out / "model.json").read_text())["classes"] == sorted(NAMES.tolist())
    assert cli.main(["predict", str(named_run.out), str(rows)]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    written = (tmp_path / "rows.predictions.csv").read_text()
    assert printed == written
    table = pd.read_csv(tmp_path / "rows.predictions.csv")
    probabilities = [f"p_{name}" for name in sorted(NAMES.tolist())]
    assert list(table.columns) == ["label"] + FEATURES[::-1] + ["predicted"] + probabilities
    pd.testing.assert_frame_equal(table[source.columns], source)  # the rows kept as they were, label included
    assert set(table["predicted"]) <= set(NAMES.tolist())
    assert (table["predicted"] == table[probabilities].idxmax(axis=1).str.removeprefix("p_")).all()
    correct, total = labelled_accuracy(named_run.out, written)
    assert (correct, total) == (int((table["predicted"] == table["label"]).sum()), len(source))
    assert f"accuracy {100 * correct / total:.1f} % on {total} labelled rows" in captured.err  # the CLI says it
    assert labelled_accuracy(named_run.out, predict(named_run.out, [data["npz"] / "site-0" / "test.npz"])) is None


@pytest.mark.slow
def test_predict_on_csv_rows_equals_predict_on_the_same_rows_as_npz(data, tmp_path):
    run = fedhpro.run(**TINY, dataset="clients", data_dir=str(data["npz"]), out=str(tmp_path / "run"))
    for site in (None, "site-2"):
        from_npz = list(csv.DictReader(io.StringIO(predict(run.out, [data["npz"] / "site-2" / "test.npz"],
                                                           site=site))))
        text = predict(run.out, [data["csv"] / "site-2" / "test.csv"], out=tmp_path / "out.csv", site=site)
        from_csv = list(csv.DictReader(io.StringIO(text)))
        assert (tmp_path / "out.csv").read_text() == text
        assert len(from_csv) == len(from_npz) > 0
        labels = [str(int(y)) for y in np.load(data["npz"] / "site-2" / "test.npz")["y"]]
        hits = sum(reference["predicted"] == label for reference, label in zip(from_npz, labels))
        assert labelled_accuracy(run.out, text) == (hits, len(labels))  # integer labels against names "0".."2"
        for row, reference in zip(from_csv, from_npz):
            assert row["predicted"] == reference["predicted"]
            assert [float(row[f"p_{c}"]) for c in "012"] == [float(reference[f"p_{c}"]) for c in "012"]
    mixed = predict(run.out, [data["npz"] / "site-0" / "test.npz", data["csv"] / "site-0" / "test.csv"])
    names = [row["path"] for row in csv.DictReader(io.StringIO(mixed))]
    assert names[0].endswith("test.npz[0]") and names[-1].endswith("test.csv[" + str(len(names) // 2 - 1) + "]")
    assert (data["csv"] / "site-0" / "test.predictions.csv").is_file()


# ----------------------------------------------------------------------------------- refusals


def _bad_tables(root: Path) -> dict[str, tuple[Path, list[str], str]]:
    """name -> (data_dir, overrides, word the line must hold): each one bad CSV among good ones."""
    parts = wine_parts()
    cases = {}

    def federation(name: str, change, overrides: tuple[str, ...] = (), changed: tuple[str, ...] = ("train",)) -> None:
        folder = root / name.replace(" ", "-")
        for site, splits in parts.items():
            (folder / site).mkdir(parents=True)
            for split, (x, y) in splits.items():
                frame = frame_of(x, y, names=True)
                if site == "site-1" and split in changed:
                    frame = change(frame)
                frame.to_csv(folder / site / f"{split}.csv", index=False)
        cases[name] = (folder, list(overrides), WORDS[name])

    WORDS = {"text column": "'f3' holds 'high' in row 6 of the file", "no label column": "no label column 'label'",
             "missing values": "'f5' has 2 missing values", "missing labels": "'label' has 1 missing value",
             "infinite value": "'f0' holds 1 infinite", "other columns": "not those of",
             "names and indices": "give every client's labels the same way", "label elsewhere": "no label column",
             "names and indices in a site": "its train and test labels mix class names and class indices",
             "label spellings": "'Merlot' (client site-1) and 'merlot' (client site-",
             "header only": "site-1 has no training data"}
    federation("text column", lambda f: f.assign(f3=["high" if i == 4 else str(v) for i, v in enumerate(f["f3"])]))
    federation("no label column", lambda f: f.rename(columns={"label": "class"}))
    federation("missing values", lambda f: f.assign(f5=[np.nan if i in (2, 7) else v for i, v in enumerate(f["f5"])]))
    federation("missing labels", lambda f: f.assign(label=[None if i == 1 else v for i, v in enumerate(f["label"])]))
    federation("infinite value", lambda f: f.assign(f0=[np.inf if i == 0 else v for i, v in enumerate(f["f0"])]))
    federation("other columns", lambda f: f[["label"] + FEATURES[::-1]])
    def indices(frame: pd.DataFrame) -> pd.DataFrame:
        return frame.assign(label=frame["label"].map({name: i for i, name in enumerate(NAMES)}))

    federation("names and indices", indices, changed=("train", "test"))  # one site's labels are class indices
    federation("names and indices in a site", indices)  # its training labels only
    federation("label spellings", lambda f: f.assign(label=f["label"].where(f.index != 0, "Merlot")))
    federation("header only", lambda f: f.iloc[:0])  # pandas reads its columns as text: no rows, not text
    federation("label elsewhere", lambda f: f, ("data.label_column=diagnosis",))
    return cases


@pytest.mark.slow
def test_each_bad_table_is_one_line_naming_the_column(tmp_path, capsys):
    for name, (data_dir, overrides, word) in _bad_tables(tmp_path / "bad").items():
        out = tmp_path / "runs" / name.replace(" ", "-")
        code = cli.main(["run", "dataset=clients", f"data_dir={data_dir}", *overrides, f"out={out}", *[
            f"{k}={v}" for k, v in TINY.items()]])
        err = capsys.readouterr().err.strip()
        assert code != 0, name
        assert err.startswith("fedhpro: error:") and "\n" not in err and "Traceback" not in err, (name, err)
        assert word in err, (name, err)
        assert not out.exists(), name


def test_a_table_without_split_or_site_column_is_one_line(data, tmp_path):
    frame = pd.read_csv(data["table"])
    frame.drop(columns="split").to_csv(tmp_path / "nosplit.csv", index=False)
    frame.drop(columns="site").to_csv(tmp_path / "nosite.csv", index=False)
    frame.assign(split=frame["split"].replace("test", "holdout")).to_csv(tmp_path / "odd.csv", index=False)
    for name, word in (("nosplit", "no split column 'split'"), ("nosite", "no site column 'site'"),
                       ("odd", "holds 'holdout'")):
        with pytest.raises(DataError, match=word) as error:
            build(tmp_path / f"{name}.csv")
        assert "\n" not in str(error.value)


def test_a_csv_is_bounded_as_a_npz_is(data, tmp_path, monkeypatch):
    path = data["csv"] / "site-0" / "train.csv"
    size = path.stat().st_size
    monkeypatch.setenv("FEDHPRO_MAX_ARRAY_BYTES", str(size - 1))
    with pytest.raises(DataError, match=f"{size:,} bytes, over fedhpro's limit"):
        build(data["csv"])
    # rows x columns as float32 bounded too: 100 rows of 10 one-digit values are 2,000 bytes of text but 4,000
    # of float32; under a limit of 3,000 the file is read up to 75 rows (3,000 / (10 x 4)) and refused
    small = tmp_path / "bits.csv"
    pd.DataFrame(np.random.default_rng(0).integers(0, 2, (100, 10)), columns=[*"abcdefghi", "label"]).to_csv(
        small, index=False)
    assert small.stat().st_size < 3000
    monkeypatch.setenv("FEDHPRO_MAX_ARRAY_BYTES", "3000")
    with pytest.raises(DataError, match="more than 75 rows of 10 columns"):
        read_csv(small)


@pytest.mark.slow
def test_predict_refuses_a_csv_without_the_run_s_columns_in_one_line(data, named_run, tmp_path, capsys):
    pd.read_csv(data["named"] / "site-0" / "test.csv").drop(columns="f7").to_csv(tmp_path / "short.csv",
                                                                               index=False)
    assert cli.main(["predict", str(named_run.out), str(tmp_path / "short.csv")]) != 0
    err = capsys.readouterr().err.strip()
    assert "'f7'" in err and "\n" not in err and "Traceback" not in err
    assert not (tmp_path / "short.predictions.csv").exists()


# ----------------------------------------------------------------------------------- formula-looking cells

#: class names a spreadsheet would take for formulas (OWASP's list: = + - @)
FORMULA_NAMES = np.array(["=1+2", "@SUM(A1)", "-2+3"])


@pytest.mark.slow
def test_predictions_csvs_escape_formula_looking_cells(tmp_path):
    """Class names, kept cells and column names that start like a formula are written with a leading ``'``
    (OWASP), in both predictions CSVs; numbers (negative ones included) and other text are as they were. The
    reference: every cell as Python's csv reads it, against the rows and names given."""
    parts = wine_parts()
    for name, splits in parts.items():
        (tmp_path / "data" / name).mkdir(parents=True)
        for split, (x, y) in splits.items():
            frame = pd.DataFrame(x, columns=FEATURES)
            frame["label"] = FORMULA_NAMES[y]
            frame.to_csv(tmp_path / "data" / name / f"{split}.csv", index=False)
    run = fedhpro.run(**TINY, dataset="clients", data_dir=str(tmp_path / "data"), out=str(tmp_path / "run"))
    x, _ = parts["site-0"]["test"]
    rows = pd.DataFrame(x[:4], columns=FEATURES)
    notes = ['=HYPERLINK("http://x","y")', "+cmd", "plain", "-0.5"]
    rows["=note"] = notes
    rows["offset"] = [-1.5, 2.0, -3.0, 4.0]
    rows.to_csv(tmp_path / "rows.csv", index=False)
    predict(run.out, [tmp_path / "rows.csv"])
    header, *cells = list(csv.reader(io.StringIO((tmp_path / "rows.predictions.csv").read_text())))
    assert header == FEATURES + ["'=note", "offset", "predicted"] + [f"p_{n}" for n in sorted(FORMULA_NAMES)]
    assert [row[len(FEATURES)] for row in cells] == ["'" + notes[0], "'+cmd", "plain", "-0.5"]
    assert [float(row[len(FEATURES) + 1]) for row in cells] == [-1.5, 2.0, -3.0, 4.0]
    assert {row[len(FEATURES) + 2] for row in cells} <= {"'" + name for name in FORMULA_NAMES}
    np.savez(tmp_path / "rows.npz", x=x[:4], y=np.zeros(4, dtype=np.int64))
    table = list(csv.DictReader(io.StringIO(predict(run.out, [tmp_path / "rows.npz"]))))
    assert table and {row["predicted"] for row in table} <= {"'" + name for name in FORMULA_NAMES}


def test_report_tables_escape_formula_looking_text_but_not_numbers():
    """``csv_text`` (every report's table.csv): text starting with = + - @ (or a tab) gets a leading ``'``."""
    text = csv_text(["=name", "value"], [["@evil", -1.25], ["-x", "-3"], ["ok", None]])
    assert list(csv.reader(io.StringIO(text))) == [["'=name", "value"], ["'@evil", "-1.25"], ["'-x", "-3"],
                                                   ["ok", ""]]


# ----------------------------------------------------------------------------------- a long CSV, bounded

#: the limit of the test below (FEDHPRO_MAX_ARRAY_BYTES): 16 MiB, a bound of 4 Mi rows of one column
SMALL_LIMIT = 16 << 20
#: a child process: the growth of its peak resident memory (ru_maxrss, KiB) while read_csv reads argv[1]
PEAK_CHILD = """
import resource, sys
from fedhpro.data.tables import read_csv
from fedhpro.errors import DataError
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    outcome = f"rows {len(read_csv(sys.argv[1]))}"
except DataError as error:
    outcome = str(error)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
print(outcome)
"""


@pytest.mark.slow
@pytest.mark.parametrize("header", [b"x\n", b'"x"\n'])  # a quoted field: the rows counted by the parser
def test_a_long_csv_is_refused_before_its_rows_are_held(tmp_path, header):
    """A file within the byte limit whose rows are over it (8 Mi one-byte rows at a bound of 4 Mi): refused while
    its process's peak memory grows by less than an eighth of the limit (before: 4 Mi rows parsed first, +57 MB
    here, +984 MB at a limit of 128 MiB)."""
    path = tmp_path / "long.csv"
    path.write_bytes(header + b"1\n" * (SMALL_LIMIT // 2 - 4))  # 8 Mi - 4 rows, each "1"
    shown = subprocess.run([sys.executable, "-c", PEAK_CHILD, str(path)], capture_output=True, text=True, check=True,
                           timeout=300, env={**os.environ, MAX_ARRAY_BYTES_VARIABLE: str(SMALL_LIMIT)}).stdout
    grown_kib, outcome = shown.strip().splitlines()
    assert f"has more than {SMALL_LIMIT // 4:,} rows of 1 columns" in outcome
    assert int(grown_kib) * 1024 < SMALL_LIMIT // 8, f"{int(grown_kib):,} KiB more"


def test_a_csv_at_its_row_bound_with_blank_lines_and_quoted_breaks_is_read(tmp_path, monkeypatch):
    """Line breaks that are no rows (blank lines, a line break inside a quoted cell) do not count: a file of
    exactly the bound's rows is read whole, as Python's csv module reads it."""
    monkeypatch.setenv(MAX_ARRAY_BYTES_VARIABLE, str(4 * 2 * 100))  # two columns: a bound of 100 rows
    rows = [[str(k), "a\nb" if k % 10 == 0 else "c"] for k in range(100)]
    text = "x,note\n" + "\n\n".join(",".join(f'"{cell}"' if "\n" in cell else cell for cell in row) for row in rows)
    path = tmp_path / "edge.csv"
    path.write_text(text + "\n\n\n")
    with path.open(newline="") as handle:
        assert [row for row in csv.reader(handle) if row][1:] == rows
    frame = read_csv(path)
    assert frame["x"].tolist() == list(range(100)) and frame["note"].tolist() == [row[1] for row in rows]
    path.write_text(text + "\n100,c\n")
    with pytest.raises(DataError, match="has more than 100 rows"):
        read_csv(path)
