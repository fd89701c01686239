"""Write the stored run folders beside this file, as the fedhpro of the day made them; tests/test_old_run_folders.py
checks that later code still loads them (resume, report, predict, compare tuned=, a checkpoint).

Run it only to add a folder of a new layout, never to refresh the old ones (that would test nothing):

    PYTHONPATH=src OMP_NUM_THREADS=1 python tests/data/old_runs/make.py

Every run is tiny (digits-offline at syn_size=200, 2% of the data, 3 clients, feature_dim 4, one thread) and
reads its data from ``$FEDHPRO_DATA_DIR`` (config.yaml keeps ``data_dir: null``), so the tests rebuild the
same cache anywhere and point the variable at it. Folders written:

- ``finished/``: ``fedhpro run`` of fedavg, 2 rounds, a checkpoint after each, the newest kept (model.pt,
  model.json, summary.json, metrics.jsonl, checkpoints/);
- ``interrupted/``: the same settings at 3 rounds, stopped (KeyboardInterrupt) after round 1 (0-based) ended:
  its newest checkpoint is round 1's, no summary.json; ``interrupted_reference.jsonl`` is the metrics.jsonl of
  the same run left to finish, what a resume must reproduce;
- ``tune/``: ``fedhpro tune`` of fedavg, 2 trials of 1 round: tuned.yaml (and its study, trials.csv).

Each run is written with a relative ``out=`` from this folder (config.yaml names no machine's path); the
figures (accuracy.png/.pdf/.svg) and the tuning trials' checkpoints and server states are deleted to keep the
folders small: no loader reads them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: the digits-offline cache every stored run reads (tests/conftest.py's digits_data_dir builds the same one)
SYN_SIZE, TEST_FRACTION, BUILD_SEED = 200, 0.05, 0
#: the settings of the stored runs (data_dir unset: $FEDHPRO_DATA_DIR)
RUN = ["method=fedavg", "clients=3", "local_epochs=1", "feature_dim=4", "seed=1", "device=cpu", "threads=1",
       "progress=false", "data.fraction=0.02", f"data.syn_size={SYN_SIZE}", f"data.test_fraction={TEST_FRACTION}",
       "checkpoint_every=1", "keep_checkpoints=1"]
TUNE = ["methods=[fedavg]", "trials=2", "pruner=none", "rounds=1", "clients=3", "local_epochs=1", "feature_dim=4",
        "device=cpu", "data.fraction=0.02", f"data.syn_size={SYN_SIZE}", f"data.test_fraction={TEST_FRACTION}"]


def fedhpro(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "fedhpro", *args], check=True, cwd=HERE)


def unread_files() -> list[Path]:
    """The stored files no loader reads: figures, and the tuning trials' checkpoints and server states."""
    figures = [path for suffix in ("png", "pdf", "svg") for path in HERE.rglob(f"*.{suffix}")]
    trials = [path for path in (HERE / "tune").rglob("trial-*/*") if path.name in ("checkpoints", "server_state.pt")]
    return figures + trials


def interrupted_run(out: Path) -> None:
    """``fedhpro run rounds=3`` stopped right after round 1 ended (in this process: deterministic)."""
    from fedhpro.api import run  # here, not at the top: the other folders are written by the command line
    from fedhpro.engines import lifecycle

    round_done = lifecycle.Run.round_done

    def stop_after_round_1(self, record, state):
        written = round_done(self, record, state)
        if record.round == 1:
            raise KeyboardInterrupt
        return written

    lifecycle.Run.round_done = stop_after_round_1
    try:
        run(overrides=[*RUN, "rounds=3", f"out={out}"], echo=False)
    except KeyboardInterrupt:
        pass
    finally:
        lifecycle.Run.round_done = round_done


def main() -> None:
    from fedhpro.data.digits_offline import build_digits_offline

    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as scratch:
        data = Path(scratch) / "data"
        build_digits_offline(data, seed=BUILD_SEED, test_fraction=TEST_FRACTION, syn_size=SYN_SIZE)
        os.environ["FEDHPRO_DATA_DIR"] = str(data)
        for name in ("finished", "interrupted", "tune"):
            shutil.rmtree(HERE / name, ignore_errors=True)
        fedhpro("run", *RUN, "rounds=2", "out=finished")
        os.chdir(HERE)
        interrupted_run(Path("interrupted"))
        reference = Path(scratch) / "reference"
        fedhpro("run", *RUN, "rounds=3", f"out={reference}")
        shutil.copyfile(reference / "metrics.jsonl", HERE / "interrupted_reference.jsonl")
        fedhpro("tune", *TUNE, "out=tune")
        for path in unread_files():
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()


if __name__ == "__main__":
    main()
