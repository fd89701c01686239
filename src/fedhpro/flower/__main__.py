"""``python -m fedhpro.flower``: the commands of fedhpro's Flower apps.

- ``new-app DIR``: write a Flower app (its pyproject.toml) that runs fedhpro;
- ``run APP CONNECTION --run-config ...``: submit a run, follow its log, and
  exit 0 only when it ended ``finished:completed``.

The deployment's commands (``certificates``, ``gate``, ``up``) are
``python -m fedhpro.deploy`` (:mod:`fedhpro.deploy`); given here, they exit 2 with one line saying so.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fedhpro.deploy import up
from fedhpro.errors import run_handler
from fedhpro.flower.settings import app_pyproject_toml

#: the commands that moved to ``python -m fedhpro.deploy``
MOVED = ("certificates", "gate", "up")


def new_app(args: argparse.Namespace) -> int:
    target = Path(args.dir)
    target.mkdir(parents=True, exist_ok=True)
    (target / "pyproject.toml").write_text(app_pyproject_toml())
    print(f"wrote {target / 'pyproject.toml'}; run it with: flwr run {target} <connection> --run-config 'rounds=2'")
    return 0


def submit_run(args: argparse.Namespace) -> int:
    return up.submit(args.app, args.connection, args.run_config, args.federation_config, stream=not args.no_stream)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fedhpro.flower", description="fedhpro on Flower")
    commands = parser.add_subparsers(dest="command", required=True)
    app = commands.add_parser("new-app", help="write a Flower app (pyproject.toml) that runs fedhpro")
    app.add_argument("dir")
    app.set_defaults(handler=new_app)
    runs = commands.add_parser(
        "run", help="flwr run, follow the log, exit 0 only for finished:completed",
        description="Submit APP to CONNECTION (flwr run), stream its log (flwr log), then exit 0 if flwr ls "
                    "reports finished:completed, else 1 with one line (2 if the submission was refused).")
    runs.add_argument("app")
    runs.add_argument("connection")
    runs.add_argument("--run-config", help="as for flwr run, e.g. 'rounds=2 out=\"/abs/out\"'")
    runs.add_argument("--federation-config")
    runs.add_argument("--no-stream", action="store_true", help="do not print the run's log; only wait")
    runs.set_defaults(handler=submit_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in MOVED:
        print(f"fedhpro.flower: '{argv[0]}' moved: python -m fedhpro.deploy {argv[0]} ...", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    return run_handler(args, "python -m fedhpro.flower")


if __name__ == "__main__":
    sys.exit(main())
