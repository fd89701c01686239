"""One command sets up and runs the whole test suite: the README's Test section gives it, ``.ci/run`` runs
exactly it, and what it does is checked by running it in a copy of the repository's scripts with every
program it calls replaced by a stub that records its call (no network, no install, no test run)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "test.sh"

#: what a stub does besides recording its arguments: ``python3 -m venv .venv`` makes an activate script
#: that puts the environment's bin (more stubs) first, as a real one does
STUB = """#!/bin/bash
echo "$(basename "$0") $*" >> "$CALLS"
if [ "$(basename "$0")" = python3 ] && [ "$1" = -c ]; then exit "${ENSUREPIP_STATUS:-0}"; fi
if [ "$(basename "$0")" = python3 ] && [ "$1 $2" = "-m venv" ]; then
    mkdir -p "$3/bin"
    printf 'PATH="%s:$PATH"\\n' "$PWD/$3/bin" > "$3/bin/activate"
    for tool in pip python ruff mypy mkdocs; do ln -sf "$0" "$3/bin/$tool"; done
fi
exit 0
"""


def _readme_test_command() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Test\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert len(blocks) == 1, f"the README's Test section should give one command, found {len(blocks)} blocks"
    (command,) = [line for line in blocks[0].splitlines() if line.strip()]
    return command.strip()


def test_readme_gives_one_command_and_ci_runs_exactly_it():
    command = _readme_test_command()
    assert command == "scripts/test.sh"
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines[-1] == command, lines  # the README's line as written
    assert os.access(SCRIPT, os.X_OK) and os.access(ROOT / ".ci" / "run", os.X_OK)


def _run(tmp_path: Path, present: set[str], root: bool = True, ensurepip: bool = True) -> list[str]:
    """scripts/test.sh run in a copy at ``tmp_path/repo`` with stubs of every program it calls; ``present``:
    which of nginx and chromium the machine has. Returns the calls, in order."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy2(SCRIPT, repo / "scripts" / "test.sh")
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for tool in ("python3", "apt-get", "sudo", *present):
        (stubs / tool).write_text(STUB)
        (stubs / tool).chmod(0o755)
    (stubs / "id").write_text(f"#!/bin/bash\necho {0 if root else 1000}\n")
    (stubs / "id").chmod(0o755)
    (stubs / "sudo").write_text('#!/bin/bash\necho "sudo $*" >> "$CALLS"\nexec "$@"\n')
    for tool in ("dirname", "basename", "mkdir", "ln", "printf"):  # the few real programs the script and stubs use
        found = shutil.which(tool)
        if found:
            (stubs / tool).symlink_to(found)
    calls = tmp_path / "calls"
    env = {"PATH": str(stubs), "CALLS": str(calls), "HOME": str(tmp_path),
           "ENSUREPIP_STATUS": "0" if ensurepip else "1"}
    done = subprocess.run(["/bin/bash", str(repo / "scripts" / "test.sh"), "-k", "readme"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return calls.read_text().splitlines()


@pytest.mark.slow
def test_on_a_machine_with_everything_it_installs_nothing_from_debian(tmp_path):
    calls = _run(tmp_path, {"nginx", "chromium"})
    assert calls == ["python3 -c import ensurepip", "python3 -m venv .venv", "pip install -e .[dev]",
                     "ruff check src bench", "mypy ", "mkdocs build --strict", "python -m pytest -k readme"]


@pytest.mark.slow
@pytest.mark.parametrize(("present", "root", "ensurepip", "packages"), [
    (set(), True, True, "nginx-light chromium"),
    ({"nginx"}, True, True, "chromium"),
    ({"chromium"}, False, True, "nginx-light"),
    (set(), False, False, "python3-venv nginx-light chromium"),
])
def test_on_a_fresh_machine_it_installs_what_is_missing_first(tmp_path, present, root, ensurepip, packages):
    calls = _run(tmp_path, present, root, ensurepip)
    # as root apt-get itself; otherwise through sudo (the sudo stub records its call, then runs apt-get's)
    apt = ["apt-get update", f"apt-get install -y {packages}"]
    expected = apt if root else [line for call in apt for line in (f"sudo {call}", call)]
    assert [call for call in calls if "apt-get" in call] == expected, calls
    first_pip = calls.index("pip install -e .[dev]")
    assert max(i for i, call in enumerate(calls) if "apt-get" in call) < first_pip
    assert calls[-4:] == ["ruff check src bench", "mypy ", "mkdocs build --strict", "python -m pytest -k readme"]
