"""``python -m fedhpro.flower new-app DIR``: write a Flower app (its pyproject.toml) that runs fedhpro."""

from __future__ import annotations

import sys
from pathlib import Path

from fedhpro.flower.settings import app_pyproject_toml


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "new-app":
        print("usage: python -m fedhpro.flower new-app DIR", file=sys.stderr)
        return 2
    target = Path(args[1])
    target.mkdir(parents=True, exist_ok=True)
    (target / "pyproject.toml").write_text(app_pyproject_toml())
    print(f"wrote {target / 'pyproject.toml'}; run it with: flwr run {target} <connection> --run-config 'rounds=2'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
