"""``fedhpro reproduce NAME [scale=paper|smoke] [seeds=[...]] [out=DIR] [KEY=VALUE ...]``: one command per
table and figure of the paper.

Each target is one YAML file in ``configs/paper/`` (``NAME.yaml``): the paper's settings (Section 5.1,
Appendix C.1), a ``smoke`` section that shrinks them to minutes on 2 CPU cores, the rows (``variants``:
method + switches), and one or more ``parts`` (a data set, or a swept setting), each with its columns
and the paper's published numbers. ``reproduce`` runs every (part, scenario, variant, seed), reusing
finished runs with the same config (runs are shared between targets: Table A3's runs serve Table A4,
A7, A8 and Figure 4), then writes ``table.md`` / ``table.csv`` in the paper's layout with the
published numbers beside ours, the figures as PNG, and a line per part saying whether FedHPro's
ordering against the baselines matches the paper's.

Data: a part whose data set is absent is skipped with one line naming it, except that at
``scale=smoke`` a Digits part falls back to ``digits-offline`` (optdigits standing in for USPS and
mnistm for SVHN), said in the output.

The modules, in the order of a reproduction:

- :mod:`.targets` reads a target file strictly (an unknown key is an error naming it);
- :mod:`.availability` checks a part's data files without building its federation;
- :mod:`.running` runs (or reuses) its runs;
- :mod:`.builders` turns them into rows, one builder per layout (:mod:`.table`: what they produce;
  :mod:`.studies`: the CPU-scale studies ``label_skew``, ``gradient_matching``, ``robustness`` and
  ``faithfulness``, with their own tables and CSV columns);
- :mod:`.emitter` writes the figures, ``table.md``, ``table.csv`` and ``reproduce.json``;
- :mod:`.command` ties them together (:func:`reproduce`) and reads the command line (:func:`main`).
"""

from __future__ import annotations

from fedhpro.reports.runs import RunData
from fedhpro.reproduce.availability import FALLBACKS, missing_data, resolve_data
from fedhpro.reproduce.builders import BUILDERS, build_table
from fedhpro.reproduce.command import main, reproduce
from fedhpro.reproduce.emitter import draw_figures, emit, markdown, section_markdown
from fedhpro.reproduce.running import PartResult, run_part
from fedhpro.reproduce.table import Figure, Section, Table
from fedhpro.reproduce.targets import (
    LAYOUTS,
    SCALES,
    Part,
    Scenario,
    Target,
    Variant,
    available_targets,
    configs_dir,
    load_target,
)

__all__ = ["BUILDERS", "FALLBACKS", "LAYOUTS", "SCALES", "Figure", "Part", "PartResult", "RunData", "Scenario",
           "Section", "Table", "Target", "Variant", "available_targets", "build_table", "configs_dir",
           "draw_figures", "emit", "load_target", "main", "markdown", "missing_data", "reproduce",
           "resolve_data", "run_part", "section_markdown"]
