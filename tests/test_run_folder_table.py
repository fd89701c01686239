"""docs/reference/run-folder.md's table of what a run writes names every file a real run writes: a tiny run
of a global model interrupted and resumed (checkpoints/, server_state.pt, tsne), and one whose clients keep
their own models (models/). The files are listed from disk, the table is parsed from the page: a new file a run
writes fails here until the table has its row."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION

from fedhpro.api import run
from fedhpro.engines import lifecycle

PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "run-folder.md"


def table_names() -> list[str]:
    """The names in the first column of the page's table under "What a run writes"."""
    section = PAGE.read_text().split("## What a run writes", 1)[1].split("\n## ", 1)[0]
    names = []
    for line in section.splitlines():
        if line.startswith("| `"):
            names += re.findall(r"`([^`]+)`", line.split("|")[1])
    return names


def matches(path: str, name: str) -> bool:
    """Whether a written ``path`` (relative, ``/``-separated) is the table's ``name``: ``<k>`` any one part,
    ``NNNNNN`` six digits, a name ending in ``/`` a folder whose layout is another tool's."""
    if name.endswith("/"):
        return path.startswith(name)
    pattern = re.escape(name).replace("NNNNNN", r"\d{6}")
    pattern = re.sub(r"<[^>]+>", r"[^/]+", pattern.replace(r"\<", "<").replace(r"\>", ">"))
    return re.fullmatch(pattern, path) is not None


def written(folder: Path) -> set[str]:
    return {path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file()}


def tiny(data_dir: Path, out: Path, *extra: str) -> list[str]:
    return ["rounds=2", "clients=4", "data.fraction=0.02", f"data.syn_size={DIGITS_SYN_SIZE}",
            f"data.test_fraction={DIGITS_TEST_FRACTION}", "feature_dim=16", "seed=2", f"data_dir={data_dir}",
            "threads=1", "progress=false", f"out={out}", *extra]


def test_the_matcher_reads_the_tables_patterns():
    assert matches("checkpoints/round-000002.pt", "checkpoints/round-NNNNNN.pt")
    assert not matches("checkpoints/round-2.pt", "checkpoints/round-NNNNNN.pt")
    assert matches("models/client_3.pt", "models/client_<k>.pt")
    assert not matches("models/client_3.safetensors", "models/client_<k>.pt")
    assert matches("tensorboard/events.out.tfevents.1", "tensorboard/") and not matches("model.pt", "tensorboard/")


@pytest.fixture(scope="module")
def run_folders(digits_data_dir, tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("folders")
    resumed = root / "resumed"
    round_done = lifecycle.Run.round_done

    def interrupted(self, record, state):
        done = round_done(self, record, state)
        if record.round == 0:
            raise KeyboardInterrupt
        return done

    patch = pytest.MonkeyPatch()
    patch.setattr(lifecycle.Run, "round_done", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            run(overrides=tiny(digits_data_dir, resumed, "method=fedhpro", "checkpoint_every=1", "tsne=true"))
    finally:
        patch.undo()
    assert (resumed / "checkpoints").is_dir() and not (resumed / "summary.json").exists()
    run(overrides=[f"resume={resumed}"])
    personal = root / "personal"
    run(overrides=tiny(digits_data_dir, personal, "method=fedavg", "heterogeneity=htfe2", "rounds=1"))
    return [resumed, personal]


@pytest.mark.slow
def test_every_file_a_run_writes_has_a_row(run_folders):
    names = table_names()
    resumed, personal = run_folders
    found = written(resumed) | written(personal)
    # the files the run documents most (and the ones the issue found missing) are among those checked
    assert {"server_state.pt", "model.pt", "summary.json", "tsne.npz"} <= found
    assert any(path.startswith("checkpoints/") for path in found)
    assert any(path.startswith("models/") for path in written(personal))
    missing = sorted(path for path in found if not any(matches(path, name) for name in names))
    assert not missing, f"{PAGE.name}'s table has no row for {missing}"


def test_every_name_the_driver_guards_has_a_row():
    # lifecycle.RUN_FILES: what a new run refuses to write over; each of them is a file or folder of the table
    names = table_names()
    for held in lifecycle.RUN_FILES:
        assert any(name == held or name.startswith(f"{held}/") for name in names), held
