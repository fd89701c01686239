"""float32 against bf16 parity: FedHPro at both precisions on several settings, then the parity table.

For every setting (``--settings NAME=OVERRIDES``; by default the default run, one label-skew and one long-tail
setting) and both precisions, one ``fedhpro compare methods=[fedhpro] seeds=[...]`` into
``<out>/<setting>/<precision>/`` (``float32``: ``amp=off``; ``bf16``: ``amp=bf16``, with ``channels_last=auto``
on for the cnn), one setting after the other, float32 first; finished runs in those folders are reused and
interrupted ones continue, as ``fedhpro compare`` does. Then ``fedhpro report <out>`` writes, in
``<out>/report/``, the seed table and the parity table (parity.md, .csv, .json): per setting the float32 and
bf16 mean ± std of the final accuracy (AVG and per domain), the difference of means, the larger seed std and
whether the difference lies within it.

    python bench/precision_parity.py --out results/parity                   # 3 settings x 3 seeds x 2 precisions
    python bench/precision_parity.py --out results/parity --jobs 2 --threads 1
    python bench/precision_parity.py --out results/parity --settings default= "iid=partition=iid"

Cost, measured on a 2-core Xeon (AMX): the 18 runs took 44 minutes at ``--threads 1``, one after the other
beside other work (load 3-4): a float32 run ~200 s, a bf16 one ~115 s; alone at 2 threads a float32 default
run takes 110-130 s. ``amp=bf16`` needs a CPU with
native bfloat16 (AVX512-BF16 or AMX) or a GPU; elsewhere the script stops before any run, saying so.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

#: the study's settings: name -> the KEY=VALUE overrides of ``fedhpro compare`` (on the default run)
DEFAULT_SETTINGS = {
    "default": "",
    "label-skew": "partition=dirichlet data.domains=[mnist,optdigits]",
    "long-tail": "partition=longtail",
}
#: the two precisions: folder name -> the ``amp`` setting
PRECISIONS = {"float32": "off", "bf16": "bf16"}


def parse_setting(text: str) -> tuple[str, list[str]]:
    """``"label-skew=partition=dirichlet data.domains=[mnist,optdigits]"`` -> the name and its overrides."""
    name, separator, overrides = text.partition("=")
    if not separator or not name.strip() or "/" in name or name.startswith("."):
        raise SystemExit(f"--settings {text!r}: give NAME=OVERRIDES, e.g. long-tail=partition=longtail "
                         "(NAME a folder name; the overrides may be empty: default=)")
    items = shlex.split(overrides)
    bad = [item for item in items if "=" not in item]
    if bad:
        raise SystemExit(f"--settings {text!r}: {bad[0]!r} is not KEY=VALUE")
    return name.strip(), items


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/parity", help="the study's folder (default results/parity)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (default 0 1 2)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (fedhpro compare's jobs=)")
    parser.add_argument("--threads", default="auto",
                        help="threads of each run (fedhpro compare's threads=; auto: the cores / jobs)")
    parser.add_argument("--settings", nargs="+", metavar="NAME=OVERRIDES",
                        default=[f"{name}={overrides}" for name, overrides in DEFAULT_SETTINGS.items()],
                        help="the settings, each a folder name and its KEY=VALUE overrides (default: "
                             + "; ".join(f"{name}={value}" for name, value in DEFAULT_SETTINGS.items()) + ")")
    args = parser.parse_args(argv)
    settings = dict(parse_setting(text) for text in args.settings)

    import torch

    from fedhpro import runtime
    from fedhpro.compare import compare
    from fedhpro.config import parse_override
    from fedhpro.errors import FedHProError
    from fedhpro.reports.runs import report

    problem = runtime.precision_problem("bf16", torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if problem is not None:
        print(f"precision_parity: {problem}", file=sys.stderr)
        return 2
    out = Path(args.out)
    try:
        for name, overrides in settings.items():
            for precision, amp in PRECISIONS.items():
                pairs = dict(map(parse_override, overrides))
                pairs.update({"amp": amp, "threads": args.threads, "progress": False})
                folder = out / name / precision
                print(f"== {name}, {precision}: fedhpro compare methods=[fedhpro] seeds={args.seeds} "
                      f"{' '.join(overrides)} amp={amp} out={folder}", flush=True)
                compare(["fedhpro"], args.seeds, pairs, folder, jobs=args.jobs)
        # <out>/report is this study's: rebuilt as runs are added (force), where a plain report refuses to
        # replace the report of fewer runs
        report([out], out / "report", force=True)
    except FedHProError as error:
        print(f"precision_parity: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
