"""What the README's and the docs' examples write, run in a clone, is ignored by git (the clone stays clean):
every path an example writes to (``out=``, ``--out``, ``--state``, ``Image...save(...)``, ``> file``) is asked
of git itself (``git check-ignore``), as are the names older versions of the README left behind."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
#: "-> None" (a return annotation) is no redirection
WRITES = re.compile(r"""(?:\bout=|--out |--state |\.save\(\s*(?:Path\()?['"]|mkdir -p |(?<!-)> )"""
                    r"""["']?([A-Za-z0-9_./$-]+)""")
#: what the README's image examples wrote beside the clone before they wrote under runs/ (the issue's report)
LEFT_BY_OLD_EXAMPLES = ["blank.png", "shapes/train/a/0.png", "shapes-run/summary.json"]


def written_paths() -> set[str]:
    """The relative paths the pages' bash and python blocks write (absolute ones, /tmp and variables aside)."""
    found = set()
    for page in PAGES:
        for block in re.findall(r"```(?:bash|python)\n(.*?)```", page.read_text(), flags=re.S):
            code = "\n".join(line.split(" # ")[0] for line in block.splitlines())  # comments aside
            for path in WRITES.findall(code):
                path = path.replace("$PWD/", "").rstrip(".,;")
                if path and not path.startswith(("/", "$", "-", "&")) and path not in {"...", "auto", "DIR"}:
                    found.add(path)
    return found


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs git and a clone")
def test_what_examples_write_is_ignored():
    paths = sorted(written_paths()) + LEFT_BY_OLD_EXAMPLES
    assert "runs/blank.png" in paths and "fedhpro-up" in paths  # the extraction finds the README's writes
    asked = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], input="\n".join(paths), text=True,
                           capture_output=True, cwd=ROOT, check=False)
    ignored = set(asked.stdout.split())
    assert [path for path in paths if path not in ignored] == []
