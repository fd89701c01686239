#!/usr/bin/env bash
# The whole test suite on a fresh machine, in one command (README: Test; .ci/run runs exactly this):
# the Debian packages the tests need when they are missing (python3-venv: the virtual environment;
# nginx-light: the access layer of the Flower deployment tests; chromium: the browser tests/test_docs.py
# renders the documentation site in), a virtual environment at .venv with fedhpro's developer install,
# then the linter, the type checker, the strict documentation build and the tests. Arguments go to pytest
# (scripts/test.sh tests/test_docs.py -k README).
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
python3 -c "import ensurepip" 2> /dev/null || missing+=(python3-venv)
command -v nginx > /dev/null || missing+=(nginx-light)
command -v chromium > /dev/null || command -v chromium-browser > /dev/null || missing+=(chromium)
if [ "${#missing[@]}" -gt 0 ]; then
    # system packages need root: sudo when this is not root
    as_root=()
    if [ "$(id -u)" -ne 0 ]; then as_root=(sudo); fi
    "${as_root[@]}" apt-get update
    "${as_root[@]}" apt-get install -y "${missing[@]}"
fi

python3 -m venv .venv
. .venv/bin/activate
pip install -e ".[dev]"

ruff check src bench && mypy && mkdocs build --strict && python -m pytest "$@"
