"""A class with test rows but no training row at any site is refused, or kept when asked: the issue "Your data
read right".

The model can never predict such a class, so its test rows can only be counted wrong and the accuracy drops
without a word. The references are written by hand: which site's test file got rows of a class no training
file holds, and how many. Without ``data.untrained_classes=keep`` the federation is refused in one line
naming the class, the site (or file), the count and the fix; with it, the federation is built, the class
is among the classes and a note names it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

import fedhpro
from fedhpro.data.clients import ClientsOptions, build
from fedhpro.errors import ConfigError, DataError

#: one table of three sites; the class 'rare' has two test rows at site c and no training row anywhere
TABLE = """\
x1,x2,label,site,split
0.1,1.0,low,a,train
0.2,2.0,mid,a,train
0.3,3.0,high,a,train
0.4,1.5,low,a,test
0.5,2.5,mid,b,train
0.6,3.5,high,b,train
0.7,1.2,low,b,test
0.8,2.2,low,c,train
0.9,3.2,high,c,train
1.0,4.2,rare,c,test
1.1,4.4,rare,c,test
1.2,2.4,mid,c,test
"""


def _refusal(data_dir: Path, **options) -> str:
    with pytest.raises(DataError) as raised:
        build(ClientsOptions(**options), None, 0, str(data_dir))
    message = str(raised.value)
    assert "\n" not in message
    return message


def _untrained_note(notes: list[str]) -> str:
    found = [note for note in notes if "no training" in note]
    assert len(found) == 1, notes
    return found[0]


def test_a_table_s_test_only_class_is_refused_naming_class_site_count_and_fix(tmp_path):
    path = tmp_path / "table.csv"
    path.write_text(TABLE)
    message = _refusal(path)
    assert "'rare'" in message and "site c" in message and "2 test rows" in message
    assert "data.untrained_classes=keep" in message
    assert "'low'" not in message and "'mid'" not in message and "'high'" not in message


def test_keep_builds_the_federation_and_names_the_class_in_a_note(tmp_path):
    path = tmp_path / "table.csv"
    path.write_text(TABLE)
    federation = build(ClientsOptions(untrained_classes="keep"), None, 0, str(path))
    assert federation.partition["classes"] == ["high", "low", "mid", "rare"]
    note = _untrained_note(federation.notes)
    assert "'rare'" in note and "c" in note and "2 test rows" in note
    test_labels = federation.client_tests[2][1].tolist()
    assert test_labels.count(3) == 2  # site c's two rows of 'rare' are tested


def test_a_federation_where_every_test_class_is_trained_has_no_such_note(tmp_path):
    path = tmp_path / "table.csv"
    path.write_text(TABLE.replace("rare,c,test", "mid,c,test"))
    federation = build(ClientsOptions(), None, 0, str(path))
    assert not [note for note in federation.notes if "no training" in note]


def test_a_class_trained_at_another_site_is_no_untrained_class(tmp_path):
    # site a tests 'low' and trains it; site b tests 'high', which only site c trains: both are trained somewhere
    path = tmp_path / "table.csv"
    path.write_text(TABLE.replace("rare,c,test", "high,b,test"))
    build(ClientsOptions(), None, 0, str(path))


def test_folder_clients_with_integer_labels_name_the_test_file(tmp_path):
    rng = np.random.default_rng(0)
    for k, test_labels in enumerate(([0, 1, 1], [0, 1, 2, 2, 2])):  # class 2: three test rows at site-1 only
        folder = tmp_path / "sites" / f"site-{k}"
        folder.mkdir(parents=True)
        np.savez(folder / "train.npz", x=rng.normal(size=(6, 3)).astype(np.float32), y=np.array([0, 1] * 3))
        np.savez(folder / "test.npz", x=rng.normal(size=(len(test_labels), 3)).astype(np.float32),
                 y=np.array(test_labels))
    message = _refusal(tmp_path / "sites")
    assert "class 2" in message and "site-1" in message and "3 test rows" in message
    assert str(tmp_path / "sites" / "site-1" / "test.npz") in message
    federation = build(ClientsOptions(untrained_classes="keep"), None, 0, str(tmp_path / "sites"))
    assert federation.num_classes == 3 and "class 2" in _untrained_note(federation.notes)


def test_dataframe_sites_refuse_and_keep_as_a_table_does(tmp_path):
    path = tmp_path / "table.csv"
    path.write_text(TABLE)
    frame = pd.read_csv(path)
    with pytest.raises(DataError, match="'rare'.*2 test rows.*untrained_classes=keep") as raised:
        fedhpro.from_dataframes(frame)
    assert "site c" in str(raised.value)
    federation = fedhpro.from_dataframes(frame, untrained_classes="keep")
    assert "'rare'" in _untrained_note(federation.notes)
    with pytest.raises(ConfigError, match="untrained_classes"):
        fedhpro.from_dataframes(frame, untrained_classes="maybe")


def test_image_clients_refuse_a_test_class_folder_no_client_trains(tmp_path):
    colours = {"cat": (220, 40, 40), "dog": (40, 220, 40), "owl": (40, 40, 220)}
    layout = {"a": {"train": ["cat", "dog"], "test": ["cat", "owl"]}, "b": {"train": ["cat", "dog"], "test": ["dog"]}}
    for site, splits in layout.items():
        for split, names in splits.items():
            for name in names:
                folder = tmp_path / "pets" / site / split / name
                folder.mkdir(parents=True)
                for i in range(2):
                    Image.fromarray(np.full((4, 4, 3), colours[name], np.uint8)).save(folder / f"{i}.png")
    (tmp_path / "pets" / "b" / "train" / "owl").mkdir()  # an empty training folder trains nothing
    message = _refusal(tmp_path / "pets")
    assert "'owl'" in message and "2 test images" in message and "client a" in message
    assert "data.untrained_classes=keep" in message
    federation = build(ClientsOptions(untrained_classes="keep"), None, 0, str(tmp_path / "pets"))
    assert "owl" in federation.partition["classes"] and "'owl'" in _untrained_note(federation.notes)
