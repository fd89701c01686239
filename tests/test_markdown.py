"""Every Markdown file of the repository closes each code fence it opens, on a line of its own.

A closing fence followed by text (```` ``` Decoded pixels ````) is no closing fence to a Markdown renderer:
the block runs on to the next fence, the page's later headings and commands render as code and drop out of
the table of contents, and ``mkdocs build --strict`` says nothing. The rules checked are CommonMark's: a
fence is three or more backticks or tildes, indented at most three spaces (more inside a list item or an
admonition), and only a fence of the same character, at least as long, with nothing but spaces after it,
closes the block.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the repository's Markdown: the README, the documentation site, the examples' and the benchmarks' pages
MARKDOWN = sorted({*ROOT.glob("README.md"), *ROOT.glob("docs/**/*.md"), *ROOT.glob("examples/**/*.md"),
                   *ROOT.glob("bench/*.md")})
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<rest>.*)$")


def fence_problems(text: str, where: str) -> list[str]:
    """One line per fence problem of a Markdown ``text``: text after a closing fence (``where:LINE``), and a
    block still open at the end of the file (naming the line of its opening fence)."""
    problems = []
    opened: tuple[str, int] | None = None  # (fence, 1-based line) of the block we are in
    for number, line in enumerate(text.split("\n"), 1):
        match = FENCE.match(line)
        if not match:
            continue
        fence, rest = match.group("fence"), match.group("rest")
        if opened is None:
            if fence[0] == "`" and "`" in rest:  # inline code (```a```), not a fence
                continue
            opened = (fence, number)
            continue
        if fence[0] != opened[0][0] or len(fence) < len(opened[0]):
            continue  # a shorter or other fence inside the block is the block's text
        if rest.strip():
            problems.append(f"{where}:{number}: text after the closing fence ({line.strip()!r}); Markdown reads "
                            f"no closing fence there, so the block opened on line {opened[1]} runs on: put the "
                            "text on the next line")
        opened = None  # read it as the author meant it, so that one mistake is reported once
    if opened is not None:
        problems.append(f"{where}:{opened[1]}: the code block opened here ({opened[0]}) is never closed; close it "
                        f"with {opened[0]} on a line of its own")
    return problems


def test_fence_checker_on_known_pages():
    """The checker against pages whose problems are known by hand: a clean page, text after a closing fence
    (the own-images tutorial's old mistake), a block never closed, and fences that are not problems."""
    clean = "# t\n\n```bash\nls\n```\n\ntext ```inline``` text\n\n    ```python\n    print(1)\n    ```\n"
    assert fence_problems(clean, "clean.md") == []
    glued = "```text\nout\n``` Decoded pixels\nare cached.\n\n## 3. Next\n\n```bash\nls\n```\n"
    assert fence_problems(glued, "glued.md") == [
        "glued.md:3: text after the closing fence ('``` Decoded pixels'); Markdown reads no closing fence there, "
        "so the block opened on line 1 runs on: put the text on the next line"]
    assert fence_problems("a\n```bash\nls\n", "open.md") == [
        "open.md:2: the code block opened here (```) is never closed; close it with ``` on a line of its own"]
    # a longer fence holds a shorter one as text; tildes and backticks do not close each other
    assert fence_problems("````markdown\n```bash\nls\n```\n````\n~~~\n```\n~~~\n", "nested.md") == []
    assert fence_problems("```\nx\n", "x.md") != []


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda page: str(page.relative_to(ROOT)))
def test_markdown_fences_close(page: Path):
    """No Markdown file of the repository has text after a closing fence or a block left open."""
    problems = fence_problems(page.read_text(encoding="utf-8"), str(page.relative_to(ROOT)))
    assert not problems, "\n".join(problems)


def test_every_markdown_file_is_checked():
    """The checked files include the README, every docs page, and the examples' and benchmarks' pages."""
    names = {str(page.relative_to(ROOT)) for page in MARKDOWN}
    assert {"README.md", "docs/index.md", "docs/tutorials/own-images.md", "bench/RESULTS.md",
            "examples/own_method/README.md"} <= names
    assert len([n for n in names if n.startswith("docs/")]) == len(list((ROOT / "docs").rglob("*.md")))
