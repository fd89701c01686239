"""The names the modules and tests outside the engines import from the run driver, which is now split by job:
the run's lifecycle (:mod:`fedhpro.engines.lifecycle`), the engine protocols (:mod:`fedhpro.engines.interface`),
summary.json (:mod:`fedhpro.engines.summary`), the console text (:mod:`fedhpro.engines.printout`), the
size-claim warnings (:mod:`fedhpro.engines.size_claims`) and a round's shared pieces
(:mod:`fedhpro.engines.one_round`). New code imports from those modules; this one only keeps the old import
paths working."""

from fedhpro.engines.interface import Engine, InProcessEngine
from fedhpro.engines.lifecycle import (
    RUN_FILES,
    CheckpointSchedule,
    Run,
    check_new_run_folder,
    claimed_run_folder,
    execute,
    run_title,
    train,
)
from fedhpro.engines.one_round import RoundClock, count_correct, round_extra, test_client
from fedhpro.engines.printout import ConsoleVoice, Voice, privacy_line, progress_text, site_accuracy_line, warn_line
from fedhpro.engines.size_claims import pooled_share_warnings
from fedhpro.engines.summary import final_accuracy, run_summary, site_accuracy
from fedhpro.methods.no_grad import eval_forward

__all__ = ["RUN_FILES", "CheckpointSchedule", "ConsoleVoice", "Engine", "InProcessEngine", "RoundClock", "Run",
           "Voice", "check_new_run_folder", "claimed_run_folder", "count_correct", "eval_forward", "execute",
           "final_accuracy", "pooled_share_warnings", "privacy_line", "progress_text", "round_extra", "run_summary",
           "run_title", "site_accuracy", "site_accuracy_line", "test_client", "train", "warn_line"]
