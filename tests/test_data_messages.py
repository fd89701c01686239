"""Messages about own data point to the right place: the issue "Your data read right".

Each bad table is written here line by line, so the reference for every message is the line the bad cell was
written into, counted by hand (the header is row 1, the first data row is row 2, as a spreadsheet shows the
file). A message must name the file, the site, that row and the offending value; its advice must fit the
column (a number column holding one word is a cell to correct, not a column to encode); missing values are
counted in rows of the file, not of a site's slice; a wrong path is "no such file or folder" with what was
expected; and a close column, label or path name is offered ("did you mean").
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import fedhpro
from fedhpro.data.clients import ClientsOptions, build, load_client, scan_client
from fedhpro.errors import DataError

HEADER = "area,rooms,label,site,split"
#: one table of two sites, one line per row: line k of this list is row k + 2 of the file (the header is row 1)
ROWS = [
    "3800.0,3,cheap,a,train",    # row 2
    "4100.5,4,dear,a,train",     # row 3
    "3900.0,3,cheap,a,train",    # row 4
    "4200.0,5,dear,a,test",      # row 5
    "2800.0,2,cheap,b,train",    # row 6
    "5100.0,6,dear,b,train",     # row 7
    "2900.0,2,cheap,b,train",    # row 8
    "5300.0,6,dear,b,train",     # row 9
    "3000.0,3,cheap,b,test",     # row 10
]


def _table(path: Path, rows: list[str], header: str = HEADER) -> Path:
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


def _with_cell(rows: list[str], row: int, column: int, value: str) -> list[str]:
    """``rows`` with the cell of file row ``row`` (header = 1) in column ``column`` replaced by ``value``."""
    changed = list(rows)
    cells = changed[row - 2].split(",")
    cells[column] = value
    changed[row - 2] = ",".join(cells)
    return changed


def _refusal(data_dir: Path | str, **options) -> str:
    with pytest.raises(DataError) as raised:
        build(ClientsOptions(**options), None, 0, str(data_dir))
    message = str(raised.value)
    assert "\n" not in message
    return message


def test_a_word_in_a_number_column_is_named_at_its_file_site_row_and_value(tmp_path):
    # the user's case: 'unknown' written into row 8 (site b); site a, sorted first, holds only numbers
    path = _table(tmp_path / "homes.csv", _with_cell(ROWS, 8, 0, "unknown"))
    message = _refusal(path)
    assert str(path) in message and "site b" in message
    assert "'unknown'" in message and "row 8" in message and "header" in message
    assert "not a number" in message
    assert "3800" not in message and "site a" not in message
    assert "get_dummies" not in message  # one bad cell in a number column: no categorical encoding


def test_the_other_sites_numbers_in_a_column_with_a_word_are_still_numbers(tmp_path):
    # the word is at site b's test rows only: site a's cells of that column are numbers, and are read as such
    # up to the bad cell (the refusal names b, not a)
    message = _refusal(_table(tmp_path / "homes.csv", _with_cell(ROWS, 10, 1, "three")))
    assert "site b" in message and "'three'" in message and "row 10" in message and "'rooms'" in message


def test_several_words_in_a_number_column_are_counted_with_their_rows(tmp_path):
    rows = _with_cell(_with_cell(ROWS, 6, 0, "tbd"), 9, 0, "?")
    message = _refusal(_table(tmp_path / "homes.csv", rows))
    assert "'tbd'" in message and "row 6" in message and "row 9" in message and "2 cells" in message


def test_a_column_of_text_is_advised_to_be_encoded(tmp_path):
    header = "colour,rooms,label,site,split"
    rows = [",".join([colour, *line.split(",")[1:]]) for colour, line in zip(["red", "blue", "red", "green", "red",
                                                                               "blue", "red", "green", "blue"], ROWS)]
    message = _refusal(_table(tmp_path / "homes.csv", rows, header))
    assert "'colour'" in message and "get_dummies" in message and "'red'" in message and "row 2" in message


def test_missing_values_are_counted_in_rows_of_the_file(tmp_path):
    # rows 7 and 9 of the file are site b's 2nd and 4th rows: the message gives the file's numbers
    rows = _with_cell(_with_cell(ROWS, 7, 1, ""), 9, 1, "")
    message = _refusal(_table(tmp_path / "homes.csv", rows))
    assert "site b" in message and "2 missing values" in message and "rows 7, 9" in message
    assert "header" in message


def test_an_empty_label_and_an_odd_split_name_their_row(tmp_path):
    message = _refusal(_table(tmp_path / "labels.csv", _with_cell(ROWS, 4, 2, "")))
    assert "'label'" in message and "row 4" in message and "missing" in message
    message = _refusal(_table(tmp_path / "split.csv", _with_cell(ROWS, 5, 4, "holdout")))
    assert "'holdout'" in message and "row 5" in message


def test_an_infinite_value_and_a_value_beyond_float32_name_their_row_and_value(tmp_path):
    message = _refusal(_table(tmp_path / "inf.csv", _with_cell(ROWS, 7, 0, "inf")))
    assert "'area'" in message and "inf" in message and "row 7" in message and "site b" in message
    message = _refusal(_table(tmp_path / "big.csv", _with_cell(ROWS, 3, 0, "1e39")))
    assert "1e+39" in message and "row 3" in message and "float32" in message and "site a" in message


def test_rows_with_more_cells_than_the_header_are_refused_not_shifted(tmp_path):
    # pandas would take the extra first cells as the index, shifting every value one column to the right
    rows = [line + "," for line in ROWS]  # a trailing comma on every data row: 6 cells under 5 names
    message = _refusal(_table(tmp_path / "commas.csv", rows))
    assert "row 2" in message and "6" in message and "5" in message and "header" in message


def test_a_client_folder_csv_names_the_client_file_row_and_value(tmp_path):
    for site in ("a", "b"):
        (tmp_path / "sites" / site).mkdir(parents=True)
        for split in ("train", "test"):
            lines = ["x,label", "1.5,0", "2.5,1", "3.5,0", "4.5,1"]
            if site == "b" and split == "train":
                lines[3] = "oops,0"  # row 4 of b/train.csv
            (tmp_path / "sites" / site / f"{split}.csv").write_text("\n".join(lines) + "\n")
    message = _refusal(tmp_path / "sites")
    assert str(tmp_path / "sites" / "b" / "train.csv") in message and "client b" in message
    assert "'oops'" in message and "row 4" in message and "not a number" in message
    # a Flower node reads its own folder with the same functions: the same line
    for call in (lambda: scan_client(tmp_path / "sites" / "b", ClientsOptions()),
                 lambda: load_client(tmp_path / "sites" / "b", ClientsOptions(), ["0", "1"])):
        with pytest.raises(DataError) as raised:
            call()
        assert str(raised.value) == message


def test_a_dataframe_cell_is_named_by_its_index_label(tmp_path):
    frame = pd.read_csv(_table(tmp_path / "homes.csv", ROWS)).set_index(pd.Index([f"h{k}" for k in range(9)]))
    frame["area"] = frame["area"].astype(object)
    frame.loc["h6", "area"] = "unknown"
    with pytest.raises(DataError) as raised:
        fedhpro.from_dataframes(frame)
    message = str(raised.value)
    assert "site b" in message and "'unknown'" in message and "'h6'" in message and "not a number" in message
    assert "row 8" not in message  # no file: the row is its index label


def test_a_wrong_path_is_no_such_file_or_folder_with_a_close_sibling(tmp_path):
    _table(tmp_path / "homes.csv", ROWS)
    message = _refusal(tmp_path / "home.csv")
    assert "no such file or folder" in message and ".csv file" in message
    assert f"did you mean {tmp_path / 'homes.csv'}" in message
    (tmp_path / "Clinics").mkdir()
    message = _refusal(tmp_path / "clinic")
    assert "no such file or folder" in message and "folder" in message
    assert f"did you mean {tmp_path / 'Clinics'}" in message
    message = _refusal(tmp_path / "elsewhere.csv")
    assert "no such file or folder" in message and "did you mean" not in message


def test_a_node_s_missing_folder_offers_a_close_sibling(tmp_path):
    (tmp_path / "site-1").mkdir()
    with pytest.raises(DataError) as raised:
        scan_client(tmp_path / "site1", ClientsOptions())
    assert "no such folder" in str(raised.value) and f"did you mean {tmp_path / 'site-1'}" in str(raised.value)


@pytest.mark.parametrize("option, value, fix", [
    ("label_column", "Label", "data.label_column=label"),
    ("site_column", "Site", "data.site_column=site"),
    ("split_column", "splits", "data.split_column=split"),
])
def test_a_close_column_name_is_offered(tmp_path, option, value, fix):
    message = _refusal(_table(tmp_path / "homes.csv", ROWS), **{option: value})
    assert f"{value!r}" in message and f"did you mean {fix}" in message
    assert "(site " not in message  # the table lacks the column, not one site


def test_a_client_folder_without_the_label_column_offers_the_close_one(tmp_path):
    for site in ("a", "b"):
        (tmp_path / "sites" / site).mkdir(parents=True)
        for split in ("train", "test"):
            (tmp_path / "sites" / site / f"{split}.csv").write_text("x,Diagnosis\n1.0,0\n2.0,1\n")
    message = _refusal(tmp_path / "sites", label_column="diagnosis")
    assert "did you mean data.label_column=Diagnosis" in message


def test_a_close_label_name_in_data_classes_is_offered(tmp_path):
    message = _refusal(_table(tmp_path / "homes.csv", ROWS), classes=["cheap", "Dear"])
    assert "'dear'" in message and "did you mean 'Dear'" in message


def test_a_close_class_folder_name_in_data_classes_is_offered(tmp_path):
    from PIL import Image

    for site in ("a", "b"):
        for split in ("train", "test"):
            for name in ("cat", "dog"):
                folder = tmp_path / "pets" / site / split / name
                folder.mkdir(parents=True)
                Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(folder / "0.png")
    message = _refusal(tmp_path / "pets", classes=["cat", "dogs"])
    assert "'dog'" in message and "did you mean 'dogs'" in message


@pytest.mark.slow
def test_messages_stay_one_line_through_the_command_line(tmp_path, capsys):
    from fedhpro import cli

    path = _table(tmp_path / "homes.csv", _with_cell(ROWS, 8, 0, "unknown"))
    code = cli.main(["run", "dataset=clients", f"data_dir={path}", f"out={tmp_path / 'run'}", "progress=false"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and err.startswith("fedhpro: error:") and "\n" not in err and "Traceback" not in err
    assert "'unknown'" in err and "row 8" in err
    assert not (tmp_path / "run").exists()


def test_a_bad_cell_in_test_csv_names_test_csv_not_train_csv(tmp_path):
    folder = tmp_path / "table"
    folder.mkdir()
    (folder / "train.csv").write_text("x,label,site\n1.0,0,a\n2.0,1,a\n3.0,0,b\n4.0,1,b\n")
    (folder / "test.csv").write_text("x,label,site\n1.5,0,a\n2.5,1,b\nbroken,0,b\n")  # row 4 of test.csv
    message = _refusal(folder)
    assert str(folder / "test.csv") in message and "train.csv" not in message
    assert "site b" in message and "'broken'" in message and "row 4" in message
